"""A Python process that has imported the heavy libraries once and forks a fresh child for every
test command (``python [-u] -m module ...`` or ``python [-u] script.py ...``).

Every trainer, tool or worker process a test starts spends 7-10 s of CPU importing torch,
Megatron-Core and transformers before its first line of work; on a 2-core machine that was a
third of the suite. A child forked from this server starts with those modules in memory and
runs the command as ``python`` would: its own argv, environment, working directory, standard
streams (handed over as file descriptors) and exit status, with atexit handlers and non-daemon
threads seen to at exit. Nothing here has run torch code before the fork (no thread pool, no
process group), so the children start as clean as a new interpreter, but for the modules.

Protocol, over a Unix socket (``tests/helpers/preloaded_processes.py`` is the client): the client
sends one JSON request with its three stdio descriptors attached (``socket.send_fds``); the server
answers ``{"pid": ...}`` and, when the child has ended, ``{"returncode": ...}`` (negative: the
signal that ended it), then closes the connection. The server ends, killing what it started
that still runs, when its standard input closes: the test process that started it is gone.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

# What a trainer, a tool or a worker of the suite imports (each costing > 0.1 s), in the order
# they would be imported, after :func:`preload` has deferred Megatron-Core's imports of wandb,
# TorchDynamo and its JIT as every command line of a real run does
# (bapo_megatron/process/start.py). A module that fails to import here is only imported
# by the child.
PRELOAD = (
    "bapo_megatron",
    "numpy",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "numba",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.transformer.moe.moe_layer",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "safetensors.torch",
    "pyarrow",
    "yaml",
    "torch.utils.tensorboard",
    "math_verify",
    # the trainer's and the tools' own modules (about 140), so no child imports them either
    "bapo_megatron.trainer.main",
    "bapo_megatron.trainer.loop",
    "bapo_megatron.weights.convert_cli",
    "bapo_megatron.evaluation.cli",
)


def preload() -> None:
    import importlib
    import warnings

    from bapo_megatron.process.start import prepare_process

    prepare_process()  # before megatron's import, and inherited by every child
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time notices belong to the child that imports
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # absent, or broken beside this environment's torch: the child
                pass  # that needs it imports it and meets the error itself


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested command, run it, exit with its status."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("new_session"):
            os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        reseed_random_states()
        unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = stream(1, unbuffered)
        sys.stderr = stream(2, True)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [*extra, *[p for p in sys.path[1:] if p not in extra]]
        target = request["target"]
        if request["module"]:
            sys.path.insert(0, os.getcwd())
            sys.argv = [target, *request["args"]]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            sys.argv = [target, *request["args"]]
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        code = finish(code)
        os._exit(code)


def reseed_random_states() -> None:
    """What a new interpreter starts with: torch's thread count (set at import, before this
    child's environment existed) and random states drawn afresh, not the server's (Python's
    ``random`` reseeds itself after a fork; torch and numpy do not)."""
    import numpy
    import torch

    torch.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() else os.cpu_count())
    numpy.random.seed()


def stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, line_buffering=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=os.isatty(fd))


def exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def finish(code: int) -> int:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit handlers, flush
    the standard streams."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as stop:
        code = exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
    for handle in (sys.stdout, sys.stderr):
        try:
            handle.flush()
        except Exception:
            pass
    return code


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    stand_ins: dict[int, int] = {}  # pidfd of a stand-in -> the child it stands in for
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    try:
        while True:
            try:
                readable, _, _ = select.select([listener, wake_read, stdin, *stand_ins], [], [])
            except InterruptedError:
                continue
            if stdin in readable and not os.read(stdin, 4096):
                return
            if wake_read in readable:
                os.read(wake_read, 4096)
            reap(children)
            end_orphans(stand_ins, children, readable)
            if listener in readable:
                connection, _ = listener.accept()
                start(connection, children, stand_ins, [listener, wake_read, wake_write])
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(connection: socket.socket, children: dict, stand_ins: dict, inherited: list) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for handle in (*inherited, *children.values(), connection):
            handle.close() if hasattr(handle, "close") else os.close(handle)
        for handle in stand_ins:
            os.close(handle)
        os.close(0)  # the server's lifeline; the child gets its own standard input
        run_child(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = connection
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    if request.get("stand_in"):
        try:
            stand_ins[os.pidfd_open(request["stand_in"])] = pid
        except ProcessLookupError:
            os.kill(pid, signal.SIGKILL)  # gone already: nobody waits for this command


def end_orphans(stand_ins: dict, children: dict, readable: list) -> None:
    """SIGKILL the command of every stand-in (``fork_shim``) that has ended: a starter that
    SIGKILLs the stand-in, or its whole process tree, thus ends the command too, as it would a
    command of its own. Forget the stand-ins of commands that have ended."""
    for handle, pid in list(stand_ins.items()):
        if pid not in children:
            del stand_ins[handle]
            os.close(handle)
        elif handle in readable:
            del stand_ins[handle]
            os.close(handle)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
        except OSError:
            pass  # the client stopped listening: nothing to tell
        connection.close()


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
