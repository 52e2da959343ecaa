"""HTTP for the server clients (vLLM, SGLang): a JSON transport on the standard library, one
call that refuses non-2xx answers, and the errors of a server that does not answer or refuses
the client's API key.

API keys: servers on shared clusters are started with ``--api-key``; the client then sends
``Authorization: Bearer <key>`` with every request. The key is read from the environment
variable ``rollout.api_key_env`` names (:func:`rollout_api_key`) and lives only inside the
transport: the config holds the variable's name, and no message, log line, metric or checkpoint
holds the key.

The clients talk through a :data:`Transport` so that tests can hand them a fake server; the
real one is :func:`http_transport`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Transport = Callable[[str, str, "dict[str, Any] | None"], "tuple[int, Any]"]
"""``(method, path with query, JSON body or None) -> (status, decoded answer)``: how the HTTP
clients talk to a server. Tests pass a fake; :func:`http_transport` is the real one."""


class ServerUnreachable(ConnectionError):
    """A server did not answer: refused, reset, unknown host, or no answer within the timeout."""


class ServerRefusedKey(RuntimeError):
    """A server answered 401 Unauthorized: it wants an API key, or not the one sent."""


@dataclass(frozen=True)
class ApiKey:
    """A server's API key and the environment variable it came from (for messages). Its
    ``repr`` shows only the variable, so that no message or log line can show the key."""

    value: str = field(repr=False)
    variable: str


def rollout_api_key(rollout: Any) -> ApiKey | None:
    """The key in the environment variable ``rollout.api_key_env`` names (a
    :class:`~bapo_megatron.config.rollout.RolloutConfig`); None when it names none.
    ``ValueError`` naming the setting and the variable when the variable is unset or empty."""
    variable = rollout.api_key_env
    if variable is None:
        return None
    value = os.environ.get(variable, "")
    if not value.strip():
        raise ValueError(
            f"rollout.api_key_env names the environment variable {variable}, which is "
            f"{'empty' if variable in os.environ else 'not set'} in this process (export it "
            "with the key the rollout servers were started with, --api-key)"
        )
    return ApiKey(value=value.strip(), variable=variable)


def http_transport(
    base_url: str,
    *,
    timeout: float = 3600.0,
    server: str = "server",
    api_key: ApiKey | None = None,
) -> Transport:
    """A :data:`Transport` on the standard library: JSON in, JSON (or text) out, with
    ``Authorization: Bearer`` when given an ``api_key``. A request that gets no answer raises
    :class:`ServerUnreachable`, one answered 401 :class:`ServerRefusedKey`, each naming
    ``server``, its URL and the route."""
    root = base_url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key.value}"

    def send(method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(root + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        except OSError as error:  # URLError, ConnectionError and TimeoutError are all OSErrors
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise ServerUnreachable(
                    f"{server} at {root}: {method} {path} got no answer within {timeout:g} s"
                ) from error
            raise ServerUnreachable(
                f"{server} at {root}: {method} {path} failed ({reason}); is the server running?"
            ) from error
        if status == 401:
            raise ServerRefusedKey(
                f"{server} at {root}: {method} {path} answered 401 Unauthorized: "
                + (
                    f"it refused the API key in ${api_key.variable} (rollout.api_key_env)"
                    if api_key is not None
                    else "it wants an API key; set rollout.api_key_env to the name of an "
                    "environment variable holding the key it was started with (--api-key)"
                )
            )
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return status, text

    return send


def call(
    transport: Transport, method: str, path: str, body: dict[str, Any] | None = None, *, server: str
) -> Any:
    """Send one request; ``RuntimeError`` naming the server, path, status and answer unless the
    status is 2xx. Returns the decoded answer."""
    status, answer = transport(method, path, body)
    if not 200 <= status < 300:
        raise RuntimeError(f"{server} {method} {path} answered {status}: {answer!r}")
    return answer


def answers_health(transport: Transport) -> bool:
    """Whether ``GET /health`` answers 200 (False when the server does not answer at all)."""
    try:
        status, _ = transport("GET", "/health", None)
    except OSError:
        return False
    return status == 200


STARTUP_CHECK_S = 30.0
"""How long a server client waits at startup for ``GET /health`` before refusing the URL."""


def check_server_answers(
    base_url: str,
    *,
    server: str,
    timeout: float = STARTUP_CHECK_S,
    api_key: ApiKey | None = None,
) -> None:
    """``RuntimeError`` naming ``server`` and ``base_url`` unless ``GET /health`` answers 200
    within ``timeout`` seconds (a refused connection fails at once); :class:`ServerRefusedKey`
    when it answers 401."""
    transport = http_transport(base_url, timeout=timeout, server=server, api_key=api_key)
    try:
        status, answer = transport("GET", "/health", None)
    except ServerUnreachable as error:
        raise RuntimeError(
            f"{server} at {base_url} does not answer GET /health (checked at startup, "
            f"waiting {timeout:g} s at most): {error}"
        ) from error
    if status != 200:
        raise RuntimeError(
            f"{server} at {base_url} does not answer GET /health with 200 (checked at "
            f"startup): {status}: {answer!r:.200}"
        )
