"""Start a test's Python commands as children of the fork server (``tests/helpers/fork_server.py``)
instead of new interpreters: the same command, environment, working directory, streams and exit
status, without importing torch, Megatron-Core and transformers again in every process.

:func:`popen` and :func:`run` take what ``subprocess.Popen`` and ``subprocess.run`` take for the
commands the suite starts (``[sys.executable, ("-u"), "-m", module | script, *args]``) and return
objects that behave as theirs (``pid``, ``poll``, ``wait``, ``kill``, ``send_signal``,
``communicate``, ``returncode``, ``stdout``). Any other command, or ``BAPO_TEST_FRESH_PROCESSES=1``
in the environment, goes to ``subprocess`` unchanged.

The processes that other processes start (torchrun's agent and workers, a script's or a tool's
Python processes) are forked too: :func:`start_server` puts ``fork_shim`` on ``PYTHONPATH``, whose
start-up hook has the server fork the command and stands in for it (``fork_shim/sitecustomize.py``).
A test about what a new interpreter imports runs its command with ``-c``, or with
``BAPO_FORK_SERVER`` removed from the command's environment.

One server per test session, started by the conftest; it ends with the session (its standard
input is a pipe from this process).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tests.helpers.gloo_launch import ONE_THREAD, REPO_ROOT

STARTUP_TIMEOUT_S = 300  # its imports take 10-30 s on a loaded 2-core machine
SHIM = REPO_ROOT / "tests" / "helpers" / "fork_shim"
_server: subprocess.Popen | None = None
_socket_path: str | None = None
_ready = False
_lock = threading.Lock()


def start_server() -> None:
    """Start the fork server (its imports go on in the background) and have every Python process
    this session starts from now on, at any depth, ask it for a fork (``fork_shim``)."""
    global _server, _socket_path, _ready
    if fresh_processes_asked():
        return
    with _lock:
        if _server is not None and _server.poll() is None:
            return
        folder = tempfile.mkdtemp(prefix="bapo-fork-server-")
        _socket_path = os.path.join(folder, "socket")
        env = {**os.environ, **ONE_THREAD}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *without_shim(os.environ.get("PYTHONPATH", ""))]
        )
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        env.pop("BAPO_FORK_SERVER", None)
        _server = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fork_server", _socket_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            env=env,
        )
        _ready = False
        atexit.register(_stop_server)
        os.environ["BAPO_FORK_SERVER"] = _socket_path
        os.environ["BAPO_FORK_SERVER_PYTHON"] = os.path.realpath(sys.executable)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(SHIM), *without_shim(os.environ.get("PYTHONPATH", ""))]
        )


def fresh_processes_asked() -> bool:
    """``BAPO_TEST_FRESH_PROCESSES=1``: every process a new interpreter, no server."""
    return os.environ.get("BAPO_TEST_FRESH_PROCESSES") == "1"


def without_shim(python_path: str) -> list[str]:
    return [p for p in python_path.split(os.pathsep) if p and p != str(SHIM)]


def server_address() -> str:
    """The fork server's socket, once it has done its imports (started here if not yet)."""
    global _ready
    start_server()
    with _lock:
        if not _ready:
            started = readable(_server.stdout, STARTUP_TIMEOUT_S)
            if not started or _server.stdout.readline().strip() != b"ready":
                _server.kill()
                raise RuntimeError(
                    f"the fork server (tests/helpers/fork_server.py) did not start within "
                    f"{STARTUP_TIMEOUT_S} s (exit {_server.wait()})"
                )
            _ready = True
        return _socket_path


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _server.kill()
    shutil.rmtree(os.path.dirname(_socket_path), ignore_errors=True)


def forkable(command: list[str]) -> tuple[bool, str, list[str], bool] | None:
    """``(is_module, target, args, unbuffered)`` for a command the server can run, else None."""
    if fresh_processes_asked():
        return None
    if not command or str(command[0]) != sys.executable:
        return None
    rest = [str(part) for part in command[1:]]
    unbuffered = False
    if rest[:1] == ["-u"]:
        unbuffered, rest = True, rest[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return True, rest[1], rest[2:], unbuffered
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return False, rest[0], rest[1:], unbuffered
    return None


class ForkedProcess:
    """A child of the fork server, seen as a ``subprocess.Popen``."""

    def __init__(self, command, *, cwd, env, stdin, stdout, stderr, text, start_new_session):
        self.args = command
        self.returncode: int | None = None
        self.stdout = self.stderr = self.stdin = None
        is_module, target, args, unbuffered = forkable(command)
        closers, fds = [], []
        null = None
        for which, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if spec == subprocess.STDOUT and which == "stderr":
                fds.append(fds[1])
            elif spec == subprocess.PIPE:
                read, write = os.pipe()
                ours, theirs = (write, read) if which == "stdin" else (read, write)
                mode = ("w" if which == "stdin" else "r") + ("" if text else "b")
                setattr(self, which, os.fdopen(ours, mode))
                fds.append(theirs)
                closers.append(theirs)
            elif spec is None:
                fds.append(which_fd(which))
            elif spec == subprocess.DEVNULL:
                null = null if null is not None else os.open(os.devnull, os.O_RDWR)
                fds.append(null)
            elif isinstance(spec, int):
                fds.append(spec)
            else:
                fds.append(spec.fileno())
        if null is not None:
            closers.append(null)
        request = {
            "module": is_module,
            "target": target,
            "args": args,
            "unbuffered": unbuffered,
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
            "new_session": bool(start_new_session),
        }
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._connection.connect(server_address())
            socket.send_fds(self._connection, [json.dumps(request).encode()], fds)
            self._reader = self._connection.makefile("rb")
            self.pid = json.loads(self._reader.readline())["pid"]
        finally:
            for fd in closers:
                os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            if readable(self._connection, 0):
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not readable(self._connection, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        line = self._reader.readline()
        # the server closing without a word means it was killed: report it as a SIGKILL
        self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
        self._reader.close()
        self._connection.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input=None, timeout: float | None = None):
        """Read the piped streams to their end and wait, as ``Popen.communicate`` does."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        results: dict[str, object] = {}
        readers = []
        for name in ("stdout", "stderr"):
            handle = getattr(self, name)
            if handle is not None:
                reader = threading.Thread(
                    target=_read_to_end, args=(handle, name, results), daemon=True
                )
                reader.start()
                readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in (self.stdout, self.stderr, self.stdin):
            if handle is not None:
                handle.close()
        self.wait()


def _read_to_end(handle, name: str, results: dict) -> None:
    with handle:
        results[name] = handle.read()


def readable(handle, timeout: float | None) -> bool:
    """Whether ``handle`` has something to read (or has closed) within ``timeout`` seconds.
    ``poll``, not ``select``: the test process may hold more than 1024 descriptors."""
    poller = select.poll()
    poller.register(handle, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def which_fd(name: str) -> int:
    return {"stdin": 0, "stdout": 1, "stderr": 2}[name]


def popen(
    command: list[str],
    *,
    cwd=None,
    env=None,
    stdin=None,
    stdout=None,
    stderr=None,
    text: bool = False,
    start_new_session: bool = False,
):
    """``subprocess.Popen(command, ...)``, forked from the server when it can be."""
    options = dict(
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        start_new_session=start_new_session,
    )
    if forkable(command) is None:
        return subprocess.Popen(command, **options)
    return ForkedProcess(command, **options)


def run(
    command: list[str],
    *,
    cwd=None,
    env=None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
    input=None,
    stdout=None,
    stderr=None,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, ...)``, forked from the server when it can be; a command past
    ``timeout`` is killed and ``subprocess.TimeoutExpired`` raised, as there."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    process = popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if input is not None else None,
        stdout=stdout,
        stderr=stderr,
        text=text,
    )
    try:
        out, err = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    result = subprocess.CompletedProcess(command, process.returncode, out, err)
    if check:
        result.check_returncode()
    return result
