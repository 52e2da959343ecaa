"""API keys of the rollout servers and the unpickling guard: the server clients read the key
from the environment variable ``rollout.api_key_env`` names and send it as ``Authorization:
Bearer`` (checked against a real HTTP server on this host, which wants a key as vLLM and SGLang
started with ``--api-key`` do); a 401 is an error naming the server; the key appears in no
message or config; and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is refused at startup."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import RolloutConfig, load_config
from bapo_megatron.files.unpickling_guard import refuse_unpickling_loads
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.http import (
    ApiKey,
    ServerRefusedKey,
    check_server_answers,
    http_transport,
    rollout_api_key,
)
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient
from bapo_megatron.trainer.main import preflight
from tests.helpers.gloo_launch import REPO_ROOT

KEY = "sk-test-3f9a1c"  # what the server below was "started with"


class KeyedServer(ThreadingHTTPServer):
    """Answers 200 ``{}`` to a request bearing :data:`KEY`, 401 otherwise; keeps every
    request's Authorization header."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.authorizations: list[str | None] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        authorization = self.headers.get("Authorization")
        self.server.authorizations.append(authorization)
        ok = authorization == f"Bearer {KEY}"
        body = json.dumps({} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # no request lines on the test's stderr
        pass


@pytest.fixture
def keyed_server():
    server = KeyedServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_key_is_sent_as_a_bearer_token(keyed_server):
    key = ApiKey(value=KEY, variable="ROLLOUT_KEY")
    send = http_transport(keyed_server.url, timeout=10, server="vLLM server", api_key=key)
    assert send("POST", "/v1/completions", {"prompt": [1]}) == (200, {})
    check_server_answers(keyed_server.url, server="vLLM server", timeout=10, api_key=key)
    assert keyed_server.authorizations == [f"Bearer {KEY}"] * 2
    assert KEY not in repr(key) and "ROLLOUT_KEY" in repr(key)


def test_a_401_is_an_error_naming_the_server_and_never_the_key(keyed_server):
    url = keyed_server.url
    wrong = ApiKey(value="sk-wrong-000", variable="ROLLOUT_KEY")
    send = http_transport(url, timeout=10, server="SGLang server", api_key=wrong)
    with pytest.raises(
        ServerRefusedKey,
        match=rf"^SGLang server at {url}: POST /generate answered 401 Unauthorized: it refused "
        r"the API key in \$ROLLOUT_KEY \(rollout.api_key_env\)$",
    ) as refused:
        send("POST", "/generate", {})
    assert "sk-wrong-000" not in str(refused.value)
    keyless = http_transport(url, timeout=10, server="vLLM server")
    with pytest.raises(ServerRefusedKey, match=r"401 Unauthorized: it wants an API key; set "):
        keyless("GET", "/v1/models", None)
    # the startup check reports the 401 itself, not "does not answer"
    with pytest.raises(ServerRefusedKey, match=rf"^vLLM server at {url}: GET /health answered"):
        check_server_answers(url, server="vLLM server", timeout=10)


def test_the_trainers_server_engine_takes_its_key_from_the_named_variable(
    keyed_server, monkeypatch, tmp_path
):
    rollout = RolloutConfig(
        engine="sglang-server", server_urls=(keyed_server.url,), api_key_env="ROLLOUT_KEY"
    )
    monkeypatch.setenv("ROLLOUT_KEY", KEY)
    engine = build_engine(
        rollout, suite.MODEL, model_path=None, dp_rank=0, work_dir=tmp_path, pad_token_id=0
    )
    client = engine.engine
    assert isinstance(client, SGLangServerClient)
    client._post("/flush_cache")  # a control call: the key goes with every request
    assert keyed_server.authorizations == [f"Bearer {KEY}"] * 2
    # the key is in no attribute of the client and nowhere in the config
    assert all(KEY not in repr(value) for value in vars(client).values())
    assert KEY not in json.dumps(dataclasses.asdict(rollout))

    monkeypatch.setenv("ROLLOUT_KEY", "sk-wrong-000")
    with pytest.raises(
        EngineFailure,
        match=r"^rollout engine 'sglang-server' of data-parallel replica 0 at "
        rf"{keyed_server.url} could not start: ServerRefusedKey: SGLang server at "
        rf"{keyed_server.url}: GET /health answered 401",
    ):
        build_engine(
            rollout, suite.MODEL, model_path=None, dp_rank=0, work_dir=tmp_path, pad_token_id=0
        )


def test_a_named_variable_that_is_not_set_is_refused_before_the_run_starts(monkeypatch):
    monkeypatch.delenv("ROLLOUT_KEY", raising=False)
    cfg = load_config(
        REPO_ROOT / "examples" / "tiny_cpu" / "train.yaml",
        ["rollout.engine=vllm-server", "rollout.server_urls=[http://h:1]"],
    )
    assert rollout_api_key(cfg.rollout) is None  # no variable named: no key sent
    cfg.rollout.api_key_env = "ROLLOUT_KEY"
    with pytest.raises(
        ValueError,
        match=r"^rollout.api_key_env names the environment variable ROLLOUT_KEY, which is not "
        "set in this process",
    ):
        preflight(cfg)
    monkeypatch.setenv("ROLLOUT_KEY", "  ")
    with pytest.raises(ValueError, match="ROLLOUT_KEY, which is empty"):
        rollout_api_key(cfg.rollout)
    with pytest.raises(ValueError, match="rollout.api_key_env must name an environment variable"):
        RolloutConfig(api_key_env="")


@pytest.mark.parametrize("value", ["1", "true", "YES", "y"])
def test_unpickling_loads_forced_by_the_environment_are_refused(value):
    with pytest.raises(
        ValueError,
        match=rf"^TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD={value} is set in the environment: it makes "
        "torch.load unpickle",
    ):
        refuse_unpickling_loads({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": value})


def test_values_torch_ignores_are_not_refused():
    for environ in ({}, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "0"}, {"OTHER": "1"}):
        refuse_unpickling_loads(environ)


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "bapo_megatron.train", "--config", "examples/tiny_cpu/train.yaml"],
        ["tools/convert_checkpoint.py", "megatron-to-hf", "checkpoint", "out"],
    ],
)
def test_the_commands_refuse_to_start_with_one_line(command):
    from tests.helpers.train_runs import subprocess_env

    env = {**subprocess_env(), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    result = subprocess.run(
        [sys.executable, *command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set" in lines[0], (
        result.stderr
    )
