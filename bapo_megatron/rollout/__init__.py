"""Rollout engines: the protocol (:mod:`.protocol`), the registry that builds the engine a run
names (:mod:`.registry`), the guard the trainer holds it through (:mod:`.guard`), and the engine
families: :mod:`.embedded` (the default, CPU), :mod:`.vllm` and :mod:`.sglang`. README.md in
this folder draws the call chain."""
