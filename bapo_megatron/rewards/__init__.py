"""Rewards: a registry of reward functions (:mod:`.registry`), the signatures and results they
may have (:mod:`.calling`: ours, and verl's ``compute_score``), math answers checked with
math-verify (:mod:`.math_answer`), the last number of a free-text answer
(:mod:`.final_number`), and a process pool that bounds the time of each check
(:mod:`.pool`)."""
