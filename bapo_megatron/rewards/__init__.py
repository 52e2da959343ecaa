"""Rewards: a registry of reward functions (:mod:`.registry`), math answers checked with
math-verify (:mod:`.math_answer`), and a process pool that bounds the time of each check
(:mod:`.pool`)."""
