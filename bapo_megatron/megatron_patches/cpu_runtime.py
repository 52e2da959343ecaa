"""Runtime patches that let megatron-core 0.16.1 build and run a GPTModel on a CPU with gloo.

Megatron-Core assumes CUDA in a handful of places on the forward/backward path even when no
kernel needs it: allocations on ``torch.cuda.current_device()``, a CUDA RNG tracker, literal
``device="cuda"`` buffers. Each patch below replaces exactly one such site, says why, and is
listed in this folder's ``README.md``. :func:`apply_cpu_patches` installs them; it checks the
installed megatron-core version (the sites move between releases), refuses to run where CUDA
is available (these patches would break a GPU run), and is idempotent.

The ~68 CUDA sites of the Megatron optimizer, grad-norm and clipping code (``device="cuda"``
buffers, ``Tensor.type() == "torch.cuda.FloatTensor"`` checks) are not patched one by one:
:func:`cuda_sites_on_cpu` is a context manager, entered only around optimizer construction and
the optimizer step, under which such requests are answered on the CPU. It is a torch function
mode, which costs a Python call per torch operation, so it is kept off the forward/backward path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import megatron.core
import torch
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import torch_norm
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.moe import moe_utils, token_dispatcher

SUPPORTED_MEGATRON_CORE = "0.16.1"

_APPLIED: list[str] = []


def _patch_current_device_is_cpu() -> None:
    """``torch.cuda.current_device()`` is the ``device=`` of many allocations on the forward path
    (the attention ``baddbmm`` buffer, RoPE frequencies, tensor-parallel gather buffers, p2p
    receive buffers). A CPU build of torch raises there; return ``"cpu"`` instead."""
    torch.cuda.current_device = lambda: "cpu"


def _patch_rng_tracker_on_cpu_generator() -> None:
    """``tensor_parallel.random.CudaRNGStatesTracker`` stores CUDA generator states and is forked
    on every attention forward (the dropout region, even at dropout 0);
    ``model_parallel_cuda_manual_seed`` fails in its ``add``. Replace the class (looked up by
    name when the tracker is created) with one whose named states are CPU generator states, and
    make the module's ``_get_cuda_rng_state``/``_set_cuda_rng_state`` no-ops: activation
    recompute snapshots them, and on CPU there is no device generator (the CPU state is saved
    separately)."""

    class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        """Named RNG states over the CPU generator, with Megatron's tracker interface."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"RNG seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"RNG state {name!r} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(
            self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
        ) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"RNG state {name!r} was not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    megatron_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: None
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # A tracker created before the patch would still be the CUDA one: recreate on next use.
    megatron_random._CUDA_RNG_STATE_TRACKER = None
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


class _TorchWithCpuZeros:
    """Stands in for the ``torch`` module inside one Megatron module: everything is torch's,
    except that ``zeros(..., device="cuda...")`` allocates on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _patch_schedules_token_counter_on_cpu() -> None:
    """All three pipeline schedules (no pipelining, 1F1B, interleaved) allocate their token
    counter with ``torch.zeros([], dtype=torch.int, device="cuda")`` unconditionally. Give the
    ``schedules`` module a ``torch`` whose ``zeros`` maps a CUDA device to the CPU."""

    schedules.torch = _TorchWithCpuZeros()


def _patch_default_causal_mask_on_cpu() -> None:
    """``transformer.utils.get_default_causal_mask`` builds ``torch.ones(sq, sq, device="cuda")``;
    the unfused softmax calls it whenever ``attention_mask`` is None with a causal mask type.
    Rebind it, in that module and in ``fusions.fused_softmax`` (which imported it by name), to
    the same upper-triangular boolean mask built on the CPU."""

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        # True where attention is masked out: key position after query position.
        return torch.ones(sq, sq, dtype=torch.bool).triu_(diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_tied_embedding_setup_without_cuda() -> None:
    """With tied embeddings and PP > 1, ``LanguageModule.setup_embeddings_and_output_layer`` moves
    the shared weight with ``weight.data.cuda()`` before all-reducing it between the first and
    last stage. Run that method with ``Tensor.cuda`` returning the tensor itself (it already is
    where it belongs); ``Tensor.cuda`` is restored afterwards, so nothing else is affected."""

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self) -> None:
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = tensor_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_cuda_synchronize_noop() -> None:
    """``torch.cuda.synchronize()`` is called by p2p communication (``batch_p2p_sync``, shape
    exchange) and by DDP and timers; a CPU build raises. On the CPU there is nothing to wait for."""
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _patch_torch_norm_sequence_parallel() -> None:
    """The norm of the local (no Transformer Engine) spec, ``WrappedTorchNorm``, asserts that
    sequence parallelism is off. A norm on sequence-sharded activations is correct as long as
    the gradients of its replicated weight are summed over the tensor-parallel group, which
    ``finalize_model_grads`` does for parameters tagged ``.sequence_parallel = True`` (with
    Megatron's DDP). Build the norm with the flag lowered for the assertion only, then tag its
    parameters."""

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        if sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


class _NoStream:
    """Stands in for the alltoall dispatcher's device-to-host CUDA stream: on the CPU there is
    nothing to overlap, so it is never used (see ``_patch_alltoall_dispatcher_without_streams``)."""


def _patch_alltoall_dispatcher_without_streams() -> None:
    """``MoEAlltoAllTokenDispatcher.__init__`` creates a class-wide ``torch.cuda.Stream`` for
    device-to-host copies of the split sizes, and ``_maybe_dtoh_and_synchronize`` enters it and
    records/waits on CUDA events. Give the class a placeholder stream (so none is created) and
    a synchronization step that makes the same host copies (through
    ``moe_utils.maybe_move_tensor_to_cpu``, as the original does) without streams or events."""

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        move = token_dispatcher.maybe_move_tensor_to_cpu
        tokens_per_expert = move(tokens_per_expert)
        self.input_splits = move(self.input_splits, as_numpy=True)
        self.output_splits = move(self.output_splits, as_numpy=True)
        self.output_splits_tp = move(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = move(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = move(self.num_global_tokens_per_local_expert)
        return tokens_per_expert

    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = (
        _maybe_dtoh_and_synchronize
    )


def _patch_moe_split_sizes_on_cpu() -> None:
    """``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts only CUDA tensors, so on
    the CPU the alltoall dispatcher's split sizes stay tensors and ``all_to_all_single`` refuses
    them (``incompatible function arguments``). Rebind it (in ``moe_utils`` and in
    ``token_dispatcher``, which imported it by name) to one that also turns a CPU tensor into
    the numpy array the CUDA path produces when ``as_numpy``."""
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaSitesOnCpu(torch.overrides.TorchFunctionMode):
    """Answers the CUDA requests of Megatron's optimizer code on the CPU: ``device="cuda"``
    allocations and ``.to("cuda")`` land on the CPU, ``.cuda()`` returns the tensor, and the
    no-argument ``Tensor.type()`` of a CPU tensor reports its ``torch.cuda.*`` name, which is
    what the optimizer (param classification) and ``clip_grad_by_total_norm_fp32`` (an assert)
    compare against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if (
                args[0].device.type == "cpu"
                and name.startswith("torch.")
                and not name.startswith("torch.cuda.")
            ):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cuda_sites_on_cpu() -> contextlib.AbstractContextManager:
    """Context for Megatron optimizer calls: on a CPU-only run (patches applied) a mode that
    answers their CUDA requests on the CPU (``docs/megatron-on-cpu.md``, the
    `cuda_sites_on_cpu` row); with CUDA, or before :func:`apply_cpu_patches`, a no-op context.
    Per thread, like every torch function mode."""
    if not _APPLIED:
        return contextlib.nullcontext()
    return _CudaSitesOnCpu()


# Name -> patch, in application order. Names are what this folder's README.md lists.
CPU_PATCHES: dict[str, Callable[[], None]] = {
    "current_device_is_cpu": _patch_current_device_is_cpu,
    "rng_tracker_on_cpu_generator": _patch_rng_tracker_on_cpu_generator,
    "schedules_token_counter_on_cpu": _patch_schedules_token_counter_on_cpu,
    "default_causal_mask_on_cpu": _patch_default_causal_mask_on_cpu,
    "tied_embedding_setup_without_cuda": _patch_tied_embedding_setup_without_cuda,
    "cuda_synchronize_noop": _patch_cuda_synchronize_noop,
    "torch_norm_sequence_parallel": _patch_torch_norm_sequence_parallel,
    "alltoall_dispatcher_without_streams": _patch_alltoall_dispatcher_without_streams,
    "moe_split_sizes_on_cpu": _patch_moe_split_sizes_on_cpu,
}


def applied_cpu_patches() -> tuple[str, ...]:
    """Names of the patches installed in this process, in the order they were applied."""
    return tuple(_APPLIED)


def apply_cpu_patches() -> tuple[str, ...]:
    """Install every CPU patch once per process and return the names applied so far.

    Raises ``RuntimeError`` when the installed megatron-core is not
    :data:`SUPPORTED_MEGATRON_CORE` (the patched sites are specific to it) or when this process
    has already initialized CUDA (the patches replace CUDA entry points that its GPU work needs;
    a CPU run on a machine with a GPU is fine). Calling it again is a no-op.
    """

    version = megatron.core.__version__
    if version != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            "bapo_megatron.megatron_patches.cpu_runtime targets "
            f"megatron-core=={SUPPORTED_MEGATRON_CORE}, "
            f"but {version} is installed; install the pinned version (requirements.txt) or "
            "re-check every patched site against the new release"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "apply_cpu_patches() is for CPU runs, but this process has already initialized CUDA; "
            "the patches would redirect the CUDA allocations of its GPU work to the CPU"
        )
    for name, patch in CPU_PATCHES.items():
        if name not in _APPLIED:
            patch()
            _APPLIED.append(name)
    return tuple(_APPLIED)
