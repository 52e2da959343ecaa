"""SGLang's in-process ``sglang.Engine`` as a rollout engine (colocated runs), and how the
protocol maps onto SGLang's requests and answers: the client of SGLang's HTTP server
(disaggregated runs, :mod:`bapo_megatron.rollout.sglang.server_client`) shares that part, and
is built the same way (both are :class:`~bapo_megatron.rollout.resubmission.ResubmittingEngine`
subclasses, as the vLLM adapters are).

Never run against a live SGLang (SGLang has no CPU build; ``docs/rollout-engines.md``): this
module is written against SGLang 0.5.x's documented API and only its request building,
response parsing and bookkeeping are tested (with responses
written by hand from SGLang's documentation, never recorded from a server, and a fake engine).
``sglang`` is imported lazily, by :meth:`SGLangEngine.in_process` only.

What SGLang gives, and how it maps onto the protocol:

- Generation: ``generate(input_ids=[...], sampling_params=[...], return_logprob=True)``, one
  request per sample with its own ``sampling_seed`` (:mod:`bapo_megatron.rollout.resubmission`).
  ``meta_info["output_token_logprobs"]`` holds ``(logprob, token_id, text)`` per generated token.
  By default SGLang computes them as ``log(softmax(logits / temperature))`` over the full
  vocabulary, before top-k/top-p: the protocol's behaviour log-prob. Do not set
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (that returns them before temperature).
- Stop tokens: SGLang's ``ignore_eos`` also disables ``stop_token_ids``. Without stop tokens the
  adapter sends ``ignore_eos=True`` (nothing stops a sample but its length, as the protocol
  says); with stop tokens it cannot, so the model's EOS token(s) stop a sample too. Put them in
  ``stop_token_ids`` (RL runs do) so that the two agree.
- Seeds: ``sampling_seed`` is only honoured by servers started with deterministic inference
  (``--enable-deterministic-inference``); otherwise the same seed does not give the same rollout.
- Partial rollout: a round's cap is the request's ``max_new_tokens``; continuing re-submits
  prompt + tokens so far (the radix cache reuses their KV when the weights did not change).
- :meth:`~SGLangEngine.abort` sends ``abort_request(abort_all=True)``; :meth:`~SGLangEngine.pause`
  ``pause_generation(mode="abort")``: in-flight requests come back with finish reason ``abort``
  and what they generated so far, which the adapter marks `abort` or `paused`.
  :meth:`~SGLangEngine.resume` sends ``continue_generation``.
- Weights: ``update_weights_from_tensor`` in buckets of at most ``bucket_bytes``, then one
  ``flush_cache``; optionally inside ``begin_weight_update`` / ``end_weight_update`` (newer
  SGLang versions want that for packed/quantized weights).
- Memory: ``release_memory_occupation`` / ``resume_memory_occupation`` (both weights and KV
  cache; weights must be updated again afterwards, as the protocol says).
- Experts (Qwen3-MoE): the per-expert names of the live export are the checkpoint names SGLang's
  ``load_weights`` maps into its fused experts; they travel in the buckets like every tensor.
- Routes (``record_routes``: routing replay of the rollout): the engine is started with
  ``enable_return_routed_experts`` and each request sent with ``return_routed_experts``; each
  answer's ``meta_info["routed_experts"]`` (base64 of int32 ``[tokens, layers, top_k]``) is
  decoded into ``RolloutSample.routes`` (:mod:`bapo_megatron.rollout.routes`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import EngineOutput, ResubmittingEngine, RoundRequest
from bapo_megatron.rollout.routes import routes_from_int32_base64

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 2**20


# ------------------------------------------------------------------ requests and responses


def sampling_params_of(request: RoundRequest, params: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params`` of one request (see the module docstring for the stop-token
    and seed caveats)."""
    body: dict[str, Any] = {
        "max_new_tokens": request.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 keeps all
        "min_p": 0.0,
        "n": 1,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": not params.stop_token_ids,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if request.seed is not None:
        body["sampling_seed"] = request.seed
    return body


def generate_request(
    requests: list[RoundRequest], params: SamplingParams, *, routes: bool = False
) -> dict[str, Any]:
    """The body of one batched ``/generate`` call (also the keyword arguments of
    ``Engine.generate``): one entry per request, in order; with ``routes``, asking for each
    token's experts."""
    body: dict[str, Any] = {
        "input_ids": [r.context for r in requests],
        "sampling_params": [sampling_params_of(r, params) for r in requests],
        "return_logprob": True,
        "stream": False,
    }
    if routes:
        body["return_routed_experts"] = True
    return body


def parse_generate_response(
    response: Any,
    count: int,
    *,
    where: str = "SGLang /generate",
    routes: ModelConfig | None = None,
) -> list[EngineOutput]:
    """The :class:`EngineOutput` of each of ``count`` requests from a ``/generate`` answer
    (a list of ``{"output_ids", "meta_info": {"finish_reason", "output_token_logprobs"}}``; one
    dict for a single request). With ``routes`` (the served model), ``meta_info``'s
    ``routed_experts`` are decoded too. ``ValueError`` naming the field when anything is missing
    or inconsistent."""
    if isinstance(response, dict) and count == 1:
        response = [response]
    if not isinstance(response, list) or len(response) != count:
        got = (
            f"a list of {len(response)}" if isinstance(response, list) else type(response).__name__
        )
        raise ValueError(f"{where}: expected a list of {count} outputs, got {got}")
    return [_parse_one(item, f"{where}[{index}]", routes) for index, item in enumerate(response)]


def _parse_one(item: Any, where: str, model: ModelConfig | None) -> EngineOutput:
    if not isinstance(item, dict):
        raise ValueError(  # noqa: TRY004 - a malformed answer, reported like every other
            f"{where}: expected an output dict, got {type(item).__name__}"
        )
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: missing 'meta_info'")  # noqa: TRY004 - as above
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length", "abort"):
        raise ValueError(
            f"{where}: 'meta_info.finish_reason' is {finish!r}, expected a dict "
            "whose 'type' is 'stop', 'length' or 'abort'"
        )
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError(
            f"{where}: missing 'meta_info.output_token_logprobs' (was the request "
            "sent with return_logprob=True?)"
        )
    logprobs, token_ids = [], []
    for position, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ValueError(
                f"{where}: 'meta_info.output_token_logprobs'[{position}] is {entry!r}, "
                "expected (logprob, token_id, text)"
            )
        logprob, token_id = entry[0], entry[1]
        if logprob is None or isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(
                f"{where}: 'meta_info.output_token_logprobs'[{position}] is {entry!r}, "
                "expected a float log-prob and an integer token id"
            )
        logprobs.append(float(logprob))
        token_ids.append(token_id)
    output_ids = item.get("output_ids")
    if output_ids is not None:
        if len(output_ids) != len(token_ids):
            raise ValueError(
                f"{where}: 'output_ids' holds {len(output_ids)} tokens, "
                f"'meta_info.output_token_logprobs' {len(token_ids)} entries"
            )
        for position, (a, b) in enumerate(zip(output_ids, token_ids)):
            if a != b:
                raise ValueError(
                    f"{where}: 'output_ids'[{position}] = {a} but "
                    f"'meta_info.output_token_logprobs'[{position}] is for token {b}"
                )
    routed = meta.get("routed_experts") if model is not None else None
    return EngineOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        finish=kind,
        detail=str(finish.get("message", "")) if isinstance(finish, dict) else "",
        routes=None
        if routed is None
        else routes_from_int32_base64(routed, model, f"{where}: 'meta_info.routed_experts'"),
    )


def check_update_result(result: Any, what: str) -> None:
    """Raise ``RuntimeError`` with SGLang's message when a weight or cache call failed. SGLang
    answers ``(success, message)`` in process, ``{"success", "message"}`` over HTTP, an object
    with ``success`` for ``flush_cache``, or nothing."""
    if result is None:
        return
    if isinstance(result, dict):
        success, message = result.get("success", True), result.get("message", "")
    elif isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        success, message = result[0], (result[1] if len(result) > 1 else "")
    else:
        success, message = getattr(result, "success", True), getattr(result, "message", "")
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a larger tensor
    travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def load_in_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    send: Callable[[list[tuple[str, torch.Tensor]]], None],
    *,
    session: tuple[Callable[[], None], Callable[[], None]] | None,
) -> None:
    """``send`` the tensors bucket by bucket (:func:`weight_buckets`), inside ``session``'s
    ``(begin, end)`` calls when given (end runs even when a bucket fails)."""
    if session is not None:
        session[0]()
    try:
        for bucket in weight_buckets(tensors, bucket_bytes):
            send(bucket)
    finally:
        if session is not None:
            session[1]()


# ------------------------------------------------------------------ the in-process engine


class SGLangEngine(ResubmittingEngine):
    """A :class:`~bapo_megatron.rollout.protocol.RolloutEngine` on an in-process ``sglang.Engine``
    (its scheduler runs in subprocesses); build it with :meth:`in_process`.

    ``Engine.generate`` runs the engine's asyncio loop in the calling thread; :meth:`abort` and
    :meth:`pause`, called from another thread meanwhile, schedule their calls on that loop.
    ``model`` describes the served model (vocabulary and HF tensor shapes, checked before any
    tensor is sent). ``version`` is the policy version of the weights the engine starts with
    (-1: none yet, :meth:`update_weights` must come first). With ``weight_update_session``,
    updates are wrapped in ``begin_weight_update`` / ``end_weight_update``. ``record_routes``:
    the engine was started with ``enable_return_routed_experts``; each sample's ``routes`` are
    filled.
    """

    engine_name = "SGLang"
    routes_option = "enable_return_routed_experts=True"

    def __init__(
        self,
        engine: Any,
        model: ModelConfig,
        *,
        version: int = -1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_update_session: bool = False,
        record_routes: bool = False,
    ) -> None:
        super().__init__(model, version=version, record_routes=record_routes)
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.weight_update_session = weight_update_session

    @classmethod
    def in_process(
        cls,
        model_path: str | Path,
        *,
        version: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        record_routes: bool = False,
        **engine_kwargs: Any,
    ) -> SGLangEngine:
        """Start ``sglang.Engine(model_path=..., skip_tokenizer_init=True, **engine_kwargs)``
        holding the HF folder's weights as policy ``version`` (with ``record_routes``, also
        ``enable_return_routed_experts=True``)."""
        try:
            import sglang
        except ImportError as error:
            raise ImportError(
                "SGLangEngine.in_process needs the optional package sglang "
                "(see docs/rollout-engines.md)"
            ) from error
        model = ModelConfig.from_hf_config(model_path)
        if record_routes:
            if not model.is_moe:  # before SGLang starts
                raise ValueError(
                    f"record_routes: model_type {model.model_type!r} has no experts to route to"
                )
            engine_kwargs["enable_return_routed_experts"] = True
        engine = sglang.Engine(
            model_path=str(model_path), skip_tokenizer_init=True, **engine_kwargs
        )
        return cls(
            engine,
            model,
            version=version,
            bucket_bytes=bucket_bytes,
            record_routes=record_routes,
        )

    # -------------------------------------------------------------- generation and control

    def _submit(self, requests: list[RoundRequest], params: SamplingParams) -> list[EngineOutput]:
        # On the caller's thread: Engine.generate drives the engine's event loop, which stays
        # there; abort and pause reach it through that loop, after the request was submitted.
        body = generate_request(requests, params, routes=self.record_routes)
        body.pop("stream")
        response = self.engine.generate(**body)
        return parse_generate_response(
            response, len(requests), routes=self.model_config if self.record_routes else None
        )

    def _on_loop(self, call: Callable[[], Any]) -> None:
        """Run the coroutine-or-value factory ``call`` on the engine's loop: thread-safely while
        a ``generate`` runs it, else to completion here."""
        loop = self.engine.loop
        if loop.is_running():
            loop.call_soon_threadsafe(lambda: _spawn(call()))
        else:
            result = call()
            if asyncio.iscoroutine(result):
                loop.run_until_complete(result)

    def _on_abort(self) -> None:
        self._on_loop(lambda: self.engine.tokenizer_manager.abort_request(abort_all=True))

    def _on_pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        manager = self.engine.tokenizer_manager
        self._on_loop(lambda: manager.pause_generation(PauseGenerationReqInput(mode="abort")))

    def _on_resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        manager = self.engine.tokenizer_manager
        self._on_loop(lambda: manager.continue_generation(ContinueGenerationReqInput()))

    # -------------------------------------------------------------- weights and memory

    def _load_weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], *, version: int, checksum: bool
    ) -> None:
        """``update_weights_from_tensor`` in buckets (checked while they stream), then one
        ``flush_cache``."""
        session = None
        if self.weight_update_session:
            session = (
                lambda: check_update_result(
                    self.engine.begin_weight_update(), "begin_weight_update"
                ),
                lambda: check_update_result(self.engine.end_weight_update(), "end_weight_update"),
            )
        load_in_buckets(tensors, self.bucket_bytes, self._send_bucket, session=session)
        check_update_result(self.engine.flush_cache(), "flush_cache")

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        result = self.engine.update_weights_from_tensor(
            named_tensors=bucket, load_format=None, flush_cache=False
        )
        check_update_result(result, "update_weights_from_tensor")

    def _release(self) -> None:
        """``release_memory_occupation``: frees weights and KV cache."""
        self.engine.release_memory_occupation()

    def _resume(self) -> None:
        """``resume_memory_occupation``."""
        self.engine.resume_memory_occupation()

    def _alive(self) -> bool:
        try:
            self.engine.get_server_info()
        except Exception:  # any failure means not healthy
            log.exception("SGLang engine health check failed")
            return False
        return True


def _spawn(result: Any) -> None:
    if asyncio.iscoroutine(result):
        asyncio.ensure_future(result)
