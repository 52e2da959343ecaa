"""HTTP for the server clients (vLLM, SGLang): a JSON transport on the standard library, one
call that refuses non-2xx answers, and the error of a server that does not answer.

The clients talk through a :data:`Transport` so that tests can hand them a fake server; the
real one is :func:`http_transport`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

Transport = Callable[[str, str, "dict[str, Any] | None"], "tuple[int, Any]"]
"""``(method, path with query, JSON body or None) -> (status, decoded answer)``: how the HTTP
clients talk to a server. Tests pass a fake; :func:`http_transport` is the real one."""


class ServerUnreachable(ConnectionError):
    """A server did not answer: refused, reset, unknown host, or no answer within the timeout."""


def http_transport(base_url: str, *, timeout: float = 3600.0, server: str = "server") -> Transport:
    """A :data:`Transport` on the standard library: JSON in, JSON (or text) out. A request that
    gets no answer raises :class:`ServerUnreachable` naming ``server``, its URL and the route."""
    root = base_url.rstrip("/")

    def send(method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            root + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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


def check_server_answers(base_url: str, *, server: str, timeout: float = STARTUP_CHECK_S) -> None:
    """``RuntimeError`` naming ``server`` and ``base_url`` unless ``GET /health`` answers 200
    within ``timeout`` seconds (a refused connection fails at once)."""
    transport = http_transport(base_url, timeout=timeout, server=server)
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
