"""The vLLM server client against a real vLLM OpenAI-compatible server (the optional vLLM tier,
see requirements-vllm.txt): the rollout conformance suite, long seeded continuations, weights
by every route (a trainer cut off part-way through an update included), and a server whose
engine dies mid-run. Skipped where vLLM is not installed.

One server serves the module: two worker processes (vLLM's multiprocess executor) behind an API
key; the suite's client code is the same at any size, and a one-worker server (its EngineCore
running the model itself) is exercised by tests/vllm/test_rollout_vllm_moe.py, by both weight
routes and with its EngineCore killed. A test that finds the server dead (the death test kills
it, and a crash of vLLM would too) gets a new one, started after the old one's log is shown, so
one dead server never fails the tests after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.http import ApiKey, ServerRefusedKey, answers_health, http_transport
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from bapo_megatron.rollout.vllm.worker_extension import WORKER_EXTENSION
from tests.distributed.shard_sync_engines import KEY_ENV
from tests.distributed.test_shard_sync import check_results, launch
from tests.helpers.vllm_models import VLLM_MODEL, long_seeded_continuations

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 600
"""How long a server may take to answer /health after starting (30-40 s here, more under load)."""

WATCH_TIMEOUT_S = 300
"""How long :func:`after_server_first_tokens` waits for the first tokens before acting anyway
(the test then fails on its assertions instead of hanging)."""


class ServerProcess:
    """A vLLM server in a subprocess on the model in ``folder`` (context ``max_model_len``), with
    the RL routes, the worker extension and chunked prefill off (seeded requests crash a CPU
    vLLM that prefills in chunks: bapo_megatron/rollout/vllm/engine.py). Its output goes to
    ``server-N.log``. ``tensor_parallel_size`` > 1 starts that many workers, with the thread
    binding a host of one NUMA node needs (``VLLM_CPU_OMP_THREADS_BIND=nobind``); ``api_key``
    starts it with ``--api-key`` and its clients send the key."""

    def __init__(
        self,
        folder: Path,
        max_model_len: int = 131072,
        tensor_parallel_size: int = 1,
        api_key: str | None = None,
    ) -> None:
        self.folder = folder
        self.max_model_len = max_model_len
        self.tensor_parallel_size = tensor_parallel_size
        self.api_key = None if api_key is None else ApiKey(api_key, KEY_VARIABLE)
        self.starts = 0
        self.process: subprocess.Popen | None = None
        self.client: VLLMServerClient | None = None
        self.cores: list[psutil.Process] = []

    @property
    def log_path(self) -> Path:
        return self.folder / f"server-{self.starts}.log"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> VLLMServerClient:
        """Start a server and connect a client; RuntimeError with the log's tail if it does not
        answer /health within START_TIMEOUT_S or exits."""
        self.starts += 1
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        options = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.tensor_parallel_size > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.api_key is not None:
            options += ["--api-key", self.api_key.value]
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(self.folder),
                    "--worker-extension-cls",
                    WORKER_EXTENSION,
                    "--logprobs-mode",
                    "processed_logprobs",
                    "--skip-tokenizer-init",
                    "--dtype",
                    "float32",
                    "--enforce-eager",
                    "--no-enable-chunked-prefill",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--max-model-len",
                    str(self.max_model_len),
                    *options,
                ],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        self.base_url = url
        transport = http_transport(url, timeout=5, api_key=self.api_key)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers_health(transport):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"vLLM server (log {self.log_path}) did not start:\n{self.log_tail()}"
                )
            time.sleep(1)
        self.cores = [self.engine_core()]
        self.client = self.connect(url, weights_dir=self.folder / "updates")
        return self.client

    def connect(self, url: str, **options) -> VLLMServerClient:
        """A client of this server (with its key) on VLLM_MODEL."""
        return VLLMServerClient.connect(
            url, VLLM_MODEL, timeout=120, api_key=self.api_key, **options
        )

    def alive(self) -> bool:
        return (
            self.process is not None
            and self.process.poll() is None
            and self.client is not None
            and self.client.health()
        )

    def live_client(self) -> VLLMServerClient:
        """The client of a live server: this one's, or a new one's when it died."""
        if self.alive():
            return self.client
        if self.process is not None:
            print(
                f"\nvLLM server {self.starts} is dead; starting a new one. Its log "
                f"({self.log_path}) ends:\n{self.log_tail(1500)}"
            )
            self.stop()
        return self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for core in self.cores:  # an EngineCore outlives a server killed with SIGKILL
            if core.is_running():
                core.kill()
        self.cores = []

    def engine_core(self) -> psutil.Process:
        """The server's EngineCore process (vLLM titles it ``VLLM::EngineCore``)."""
        cores = [
            child
            for child in psutil.Process(self.process.pid).children(recursive=True)
            if "EngineCore" in " ".join(child.cmdline())
        ]
        assert len(cores) == 1, f"expected one EngineCore child of the server, found {cores}"
        return cores[0]


TP2_KEY = "tp2-server-key"
"""The API key the module's TP 2 server is started with (``--api-key``)."""
KEY_VARIABLE = "VLLM_TEST_KEY"
"""The environment variable a process started here finds that key in."""


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    """The module's vLLM server, two worker processes behind an API key (started on first use,
    restarted when found dead)."""
    folder = tmp_path_factory.mktemp("vllm-server-model")
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(folder)
    server = ServerProcess(folder, tensor_parallel_size=2, api_key=TP2_KEY)
    yield server
    server.stop()


@pytest.fixture
def server_suite(tp2_server, monkeypatch):
    """The suite's ``make_engine`` on the live server: loads the given weights as version 0,
    every worker reporting the bytes sent."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    client = tp2_server.live_client()

    def make_engine(weights):
        client.resume()
        client.resume_memory()
        client.update_weights(weights.items(), version=0, checksum=True)
        return client

    return make_engine


def test_vllm_server_logprobs_match_a_teacher_forced_recompute(server_suite):
    suite.test_logprobs_match_a_teacher_forced_recompute(server_suite)


def test_vllm_server_stop_tokens_seed_and_n(server_suite):
    suite.test_stop_tokens_seed_and_n(server_suite)


def test_vllm_server_partial_rollout_keeps_each_tokens_version_and_logprob(server_suite):
    suite.test_partial_rollout_keeps_each_tokens_version_and_logprob(server_suite)


def test_vllm_server_long_seeded_continuations_run_and_repeat(server_suite):
    client = server_suite(suite.random_weights(10))
    assert client.server_device == "cpu" and client.server_chunked_prefill is False
    long_seeded_continuations(server_suite)


def first_tokens_served(client: VLLMServerClient) -> int:
    """How many requests the server has given a first token (its Prometheus
    ``vllm:time_to_first_token_seconds`` histogram counts one per request)."""
    text = client._call("GET", "/metrics")
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_count")
    ]
    assert counts, "the server's /metrics has no vllm:time_to_first_token_seconds_count"
    return int(sum(counts))


def after_server_first_tokens(engine, samples, action):
    """The suite's ``after_first_tokens`` for the server client: a thread watches the server's
    first-token count and runs ``action`` once the next call's ``samples`` requests all hold a
    token (the count is read before the call, so earlier requests do not count)."""
    start = first_tokens_served(engine)

    def watch():
        deadline = time.monotonic() + WATCH_TIMEOUT_S
        while first_tokens_served(engine) < start + samples and time.monotonic() < deadline:
            time.sleep(0.05)
        action()

    threading.Thread(target=watch, daemon=True).start()


def test_vllm_server_abort_and_pause_from_another_thread(server_suite, monkeypatch):
    monkeypatch.setattr(suite, "after_first_tokens", after_server_first_tokens)
    suite.test_abort_and_pause_from_another_thread(server_suite)


def test_vllm_server_weight_updates_are_checked_and_memory_can_be_released(server_suite):
    suite.test_weight_updates_are_checked_and_memory_can_be_released(server_suite)


def under_weights(client: VLLMServerClient, weights: dict[str, torch.Tensor], version: int):
    """Generate and check every token's version and log-prob against a float64 recompute under
    ``weights``."""
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    for sample in client.generate(suite.PROMPTS, params):
        assert sample.versions == [version] * params.max_new_tokens
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            suite.teacher_forced(weights, sample, params.temperature),
            rtol=0,
            atol=2e-5,
        )


def test_a_tp2_vllm_server_takes_weights_by_both_routes_into_both_workers(
    tp2_server, monkeypatch, tmp_path
):
    """Both workers of a TP 2 server join the weight group, and by either route each reports the
    checksum of the bytes sent; generation follows the new weights. The server wants its API
    key: a client without it is refused, naming the server."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    server = tp2_server
    server.live_client()
    with pytest.raises(ServerRefusedKey, match=f"vLLM server at {server.base_url}"):
        VLLMServerClient.connect(server.base_url, VLLM_MODEL, timeout=120)
    by_group = server.connect(server.base_url, weight_transport="process-group")
    by_folder = server.connect(server.base_url, weights_dir=tmp_path)
    assert by_group.weight_group.server_ranks == 2
    for version, (client, seed) in enumerate(((by_group, 21), (by_folder, 22), (by_group, 23)), 1):
        new = suite.random_weights(seed)
        digest = client.update_weights(new.items(), version=version, checksum=True)
        assert digest == suite.checksum(new.items())
        if client is by_group:
            reports = by_group.weight_group.answer["results"]
            assert [report["checksum"] for report in reports] == [digest, digest]
        under_weights(client, new, version)


@pytest.mark.multiprocess
def test_a_tp2_vllm_server_receives_shard_to_shard_from_trainer_pp2(
    tp2_server, monkeypatch, tmp_path
):
    """The TP 2 server's workers join a transfer group with a trainer at PP 2 (2 processes,
    tests/distributed/shard_sync_worker.py, after the module's other updates reloaded the
    server in place): three syncs with new weights, each equal to the broadcast path's on the
    workers' checksums, greedy tokens and log-probs (the model's one key/value head goes to
    both workers); a rank that planned with another bucket size stops every rank."""
    server = tp2_server
    server.live_client()
    shutil.copytree(
        server.folder, tmp_path / "hf", ignore=shutil.ignore_patterns("*.log", "updates")
    )
    monkeypatch.setenv(KEY_ENV, TP2_KEY)
    results = launch(tmp_path, ["pp2"], world=2, engine="vllm-server", url=server.base_url)
    check_results(results, ["pp2"])


CUT_SENDER = """
import os, sys
import torch
import tests.unit.test_rollout_engines as suite
from tests.helpers.vllm_models import VLLM_MODEL
from bapo_megatron.rollout.http import ApiKey
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from bapo_megatron.rollout.weight_group import ServerWeightGroup

def first_then_die(self, tensors):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    self.group.broadcast([tensors[0]], options).wait()
    os._exit(17)  # the trainer dies part-way through the update

suite.MODEL = VLLM_MODEL
ServerWeightGroup._broadcast = first_then_die
key = ApiKey(os.environ[sys.argv[2]], sys.argv[2])
client = VLLMServerClient.connect(
    sys.argv[1], VLLM_MODEL, weight_transport="process-group", timeout=120, api_key=key
)
client.update_weights(suite.random_weights(9).items(), version=9)
"""


def test_a_cut_update_leaves_the_vllm_server_on_its_previous_weights(tp2_server, monkeypatch):
    """A trainer that dies part-way through a process-group update (one tensor sent to both
    workers) leaves the server on its previous weights, and the next client's update builds a
    group anew."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    server = tp2_server
    server.live_client()
    client = server.connect(server.base_url, weight_transport="process-group")
    held = suite.random_weights(5)
    client.update_weights(held.items(), version=1)
    cut = subprocess.run(
        [sys.executable, "-c", CUT_SENDER, server.base_url, KEY_VARIABLE],
        cwd=Path(__file__).resolve().parents[2],
        env=dict(
            os.environ,
            PYTHONPATH=str(Path(__file__).resolve().parents[2]),
            OMP_NUM_THREADS="1",
            **{KEY_VARIABLE: TP2_KEY},
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cut.returncode == 17, cut.stderr[-3000:]
    under_weights(client, held, 1)
    # the cut sender's group replaced this client's on the server: the next update builds anew
    fresh = server.connect(server.base_url, weight_transport="process-group")
    new = suite.random_weights(6)
    fresh.update_weights(new.items(), version=2)
    under_weights(fresh, new, 2)


def check_a_killed_process_is_named(
    client: VLLMServerClient, process, weights: dict, prompts: list[list[int]]
) -> None:
    """Load ``weights``, generate from ``prompts``, then SIGKILL ``process`` (the server's, or
    its EngineCore's, as a crash of vLLM would): the next call raises EngineFailure naming the
    engine and its URL, and health() answers False. (The guard's deadline bounds the call if
    the server hung instead.)"""
    client.update_weights(weights.items(), version=0)
    url = client.base_url
    guarded = GuardedEngine(client, name=f"rollout engine 'vllm-server' at {url}", timeout_s=300)
    params = SamplingParams(max_new_tokens=3, seed=1)
    assert all(len(s.token_ids) == 3 for s in guarded.generate(prompts, params))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    with pytest.raises(EngineFailure) as failure:
        guarded.generate(prompts, params)
    message = str(failure.value)
    assert message.startswith(f"rollout engine 'vllm-server' at {url}: generate failed: ")
    assert "gave no result within" not in message  # the engine's own error, not the deadline
    assert not guarded.health()


def test_a_vllm_server_that_dies_mid_run_is_named(tp2_server, monkeypatch):
    """A whole server killed between two calls is named (its EngineCore killed: the MoE
    server's last test, tests/vllm/test_rollout_vllm_moe.py). It kills the server the tests
    before it are done with: the module's last test."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    client = tp2_server.live_client()
    check_a_killed_process_is_named(
        client, tp2_server.process, suite.random_weights(3), suite.PROMPTS
    )
