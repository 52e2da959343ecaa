"""The process layout of a run: the only module that touches ``megatron.core.parallel_state``.

:meth:`ParallelContext.initialize` is called once per process. It joins (or, for a single
process, creates) the ``torch.distributed`` world, lets Megatron carve it into tensor, pipeline,
context and data parallel groups, and returns a frozen :class:`ParallelContext` that the rest of
the code receives explicitly: groups, ranks, sizes, pipeline position and the device. One process
is the degenerate case of the same code: a gloo world of one rank, every group of size one.

Rank order is Megatron's default ``tp-cp-ep-dp-pp``: tensor-parallel ranks are adjacent. The
experts of a mixture-of-experts model are laid out by Megatron's second decomposition of each
pipeline stage's ranks, expert tensor x expert model x expert data parallel (``etp-ep-dp-pp``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from bapo_megatron.config import ParallelConfig
from bapo_megatron.distributed.device import uses_cuda
from bapo_megatron.distributed.startup import join_rendezvous
from bapo_megatron.megatron_patches.cpu_runtime import apply_cpu_patches
from bapo_megatron.megatron_patches.without_transformer_engine import apply_without_te_patches


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """Process groups, ranks and sizes of this rank, built once by :meth:`initialize`."""

    config: ParallelConfig
    """The layout this context was built from."""
    device: torch.device
    """Where this rank's model lives: ``cuda:<local rank>`` or ``cpu``."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    tp_group: dist.ProcessGroup
    """Tensor-parallel group (ranks sharing one layer's matrices)."""
    pp_group: dist.ProcessGroup
    """Pipeline group (one rank per stage)."""
    cp_group: dist.ProcessGroup
    """Context-parallel group (ranks sharing one sequence)."""
    dp_group: dist.ProcessGroup
    """Data-parallel group (replicas that see different samples), without context parallel."""
    dp_cp_group: dist.ProcessGroup
    """Data x context parallel group: the ranks whose tokens together make the global batch of
    one model replica position; the BAPO statistics and the loss normalizer are reduced here."""
    process_groups: ProcessGroupCollection
    """The same groups (and Megatron's others: embedding, model parallel, ...) in the form Megatron
    modules accept as ``pg_collection``."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    vpp_size: int | None
    """Model chunks per pipeline stage (interleaved schedule), or None."""
    owns_process_group: bool
    """Whether :meth:`initialize` created the torch.distributed world (then teardown destroys
    it)."""
    ep_group: dist.ProcessGroup
    """Expert-parallel group: the ranks of a pipeline stage that divide each MoE layer's experts
    among them (tokens travel between them to reach their experts)."""
    etp_group: dist.ProcessGroup
    """Expert tensor-parallel group: the ranks one expert's matrices are split over."""
    expert_dp_group: dist.ProcessGroup
    """Expert data-parallel group: the ranks holding the same experts, whose expert gradients
    are summed (the dense parameters' is dp_group)."""
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    """Expert tensor parallel: rank and size of the group an expert's matrices are split over."""
    edp_rank: int
    """Rank in expert_dp_group (0: the copy of this rank's experts that exports them)."""

    @classmethod
    def initialize(
        cls,
        config: ParallelConfig,
        *,
        timeout: datetime.timedelta | None = None,
        gloo_groups: bool = True,
    ) -> ParallelContext:
        """Build the process groups of ``config`` on the current torch.distributed world.

        If ``torch.distributed`` is not initialized yet, it is initialized here: from the
        ``torchrun`` environment (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...) when present,
        once every rank has arrived within ``config.startup_timeout_s``
        (:func:`~bapo_megatron.distributed.startup.join_rendezvous`), otherwise as a world of one
        process. The backend is NCCL when ``config.device`` resolves
        to CUDA (:mod:`bapo_megatron.distributed.device`), else gloo; on the CPU, the
        Megatron-Core CPU patches are applied first. Sizes that do not fit
        the world raise ``ValueError``, after destroying a world created here (see
        :func:`bapo_megatron.distributed.layout.validate_layout` for the checks that also need
        the model). ``gloo_groups=False`` skips Megatron's extra gloo
        groups, for a world whose backend cannot make them (the layout planner's fake world).
        """
        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "model parallel is already initialized in this process; call "
                "teardown() on the previous ParallelContext first"
            )
        use_cuda = uses_cuda(config.device)
        if config.deterministic:
            # cuBLAS reads its workspace setting when CUDA starts; a value the user set wins
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        apply_without_te_patches()
        if not use_cuda:
            apply_cpu_patches()
        if timeout is None:
            timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        owns = not dist.is_initialized()
        if owns:
            backend = "nccl" if use_cuda else "gloo"
            if "WORLD_SIZE" in os.environ:
                if use_cuda:
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                # every rank arrives within the start-up deadline, or none builds a group
                rendezvous = join_rendezvous(config.startup_timeout_s, timeout)
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore("world", rendezvous.store),
                    rank=rendezvous.rank,
                    world_size=rendezvous.world_size,
                    timeout=timeout,
                )
            else:
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
        world_size = dist.get_world_size()
        problem = None
        if world_size % config.model_parallel_size:
            problem = (
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
                f"= {config.model_parallel_size}"
            )
        elif (world_size // config.pipeline_model_parallel_size) % config.expert_parallel_size:
            problem = (
                f"world size {world_size} / pipeline {config.pipeline_model_parallel_size} is not "
                "divisible by expert tensor x expert model parallel = "
                f"{config.expert_parallel_size}"
            )
        if problem is not None:
            if owns:  # the world was joined to find this out: leave the process as it was
                dist.destroy_process_group()
            raise ValueError(problem)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
            expert_model_parallel_size=config.expert_model_parallel_size,
            expert_tensor_parallel_size=config.expert_tensor_parallel_size,
            distributed_timeout_minutes=max(1, int(timeout.total_seconds() // 60)),
            create_gloo_process_groups=gloo_groups,
        )
        ps = parallel_state
        return cls(
            config=config,
            device=torch.device("cuda", torch.cuda.current_device())
            if use_cuda
            else torch.device("cpu"),
            rank=dist.get_rank(),
            world_size=world_size,
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            process_groups=ProcessGroupCollection.use_mpu_process_groups(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            vpp_size=config.virtual_pipeline_model_parallel_size,
            owns_process_group=owns,
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            expert_dp_group=ps.get_expert_data_parallel_group(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )

    @property
    def dp_cp_size(self) -> int:
        """Ranks in the data x context parallel group."""
        return self.dp_size * self.cp_size

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        """Whether this rank (and, with virtual pipelining, its chunk ``vp_stage``) holds the
        embedding: the first pipeline stage."""
        return self.pp_rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """Whether this rank (and chunk ``vp_stage``) holds the output layer and computes the
        loss."""
        last_chunk = vp_stage is None or vp_stage == (self.vpp_size or 1) - 1
        return self.pp_rank == self.pp_size - 1 and last_chunk

    def teardown(self) -> None:
        """Destroy Megatron's groups, and the torch.distributed world if this context created it.
        After it, :meth:`initialize` may be called again (a new layout in the same process)."""
        made = _megatron_groups()
        parallel_state.destroy_model_parallel()
        # What destroy_model_parallel leaves set (0.16.1: the intra-partial data-parallel groups
        # with context parallel) would keep those groups alive until the next layout.
        for name in _megatron_groups():
            setattr(parallel_state, name, None)
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        else:
            # The world outlives this layout: without this, every layout a process runs keeps its
            # groups registered, and a gloo group's transport thread wakes 100 times a second
            # until the process ends (~17 groups per layout).
            for group in {id(g): g for groups in made.values() for g in groups}.values():
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # "Invalid process group": Megatron destroyed it (its gloo ones)
                    pass
        if self.config.deterministic:
            torch.use_deterministic_algorithms(False)


def _megatron_groups() -> dict[str, list[dist.ProcessGroup]]:
    """The process groups Megatron's parallel state holds, by the global that holds them (alone
    or in a list), except the world's own group."""
    found: dict[str, list[dist.ProcessGroup]] = {}
    for name, value in vars(parallel_state).items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        groups = [
            item
            for item in items
            if isinstance(item, dist.ProcessGroup) and item is not dist.GroupMember.WORLD
        ]
        if groups:
            found[name] = groups
    return found
