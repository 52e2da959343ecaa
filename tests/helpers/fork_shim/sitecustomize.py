"""Start-up hook of the Python processes that the suite's processes start themselves (torchrun's
agent and workers, the sweep's runs, the device check's and the benchmarks' processes): when
``BAPO_FORK_SERVER`` names the session's fork server (``tests/helpers/fork_server.py``) and the
command is one it can run (``python [-u] -m module ...`` or ``python [-u] file ...`` on the
server's interpreter), this process has the server fork the command for it, with this process's
environment, working directory and standard streams, and stands in for it: signals it gets are
passed on, and it ends with the command's exit status (or its signal). If it dies first (a
SIGKILL), the server kills the forked command (``fork_server.end_orphans``). Anything else runs
as usual. The conftest puts this folder on ``PYTHONPATH`` for the whole session.

Only the standard library, nothing heavy: this runs before every such interpreter's main code.
"""

import os
import sys


def _command():
    """``(is_module, target, args, unbuffered)`` from the interpreter's own argv, or None."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    unbuffered = False
    if argv[:1] == ["-u"]:
        unbuffered, argv = True, argv[1:]
    if len(argv) > 1 and argv[0] == "-m":
        return True, argv[1], argv[2:], unbuffered
    if argv and not argv[0].startswith("-") and os.path.isfile(argv[0]):
        return False, argv[0], argv[1:], unbuffered
    return None


def _stand_in():
    address = os.environ.get("BAPO_FORK_SERVER")
    if not address or os.environ.get("BAPO_TEST_FRESH_PROCESSES") == "1":
        return
    if os.path.realpath(sys.executable) != os.environ.get("BAPO_FORK_SERVER_PYTHON"):
        return
    command = _command()
    if command is None:
        return
    import json
    import signal
    import socket

    is_module, target, args, unbuffered = command
    request = {
        "module": is_module,
        "target": target,
        "args": args,
        "unbuffered": unbuffered,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "new_session": False,
        "stand_in": os.getpid(),
    }
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
        reader = connection.makefile("rb")
        child = json.loads(reader.readline())["pid"]
    except (OSError, ValueError, KeyError):
        connection.close()
        return  # no server (the session is ending): run here, as usual

    def pass_on(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, pass_on)
    line = reader.readline()
    code = json.loads(line)["returncode"] if line else -signal.SIGKILL
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


_stand_in()
