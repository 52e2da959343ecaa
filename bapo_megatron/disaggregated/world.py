"""Which role this process plays in a disaggregated run, and the groups that join the roles.

Every process reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and the run's split (:func:`~bapo_megatron.distributed.layout.split_world`).
Megatron-Core takes the default process group for its trainer, so the trainer ranks make the
default group among themselves alone (on torchrun's store, under a prefix of their own); the
engine ranks never join it. The links between the two sides are gloo groups built directly on
the same store, each under its own prefix (:mod:`bapo_megatron.distributed.messages`):

- request link ``i`` (:func:`request_link`): data-parallel replica ``i``'s first rank (tensor,
  pipeline and context rank 0; group rank 0) and engine replica ``i`` (group rank 1);
- result link ``i`` (:func:`result_link`, asynchronous training only): the same two ends, the
  engine's finished rollout items travelling back while the request link carries work and
  weight updates;
- stage broadcast ``s`` (:func:`stage_broadcast`): pipeline stage ``s``'s export rank of
  replica 0 (tensor and context rank 0; group rank 0) and every engine replica ``i`` (group rank
  ``i + 1``): the weights of stage ``s``.

Rank order is Megatron's ``tp-cp-ep-dp-pp`` over the trainer ranks, so the engine side can name
the trainer ranks it talks to without Megatron.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.config import Config, ParallelConfig
from bapo_megatron.distributed.device import uses_cuda
from bapo_megatron.distributed.layout import WorldSplit, split_world
from bapo_megatron.distributed.messages import GroupMessenger, gloo_group
from bapo_megatron.distributed.startup import join_rendezvous
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Role:
    """This process's place in a disaggregated run."""

    split: WorldSplit
    rank: int
    """Global rank in the torchrun world."""
    store: dist.Store
    """This attempt's namespace in torchrun's rendezvous store, which every group of the run
    meets in (:func:`~bapo_megatron.distributed.startup.join_rendezvous`)."""
    timeout: datetime.timedelta
    """Deadline of group set-up and of every transfer (``parallel.collective_timeout_s``)."""

    @property
    def is_engine(self) -> bool:
        return self.split.is_engine(self.rank)

    def leave(self) -> None:
        """Destroy the trainer's default group (trainer ranks; the ParallelContext built on it
        does not own it)."""
        if not self.is_engine and dist.is_initialized():
            dist.destroy_process_group()


def join_world(cfg: Config) -> Role:
    """Read torchrun's environment, check the split, wait for every rank (within
    ``parallel.startup_timeout_s``) and, on a trainer rank, make the default process group over
    the trainer ranks. ``ValueError`` naming the setting when the run is not
    under torchrun or the world does not split."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(
            "rollout.placement=disaggregated runs one process per rank under torchrun "
            f"(missing environment variables {missing})"
        )
    split = split_world(cfg.parallel, cfg.rollout, int(os.environ["WORLD_SIZE"]))
    timeout = datetime.timedelta(seconds=cfg.parallel.collective_timeout_s)
    rendezvous = join_rendezvous(cfg.parallel.startup_timeout_s, timeout)
    rank = rendezvous.rank
    role = Role(split=split, rank=rank, store=rendezvous.store, timeout=timeout)
    if not role.is_engine:
        backend = "nccl" if uses_cuda(cfg.parallel.device) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("bapo/trainer", role.store),
            rank=rank,
            world_size=split.trainer_size,
            timeout=timeout,
        )
    return role


def trainer_rank(parallel: ParallelConfig, split: WorldSplit, *, replica: int, stage: int) -> int:
    """Global rank of data-parallel replica ``replica``'s pipeline stage ``stage`` at tensor and
    context rank 0 (Megatron's ``tp-cp-ep-dp-pp`` order)."""
    inner = parallel.tensor_model_parallel_size * parallel.context_parallel_size
    return inner * (replica + split.data_parallel_size * stage)


def request_link(role: Role, parallel: ParallelConfig, replica: int) -> GroupMessenger:
    """The request link of replica ``replica`` (its first trainer rank and its engine)."""
    return _replica_link(role, parallel, replica, "requests")


def result_link(role: Role, parallel: ParallelConfig, replica: int) -> GroupMessenger:
    """The result link of replica ``replica`` in asynchronous training: the engine's answers
    (finished rollout items), the opposite direction of :func:`request_link`, so that each
    group is used by one thread at each end."""
    return _replica_link(role, parallel, replica, "results")


def _replica_link(
    role: Role, parallel: ParallelConfig, replica: int, carries: str
) -> GroupMessenger:
    """A two-member group of replica ``replica``'s first trainer rank (group rank 0) and its
    engine (group rank 1), one per kind of traffic (``carries``)."""
    trainer = trainer_rank(parallel, role.split, replica=replica, stage=0)
    engine = role.split.engine_rank(replica)
    group = gloo_group(
        role.store, f"bapo/{carries}/{replica}", int(role.is_engine), 2, role.timeout
    )
    return GroupMessenger(
        group,
        names=[f"trainer rank {trainer}", f"engine rank {engine} (engine replica {replica})"],
        timeout=role.timeout,
        what=f"rollout {carries} of data-parallel replica {replica}",
    )


def stage_broadcast(role: Role, parallel: ParallelConfig, stage: int) -> StageBroadcast:
    """The weight broadcast of pipeline stage ``stage`` (its export rank and every engine)."""
    split = role.split
    sender = trainer_rank(parallel, split, replica=0, stage=stage)
    rank = split.engine_index(role.rank) + 1 if role.is_engine else 0
    group = gloo_group(
        role.store, f"bapo/weights/stage{stage}", rank, split.engine_count + 1, role.timeout
    )
    names = [f"trainer rank {sender} (pipeline stage {stage})"] + [
        f"engine rank {split.engine_rank(i)}" for i in range(split.engine_count)
    ]
    what = f"weights of pipeline stage {stage}"
    messenger = GroupMessenger(group, names=names, timeout=role.timeout, what=what)
    backend = weight_backend(role, stage, parallel.device)
    if backend == "gloo":
        return StageBroadcast(messenger, stage)
    # NCCL between GPUs for the buffers (written to torch's documented constructor, never run
    # on GPUs: docs/validation.md); the headers stay on the gloo group
    data_group = dist.ProcessGroupNCCL(
        dist.PrefixStore(f"bapo/weights/stage{stage}/nccl", role.store),
        rank,
        split.engine_count + 1,
    )
    data = GroupMessenger(data_group, names=names, timeout=role.timeout, what=what)
    return StageBroadcast(messenger, stage, data=data, device="cuda")


def weight_backend(role: Role, stage: int, device: str = "auto") -> str:
    """The backend of stage ``stage``'s weight buffers, chosen by its sender (NCCL when the run's
    ``parallel.device`` setting ``device`` resolves to CUDA, else gloo) and read by every engine
    from the store, so that all members agree; an engine whose ``device`` is not CUDA in a run
    whose sender uses one is refused naming both."""
    key = f"bapo/weights/stage{stage}/backend"
    if not role.is_engine:
        backend = "nccl" if uses_cuda(device) else "gloo"
        role.store.set(key, backend)
        return backend
    backend = role.store.get(key).decode()
    if backend == "nccl" and not uses_cuda(device):
        raise ValueError(
            f"pipeline stage {stage} sends its weights over NCCL (its export rank has a GPU), "
            f"but engine rank {role.rank} has no GPU"
        )
    return backend
