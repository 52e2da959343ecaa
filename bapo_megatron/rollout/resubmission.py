"""What the adapters of external engines (vLLM, SGLang) share: partial rollout by re-submission,
merging an engine's output into samples, and checking HF tensors before they are sent.

Partial rollout by re-submission. These engines know nothing of our samples: a round sends each
unfinished sample as a new request whose prompt is the sample's prompt plus every token it has
generated so far, capped at ``min(round_tokens, tokens left)`` new tokens. What comes back is
appended, each new token stamped with the engine's current policy version, so every token keeps
the behaviour log-prob and version it was sampled with. The engine recomputes the KV cache of the
re-submitted tokens (under the new weights, which is what continuing under the new policy means;
a prefix cache may make this cheap).

Seeds. One request per sample (never the engine's own ``n``), each with a seed derived from the
call's seed, the sample's position and its length so far: the same call gives the same rollout
whatever the batching, and a continued round does not replay the first round's random draws.

The engine base, :class:`ResubmittingEngine`, holds the protocol's bookkeeping (rounds, cut
rounds, weight checks, version, released memory); each adapter (in process or server client, of
either family) fills in how to submit a round, load checked tensors and release memory.

Everything here is pure Python (plus torch for the tensor checks); it is tested without either
engine installed. HTTP lives in :mod:`bapo_megatron.rollout.http`.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Literal

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.rollout.checksum import Checksum, agreed_checksum
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams, check_prompts, check_ready
from bapo_megatron.rollout.routes import decode_routes

EngineFinish = Literal["stop", "length", "abort"]
"""How an engine ended one request, normalized from its own vocabulary."""

LOGPROB_TOLERANCE = 1e-4
"""How far above 0 a reported log-prob may be (rounding) before it is refused."""


def new_samples(prompts: list[list[int]], n: int) -> list[RolloutSample]:
    """``n`` empty samples per prompt, prompt-major."""
    return [
        RolloutSample(prompt_index=p, sample_index=i, prompt_token_ids=list(prompt))
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]


def sample_seed(seed: int | None, sample: RolloutSample) -> int | None:
    """The seed of ``sample``'s next request: a 31-bit hash of the call's seed, the sample's
    prompt and sample index and its length so far; None without a call seed."""
    if seed is None:
        return None
    key = f"{seed}/{sample.prompt_index}/{sample.sample_index}/{len(sample.token_ids)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class RoundRequest:
    """One sample's request in one round."""

    sample: RolloutSample
    context: list[int]
    """Prompt plus the tokens generated so far: the engine's prompt for this round."""
    max_new_tokens: int
    """This round's cap: ``min(round_tokens, tokens the sample has left)``."""
    final: bool
    """Whether the cap is all the sample has left (so `length` ends it, rather than pausing it)."""
    seed: int | None
    """Seed of this request (:func:`sample_seed`)."""


def plan_round(
    samples: list[RolloutSample], params: SamplingParams, round_tokens: int | None
) -> list[RoundRequest]:
    """The requests of one round for ``samples`` (all to be generated now, in order)."""
    if round_tokens is not None and (
        isinstance(round_tokens, bool) or not isinstance(round_tokens, int) or round_tokens < 1
    ):
        raise ValueError(f"round_tokens must be a positive integer or None, got {round_tokens!r}")
    requests = []
    for sample in samples:
        left = params.max_new_tokens - len(sample.token_ids)
        if left <= 0:
            raise ValueError("a sample to continue has already generated max_new_tokens tokens")
        cap = left if round_tokens is None else min(round_tokens, left)
        requests.append(
            RoundRequest(
                sample=sample,
                context=sample.prompt_token_ids + sample.token_ids,
                max_new_tokens=cap,
                final=cap == left,
                seed=sample_seed(params.seed, sample),
            )
        )
    return requests


def reopen(samples: list[RolloutSample]) -> list[RolloutSample]:
    """The `paused` samples of ``samples``, marked unfinished again (to be continued)."""
    active = [s for s in samples if s.resumable]
    for sample in active:
        sample.finish_reason = None
    return active


@dataclass(frozen=True)
class EngineOutput:
    """What an engine generated for one request, parsed from its own format."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each token."""
    finish: EngineFinish
    detail: str = ""
    """The engine's own words on an `abort` (an error message), for error reports."""
    routes: Any = None
    """The experts the engine routed each token of the request to (``[tokens, layers,
    top_k]`` as the engine gives them, :mod:`bapo_megatron.rollout.routes`), when asked for."""


def apply_output(
    request: RoundRequest, output: EngineOutput, *, version: int, pausing: bool, where: str
) -> None:
    """Append ``output`` to ``request.sample`` and set its finish reason.

    `length` at this round's cap pauses the sample unless the cap was all it had left (a
    `length` below the cap is the engine's context window: final). `abort` pauses it when the
    adapter was pausing, else it ends it. ``where`` names the output in errors, which are
    ``ValueError``\\ s naming the offending field.
    """
    tokens, logprobs = output.token_ids, output.logprobs
    if len(logprobs) != len(tokens):
        raise ValueError(
            f"{where}: 'logprobs' has {len(logprobs)} entries for {len(tokens)} generated tokens"
        )
    if len(tokens) > request.max_new_tokens:
        raise ValueError(
            f"{where}: 'token_ids' holds {len(tokens)} tokens, the request allowed "
            f"{request.max_new_tokens}"
        )
    for position, value in enumerate(logprobs):
        if not isinstance(value, (int, float)) or math.isnan(value) or value > LOGPROB_TOLERANCE:
            raise ValueError(
                f"{where}: 'logprobs'[{position}] = {value!r} is not a log-probability"
            )
    if output.finish == "stop" and not tokens:
        raise ValueError(f"{where}: finish reason 'stop' with no generated token")
    sample = request.sample
    sample.token_ids.extend(int(t) for t in tokens)
    sample.logprobs.extend(float(v) for v in logprobs)
    sample.versions.extend([version] * len(tokens))
    if output.finish == "stop":
        sample.finish_reason = "stop"
    elif output.finish == "length":
        capped = len(tokens) == request.max_new_tokens and not request.final
        sample.finish_reason = "paused" if capped else "length"
    elif output.finish == "abort":
        sample.finish_reason = "paused" if pausing else "abort"
    else:
        raise ValueError(f"{where}: unknown finish reason {output.finish!r}")


# ------------------------------------------------------------------ weights


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of ``model`` and its shape (tied: no ``lm_head.weight``)."""
    return name_map_for(model.model_type).hf_shapes(model)


def checked_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    total: Checksum | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``named_tensors`` after checking each name and shape against ``shapes`` (the same
    ``ValueError`` messages as the embedded engine), adding each to ``total`` when given. A tied
    ``lm_head.weight`` is skipped, as the embedded engine does.

    The engines load what they are sent without a clear error for a wrong name or shape, so the
    adapters check first; a consumer that stops at the first error has loaded nothing wrong."""
    for name, tensor in named_tensors:
        if name not in shapes:
            if name == "lm_head.weight" and model.tie_word_embeddings:
                continue
            raise ValueError(
                f"update_weights: {name!r} is not a parameter of this {model.model_type} model"
            )
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                f"expects {shapes[name]}"
            )
        if total is not None:
            total.add(name, tensor)
        yield name, tensor


# ------------------------------------------------------------------ the shared engine skeleton


class ResubmittingEngine:
    """The protocol's bookkeeping for an engine that continues samples by re-submission.

    Subclasses implement :meth:`_submit` (run one round's requests, return one
    :class:`EngineOutput` each), :meth:`_load_weights` (send checked tensors to the engine),
    :meth:`_release`, :meth:`_resume` and :meth:`_alive` (the engine's memory and health), and may
    override :meth:`_check_params`, :meth:`_on_abort`, :meth:`_on_pause` and :meth:`_on_resume`
    (tell the engine). :meth:`abort` and :meth:`pause` may be called from another thread while
    :meth:`_submit` runs: the engine then returns its cut requests with finish `abort`, which
    become `abort` or `paused` samples. An `abort` the adapter did not ask for is the engine's
    own error and raises ``RuntimeError``.
    """

    engine_name = "engine"
    routes_option = "routed-expert capture"
    """How the engine is started so that it returns routed experts (for error messages)."""

    def __init__(self, model: ModelConfig, *, version: int, record_routes: bool = False) -> None:
        if record_routes and not model.is_moe:
            raise ValueError(
                f"record_routes: model_type {model.model_type!r} has no experts to route to"
            )
        self.model_config = model
        self.version = version
        self.record_routes = record_routes
        """Ask the engine for the experts of every token it runs and fill
        ``RolloutSample.routes`` (mixture-of-experts models, routing replay of the rollout)."""
        self._shapes = expected_shapes(model)
        self._abort = threading.Event()
        self._pause = threading.Event()
        self._released = False

    # -------------------------------------------------------------- generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, round_tokens: int | None = None
    ) -> list[RolloutSample]:
        """``params.n`` samples per prompt, prompt-major (see the protocol)."""
        check_prompts(prompts, self.model_config)
        self._check_params(params)
        samples = new_samples(prompts, params.n)
        self._round(samples, params, round_tokens)
        return samples

    def continue_generation(
        self,
        samples: list[RolloutSample],
        params: SamplingParams,
        *,
        round_tokens: int | None = None,
    ) -> list[RolloutSample]:
        """Continue the `paused` samples in place by re-submission; returns ``samples``."""
        self._check_params(params)
        self._round(reopen(samples), params, round_tokens)
        return samples

    def _round(
        self, samples: list[RolloutSample], params: SamplingParams, round_tokens: int | None
    ) -> None:
        if not samples:
            return
        requests = plan_round(samples, params, round_tokens)
        check_ready(self._released, self.version)
        self._abort.clear()
        if self._pause.is_set():
            for sample in samples:
                sample.finish_reason = "paused"
            return
        outputs = self._submit(requests, params)
        if len(outputs) != len(requests):
            raise ValueError(
                f"{self.engine_name}: {len(outputs)} outputs for {len(requests)} requests"
            )
        asked = self._abort.is_set() or self._pause.is_set()
        for index, (request, output) in enumerate(zip(requests, outputs)):
            where = f"{self.engine_name} request {index}"
            if output.finish == "abort" and not asked:
                raise RuntimeError(
                    f"{where} was aborted by the engine: {output.detail or '(no message)'}"
                )
            apply_output(
                request, output, version=self.version, pausing=self._pause.is_set(), where=where
            )
            if self.record_routes:
                self._take_routes(request, output, where)

    def _take_routes(self, request: RoundRequest, output: EngineOutput, where: str) -> None:
        """The round's routes replace the sample's: the engine ran its whole context again
        (under the current weights), as the embedded engine does. A cut request the engine
        returned no routes for keeps the earlier ones (its later tokens have none)."""
        sample = request.sample
        where = f"{where} (prompt {sample.prompt_index}, sample {sample.sample_index})"
        if output.routes is None:
            if output.finish == "abort":
                return
            raise ValueError(
                f"{where}: no routed experts in the answer; start {self.engine_name} with "
                f"{self.routes_option}"
            )
        sample.routes = decode_routes(
            output.routes,
            self.model_config,
            tokens=len(request.context) + len(output.token_ids),
            finished=output.finish != "abort",
            where=where,
        )

    def _submit(self, requests: list[RoundRequest], params: SamplingParams) -> list[EngineOutput]:
        raise NotImplementedError

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse sampling parameters this engine cannot honour (default: accept all)."""

    # -------------------------------------------------------------- control

    def abort(self) -> None:
        """Cut in-flight generation: unfinished samples come back `abort`."""
        self._abort.set()
        self._on_abort()

    def pause(self) -> None:
        """Cut in-flight generation (samples come back `paused`); later calls generate nothing
        until :meth:`resume`."""
        self._pause.set()
        self._on_pause()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._on_resume()
        self._pause.clear()

    def _on_abort(self) -> None: ...
    def _on_pause(self) -> None: ...
    def _on_resume(self) -> None: ...

    def _cut(self) -> bool:
        """Whether :meth:`abort` or :meth:`pause` cut the current round."""
        return self._abort.is_set() or self._pause.is_set()

    # -------------------------------------------------------------- weights and memory

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        checksum: bool = False,
    ) -> str | None:
        """Check HF names and shapes (:func:`checked_tensors`) as the engine loads them, and set
        the version only when all of it loaded; with ``checksum``, return the SHA-256 of what
        was loaded."""
        if self._released:
            raise RuntimeError("update_weights after release_memory(): call resume_memory() first")
        total = Checksum() if checksum else None
        reports = self._load_weights(
            checked_tensors(named_tensors, self.model_config, self._shapes, total),
            version=int(version),
            checksum=checksum,
        )
        sent = total.hexdigest() if total is not None else None
        if sent is not None and reports is not None:
            agreed_checksum(reports, sent, self.engine_name)
        self.version = int(version)
        return sent

    def _load_weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], *, version: int, checksum: bool
    ) -> list[Any] | None:
        """Load the checked ``tensors`` (a lazy stream: a check fails while it is consumed).
        Engines whose workers report what they loaded return one ``{"checksum": ...}`` per
        worker (computed when ``checksum`` asks), which must all equal what was sent; others
        return None."""
        raise NotImplementedError

    def release_memory(self) -> None:
        """Free the engine's weights and KV cache (see :meth:`_release`)."""
        self._release()
        self._released = True

    def resume_memory(self) -> None:
        """Re-allocate what :meth:`release_memory` freed; :meth:`update_weights` must follow."""
        if not self._released:
            return
        self._resume()
        self._released = False
        self.version = -1

    def health(self) -> bool:
        """Holds weights, memory not released, and the engine answers."""
        return not self._released and self.version >= 0 and self._alive()

    def _release(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _alive(self) -> bool:
        raise NotImplementedError


def wait_cutting(
    futures: list[Future],
    cut: Callable[[], bool],
    abort_all: Callable[[], None],
    *,
    interval: float = 0.5,
) -> list[Any]:
    """Wait for ``futures`` (requests in flight on other threads); while ``cut()`` holds and
    some are pending, call ``abort_all()`` every ``interval`` seconds. A request that reached
    the server just after a pause or abort was sent would otherwise wait for the resume (vLLM
    and SGLang hold new requests while paused) or run to its end. Returns the results."""
    pending = set(futures)
    while pending:
        _, pending = wait(pending, timeout=interval)
        if pending and cut():
            abort_all()
    return [future.result() for future in futures]
