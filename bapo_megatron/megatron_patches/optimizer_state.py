"""Repairs of Megatron's optimizer checkpoints for torch's Adam (megatron-core 0.16.1).

Megatron's optimizer checkpoints assume fused (Transformer Engine/Apex) Adams, which keep no
per-parameter ``step``; the torch ``AdamW`` it falls back to without them (always on the CPU)
does. :mod:`bapo_megatron.trainer.checkpoint` calls these around Megatron's save and load
(docs/megatron-on-cpu.md lists the failures they answer):

- a fresh optimizer has no state until its first step; Megatron's ``init_state_fn`` creates the
  moments but not ``step``, which the distributed optimizer's ``state_dict`` asserts on and torch's
  Adam then lacks: :func:`init_adam_state` creates all three, exactly as torch's first step would;
- the plain optimizer does not save a ``step`` of 0 (before the first step), which torch's Adam
  cannot load without: :func:`add_zero_common_step` supplies it;
- the distributed optimizer's ``dp_reshardable`` format keeps ``step`` only in the param groups
  and puts back the fresh optimizer's per-param ``step`` tensors: :func:`restore_adam_steps`
  resets them from the groups.

They only touch torch Adams (:func:`torch_adams`), so they do nothing with fused ones.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.optimizer import MegatronOptimizer


def torch_adams(optimizer: MegatronOptimizer) -> list[torch.optim.Adam]:
    """The torch Adam(W)s inside Megatron's (chained) optimizer; empty with fused Adams."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner.optimizer for inner in inners if isinstance(inner.optimizer, torch.optim.Adam)]


def init_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give every parameter of a torch Adam that has not stepped yet the state its first step
    would create (zero moments, ``step`` 0): a checkpoint of a fresh optimizer is then complete,
    and one can be loaded into it. Stepping from this state is identical to stepping from none."""
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                    state["step"] = torch.tensor(0.0)  # what torch's Adam starts with


def add_zero_common_step(loaded: dict) -> None:
    """Megatron's plain optimizer saves Adam's shared ``step`` as ``common_step`` only when it is
    not 0 (``if step:``), and torch's Adam refuses moments without a step: give the state of a
    checkpoint taken before the first step its 0. Walks chained optimizers ({index: state})."""
    if "state" in loaded and "param_groups" in loaded:
        state = loaded["state"]
        if state and "common_step" not in state and not any("step" in s for s in state.values()):
            state["common_step"] = torch.tensor(0.0)
        return
    for value in loaded.values():
        if isinstance(value, dict):
            add_zero_common_step(value)


def restore_adam_steps(optimizer: MegatronOptimizer) -> None:
    """After loading the distributed optimizer: one ``step`` tensor per parameter, from the
    param group's saved ``step`` (the ``dp_reshardable`` load leaves the fresh values, and torch
    Adam increments each parameter's tensor in place, so they must not be shared)."""
    for adam in torch_adams(optimizer):
        for group in adam.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if "step" in adam.state[param]:
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))
