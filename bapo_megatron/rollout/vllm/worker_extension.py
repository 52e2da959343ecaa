"""The methods this project adds to vLLM's workers (``worker_extension_cls``): installing the
full-vocabulary log-prob hook, loading weights in place, telling the worker's device, and
reading its shard map off vLLM's loaders. Both
the in-process engine (:mod:`bapo_megatron.rollout.vllm.engine`) and a vLLM server started with
``--worker-extension-cls`` (:mod:`bapo_megatron.rollout.vllm.server_client`) load them; they run
inside vLLM's worker, where ``vllm`` is importable (this module imports it lazily).

Written for vLLM 0.32; why each piece is needed is in :mod:`bapo_megatron.rollout.vllm.engine`'s
docstring and docs/rollout-engines.md.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
from safetensors.torch import load_file

from bapo_megatron.resharding.execute import ReceivingMember
from bapo_megatron.rollout.checksum import Checksum
from bapo_megatron.rollout.vllm.reload_expectations import expect_no_checkpoint_tensors
from bapo_megatron.rollout.vllm.worker_shard_map import probe_shard_map
from bapo_megatron.rollout.vllm.worker_shard_targets import VllmShardTargets, weights_checksum
from bapo_megatron.rollout.weight_group import join_weight_group, leave_weight_group


def full_vocab_logprobs_hook(sampler: Any) -> bool:
    """Wrap ``sampler.forward`` (a vLLM 0.32 ``TopKTopPSampler``, called with logits already
    divided by the temperature) so that the log-probs it returns are ``log_softmax`` over the
    full vocabulary, computed before top-k/top-p modify the logits in place. Returns False when
    the hook was already installed."""
    if getattr(sampler, "_bapo_full_vocab", False):
        return False
    sample = sampler.forward

    def forward(logits: torch.Tensor, *args: Any, **kwargs: Any):
        full = logits.log_softmax(dim=-1, dtype=torch.float32)  # before any in-place truncation
        tokens, _ = sample(logits, *args, **kwargs)
        return tokens, full

    sampler.forward = forward
    sampler._bapo_full_vocab = True
    return True


def retie_output_layer(model: Any) -> bool:
    """Tie the output layer to the input embedding again after an in-place reload.

    vLLM 0.32's layerwise reload restores each layer's parameters separately: the embedding gets
    the new tensor, while the tied ``lm_head`` (same parameter before the reload, and never
    loaded itself: checkpoints of tied models have no ``lm_head.weight``) gets its old tensor
    placed back, and on CPU keeps the GEMM handle prepacked from it. Logits then come from the
    old embedding. This re-ties the parameter and re-runs the layer's post-loading step (which
    rebuilds the CPU GEMM handle). Returns whether the model is tied."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return False
    head, embedding = model.lm_head, model.model.embed_tokens
    head.weight = embedding.weight
    head.quant_method.process_weights_after_loading(head)
    return True


def _cpu_experts(model: Any) -> list[tuple[Any, Any]]:
    """(layer, its ``CPUUnquantizedExperts`` kernel) of every MoE layer of ``model`` that runs
    vLLM 0.32's CPU experts (found by class name: ``vllm`` is not imported here)."""
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight"):
            continue
        if any(cls.__name__ == "CPUUnquantizedExperts" for cls in type(experts).__mro__):
            found.append((module, experts))
    return found


def check_cpu_experts_reloadable(model: Any) -> None:
    """Refuse, before anything is loaded, a reload that vLLM 0.32 cannot do on CPU: experts
    whose intermediate size its CPU kernel pads (not a multiple of 32) have padded tensors the
    reload does not fit (``RuntimeError: The size of tensor a (128) must match the size of
    tensor b (96)`` part-way through, with moe_intermediate_size 48)."""
    for layer, experts in _cpu_experts(model):
        config = experts.moe_config
        size = config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(config)
        if padded != size:
            raise RuntimeError(
                f"{getattr(layer, 'layer_name', 'an MoE layer')}: vLLM's CPU experts pad the "
                f"intermediate size {size} to {padded}, and vLLM 0.32 cannot reload padded "
                "experts in place (use a moe_intermediate_size that is a multiple of 32)"
            )


def repack_cpu_experts(model: Any) -> int:
    """Prepack each mixture-of-experts layer's expert weights again after an in-place reload on
    CPU; returns how many layers were repacked.

    vLLM 0.32's CPU experts (``CPUUnquantizedExperts``) keep ``w13_weight`` / ``w2_weight`` in
    their grouped-GEMM layout, prepacked by the kernel's ``process_weights_after_loading``,
    which the unquantized MoE method calls on the first load only: on a reload (a weight update,
    ``moe_kernel`` already built) it copies the new weights in unpacked, and the kernel then
    reads them as packed (log-probs off by about 0.5 nats on the tiny test model, the same
    weights reloaded). This re-runs that step for every such layer. Other kernels (GPU,
    zentorch) repack nothing here."""
    found = _cpu_experts(model)
    for layer, experts in found:
        experts.process_weights_after_loading(layer)
    return len(found)


def summed(named_tensors: list[tuple[str, torch.Tensor]], checksum: bool) -> dict[str, Any]:
    """What a worker reports of an update it loaded: how many tensors, their bytes and, with
    ``checksum``, the :class:`~bapo_megatron.rollout.checksum.Checksum` of what it received, in
    order (every worker of a tensor-parallel engine receives the same tensors, so all must
    agree)."""
    total = Checksum() if checksum else None
    if total is not None:
        for name, tensor in named_tensors:
            total.add(name, tensor)
    return {
        "loaded": len(named_tensors),
        "received_bytes": sum(t.numel() * t.element_size() for _, t in named_tensors),
        "checksum": total.hexdigest() if total else None,
    }


def reloaded(model: Any) -> None:
    """What an in-place reload leaves to redo: the tied output layer, the CPU experts' packing."""
    retie_output_layer(model)
    repack_cpu_experts(model)


class BapoWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``), called by name through
    ``collective_rpc``."""

    def bapo_full_vocab_logprobs(self) -> bool:
        """Install :func:`full_vocab_logprobs_hook` on this worker's sampler (idempotent)."""
        sampler = getattr(getattr(self.model_runner, "sampler", None), "topk_topp_sampler", None)
        if sampler is None:
            raise RuntimeError(
                "this vLLM worker has no model_runner.sampler.topk_topp_sampler; "
                "the full-vocabulary log-prob hook is written for vLLM 0.32's V1 model runner "
                "(vLLM 0.32 on a GPU may run dense models on Model Runner V2: set "
                "VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        return full_vocab_logprobs_hook(sampler) or True

    def bapo_device(self) -> str:
        """The worker's device type (``"cpu"``, ``"cuda"``, ...): a server client cannot see it."""
        from vllm.platforms import current_platform

        return current_platform.device_type

    def bapo_chunked_prefill(self) -> dict[str, bool]:
        """``{"enable_chunked_prefill": ...}``: whether this vLLM prefills long prompts in chunks,
        which crashes seeded requests on CPU (a server client cannot see its engine arguments).
        A dict because a server's ``/collective_rpc`` passes dicts on as JSON but turns other
        results into strings."""
        return {
            "enable_chunked_prefill": bool(self.vllm_config.scheduler_config.enable_chunked_prefill)
        }

    def bapo_probe_shard_map(self, request: str) -> dict[str, Any]:
        """This worker's shard map as vLLM's own loaders give it
        (:func:`~bapo_megatron.rollout.vllm.worker_shard_map.probe_shard_map`). ``request`` is JSON
        with ``hf_shapes`` (HF tensor name -> shape); the report adds ``tp_rank``."""
        from vllm.distributed import get_tensor_model_parallel_rank

        fields = json.loads(request)
        report = probe_shard_map(self.model_runner.get_model(), fields["hf_shapes"])
        dtype = str(self.vllm_config.model_config.dtype).removeprefix("torch.")
        return {**report, "tp_rank": int(get_tensor_model_parallel_rank()), "dtype": dtype}

    def bapo_receive_shards(self, request: str) -> dict[str, Any]:
        """Receive one shard-to-shard update over a weight group joined with
        :meth:`bapo_join_weight_group`, written straight into the checkpoint-format parameters
        (:class:`~bapo_megatron.rollout.vllm.worker_shard_targets.VllmShardTargets`), then redo what
        vLLM's reload leaves undone (:func:`reloaded`). ``request`` is JSON with ``group_name``,
        ``digest`` (the plan's), ``plan_follows`` (group rank 0 broadcasts the plan first; else
        the one kept from the last update is used), ``wire_dtype``, ``timeout_s`` and
        ``checksum``. Returns the bytes received and, with ``checksum``, the SHA-256 of this
        worker's parameters, or ``{"error": ...}`` when the transfer failed (layers completed
        before it hold the new weights: the engine refuses to generate until an update lands
        whole)."""
        fields = json.loads(request)
        group, backend = self._bapo_group(fields["group_name"])
        model = self.model_runner.get_model()
        check_cpu_experts_reloadable(model)
        if not hasattr(self, "_bapo_member"):
            self._bapo_member = ReceivingMember()
        try:
            counts = self._bapo_member.receive(
                group,
                fields,
                lambda planned: VllmShardTargets(model, planned),
                "cpu" if backend == "gloo" else self.device,
            )
        except Exception as error:
            # reported, not raised: vLLM's executor stops reading answers at the first worker
            # that raised, and the next call would read the others'
            return {"error": f"{type(error).__name__}: {error}"}
        reloaded(model)
        return {
            "received_bytes": counts.received_bytes,
            "checksum": weights_checksum(model) if fields.get("checksum") else None,
        }

    def bapo_model(self) -> Any:
        """The worker's model: by reference only where the worker lives in the caller's process
        (the single-process executor), which receives shard to shard into it."""
        return self.model_runner.get_model()

    def bapo_weights_checksum(self) -> str:
        """SHA-256 of this worker's parameters (:func:`weights_checksum`)."""
        return weights_checksum(self.model_runner.get_model())

    def _bapo_reload(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload of checkpoint-format tensors, told first which of the model's
        tensors no update carries (:func:`expect_no_checkpoint_tensors`: no "Failed to load
        weights" for them), then what it leaves undone redone (:func:`reloaded`)."""
        model = self.model_runner.get_model()
        expect_no_checkpoint_tensors(model)
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        reloaded(model)

    def _bapo_group(self, name: str) -> tuple[Any, str]:
        groups = getattr(self, "_bapo_weight_groups", {})
        if name not in groups:
            raise RuntimeError(
                f"weight group {name!r} was not joined here (joined: {sorted(groups)}); call "
                "bapo_join_weight_group first"
            )
        return groups[name]

    def bapo_load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], checksum: bool = False
    ) -> dict[str, Any]:
        """Load HF-named tensors into the live model with vLLM's in-place reload (the tensors
        arrive by reference with the single-process executor, as pickled messages with the
        multiprocess one), then redo what the reload leaves undone (:func:`reloaded`); returns
        :func:`summed`."""
        check_cpu_experts_reloadable(self.model_runner.get_model())
        report = summed(named_tensors, checksum)
        self._bapo_reload(named_tensors)
        return report

    def bapo_load_weights_from(self, request: str) -> dict[str, Any]:
        """Load the tensors of a folder's ``model.safetensors`` with vLLM's in-place reload (a
        server's path: only strings cross its ``/collective_rpc``). ``request`` is JSON with
        ``folder``, ``names`` (the order the client sent them in) and ``checksum``; returns
        :func:`summed`."""
        fields = json.loads(request)
        check_cpu_experts_reloadable(self.model_runner.get_model())
        tensors = load_file(f"{fields['folder']}/model.safetensors")
        named = [(name, tensors[name]) for name in fields["names"]]
        report = summed(named, bool(fields.get("checksum")))
        self._bapo_reload(named)
        return report

    def bapo_join_weight_group(self, request: str) -> dict[str, Any]:
        """Join the trainer's weight group (:mod:`bapo_megatron.rollout.weight_group`) as group
        rank ``rank_offset`` + this worker's rank. ``request`` is JSON (only strings cross a
        server's ``/collective_rpc``) with SGLang's ``/init_weights_update_group`` fields plus
        ``timeout_s``, which bounds joining and every later receive. Groups of the same kind
        joined earlier (the name without its last ``-`` part: the broadcast's, the
        shard-to-shard transfer's) are destroyed first: the trainer builds a new one only after
        the old one failed or its members changed."""
        fields = json.loads(request)
        groups = getattr(self, "_bapo_weight_groups", {})
        kind = fields["group_name"].rsplit("-", 1)[0]
        for name in [name for name in groups if name.rsplit("-", 1)[0] == kind]:
            leave_weight_group(groups.pop(name)[0])
        group = join_weight_group(
            master_address=fields["master_address"],
            master_port=int(fields["master_port"]),
            rank=int(fields["rank_offset"]) + int(self.rank),
            world_size=int(fields["world_size"]),
            group_name=fields["group_name"],
            backend=fields["backend"],
            timeout=datetime.timedelta(seconds=float(fields["timeout_s"])),
        )
        groups[fields["group_name"]] = (group, fields["backend"])
        self._bapo_weight_groups = groups
        return {"group_name": fields["group_name"], "rank": group.rank()}

    def bapo_receive_weights(self, request: str) -> dict[str, Any]:
        """Receive one update over a weight group and load it with vLLM's in-place reload.
        ``request`` is JSON with ``names``, ``dtypes``, ``shapes``, ``group_name`` (SGLang's
        ``/update_weights_from_distributed`` fields) and ``checksum``; the tensors arrive in that
        order, broadcast from group rank 0. Everything is received before anything is loaded, so
        an update cut off part-way leaves the model on its previous weights and answers
        ``{"failed": message}``. Returns :func:`summed`."""
        fields = json.loads(request)
        group, backend = self._bapo_group(fields["group_name"])
        # gloo carries CPU tensors; NCCL the worker's own device's
        device = "cpu" if backend == "gloo" else self.device
        received = [
            (name, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
            for name, dtype, shape in zip(fields["names"], fields["dtypes"], fields["shapes"])
        ]
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        try:
            for work in [group.broadcast([tensor], options) for _, tensor in received]:
                work.wait()
        except RuntimeError as failure:
            # answered, not raised: vLLM 0.32's multiprocess executor raises at the first
            # failed worker's answer and leaves the other workers' answers queued, where the
            # server's next call (the next trainer's first) would read this failure as its own
            return {"failed": f"{type(failure).__name__}: {failure}"}
        check_cpu_experts_reloadable(self.model_runner.get_model())
        report = summed(received, bool(fields.get("checksum")))
        self._bapo_reload(received)
        return report


WORKER_EXTENSION = f"{__name__}.{BapoWorkerExtension.__qualname__}"
"""What to pass as ``worker_extension_cls`` (in process) or ``--worker-extension-cls`` (server):
the import path of :class:`BapoWorkerExtension`."""
