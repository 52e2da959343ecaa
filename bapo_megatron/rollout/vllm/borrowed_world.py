"""vLLM 0.32's engine shutdown in a process whose ``torch.distributed`` world is the trainer's.

An in-process vLLM started where a world already exists (the trainer's, even of one rank) does
not make its own: ``init_distributed_environment`` adopts it and creates its groups (``_WORLD``,
``_TP``, ...) inside it. Its shutdown, ``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``
(``vllm/v1/engine/core.py:839``; also run by a ``weakref.finalize`` at interpreter exit), then
destroys its groups and, in ``destroy_distributed_environment``, the whole default world
(``distributed/parallel_state.py``, ``torch.distributed.destroy_process_group()``). So:

- after the trainer destroyed its world (``ParallelContext.teardown``, which takes vLLM's groups
  with it), the exit-time shutdown fails at ``_TP.destroy()``:
  ``ValueError: Invalid process group specified``, a traceback printed at exit (exit code 0);
- before it (an engine closed while the trainer runs), it would destroy the trainer's world.

:func:`note_engine_world` (called by :meth:`VLLMEngine.from_pretrained
<bapo_megatron.rollout.vllm.engine.VLLMEngine.from_pretrained>` around the start) records the
world vLLM's groups live in and whether vLLM found it already there, and replaces the two
destroy functions ``cleanup_dist_env_and_memory`` calls: groups whose world has ended are
dropped, not destroyed again; on a borrowed world vLLM destroys its own groups and leaves the
world to its owner. A world vLLM made itself is torn down as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class _EngineWorld:
    world: Any = None
    """The default process group vLLM's groups were made in (None: no world in this process)."""
    borrowed: bool = False
    """Whether that world is someone else's to destroy: it existed before vLLM started, and no
    earlier vLLM of this process made it."""
    made: Any = None
    """The last world an in-process vLLM made itself (later engines of the process adopt it;
    it stays vLLM's to destroy)."""


_state = _EngineWorld()


def current_world() -> Any:
    """This process's default process group, or None."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def note_engine_world(found: Any) -> None:
    """After an in-process vLLM started: ``found`` is :func:`current_world` from just before it
    started. Records where its groups live and, where there is a world, installs the shutdown
    guard (once; without a world vLLM's shutdown has nothing to get wrong)."""
    world = current_world()
    if found is None and world is not None:
        _state.made = world
    _state.world = world
    _state.borrowed = found is not None and found is world and world is not _state.made
    if world is not None:
        _install()


def world_ended() -> bool:
    """Whether the world vLLM's groups were made in is gone (destroyed, or replaced)."""
    return _state.world is not None and current_world() is not _state.world


def _install() -> None:
    from vllm.distributed import parallel_state

    if getattr(parallel_state, "_bapo_borrowed_world_guard", False):
        return
    parallel_state.destroy_model_parallel = _guarded_model_parallel(
        parallel_state.destroy_model_parallel
    )
    parallel_state.destroy_distributed_environment = _guarded_environment(
        parallel_state.destroy_distributed_environment
    )
    parallel_state._bapo_borrowed_world_guard = True


def _drop_groups(parallel_state: Any, names: list[str]) -> None:
    """Forget vLLM's coordinators ``names`` without destroying their groups (gone with their
    world: destroying them again raises)."""
    for name in names:
        setattr(parallel_state, name, None)


def _coordinators(parallel_state: Any) -> list[str]:
    return [
        name
        for name, value in vars(parallel_state).items()
        if isinstance(value, parallel_state.GroupCoordinator)
    ]


def _guarded_model_parallel(destroy: Any) -> Any:
    def destroy_model_parallel() -> None:
        from vllm.distributed import parallel_state

        if world_ended():
            subgroups = [name for name in _coordinators(parallel_state) if name != "_WORLD"]
            _drop_groups(parallel_state, subgroups)
            return
        destroy()

    return destroy_model_parallel


def _guarded_environment(destroy: Any) -> Any:
    def destroy_distributed_environment() -> None:
        from vllm.distributed import parallel_state

        if world_ended():
            _drop_groups(parallel_state, ["_WORLD"])
        elif _state.borrowed:
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()  # vLLM's group of the world's ranks, not the world
            _drop_groups(parallel_state, ["_WORLD"])
        else:
            destroy()
            return
        parallel_state._NODE_COUNT = None

    return destroy_distributed_environment
