"""The fork server runs a test's command as a new interpreter would (tests/helpers/fork_server.py):
argv, environment, working directory, streams, exit status, atexit handlers, signals, timeouts,
and the random states a new interpreter starts with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import preloaded_processes

pytestmark = pytest.mark.skipif(
    preloaded_processes.fresh_processes_asked(),
    reason="BAPO_TEST_FRESH_PROCESSES=1: the fork server is switched off",
)

SCRIPT = """
import sys
PRELOADED = "torch" in sys.modules  # before any import of the script's own
import atexit, os, random
import numpy, torch
print("preloaded" if PRELOADED else "imported", flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
print(sys.argv[1:], os.getcwd(), os.environ.get("PROBE"), torch.get_num_threads(), __name__)
print(torch.rand(1).item(), numpy.random.rand(), random.random())
sys.stderr.write("to stderr\\n")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def fresh_env(env=None) -> dict:
    """``env`` without the fork server: ``subprocess`` then starts a new interpreter."""
    env = dict(os.environ if env is None else env)
    env.pop("BAPO_FORK_SERVER", None)
    return env


def run_both(command, env=None, **kwargs):
    forked = preloaded_processes.run(command, capture_output=True, text=True, env=env, **kwargs)
    fresh = subprocess.run(command, capture_output=True, text=True, env=fresh_env(env), **kwargs)
    return forked, fresh


def test_a_script_runs_as_in_a_new_interpreter(script, tmp_path):
    env = {**os.environ, "PROBE": "value", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), "3", "extra"]
    forked, fresh = run_both(command, cwd=tmp_path, env=env)
    assert forked.stdout.splitlines()[0] == "preloaded"
    assert fresh.stdout.splitlines()[0] == "imported"
    assert forked.returncode == fresh.returncode == 3
    assert forked.stderr == fresh.stderr == "to stderr\n"
    loaded, setting, draws, last = forked.stdout.splitlines()
    assert (loaded, last) == ("preloaded", "atexit ran")
    assert fresh.stdout.splitlines()[0] == "imported"
    # argv, working directory, environment, threads, __main__, and the end: atexit handlers
    assert [setting, last] == fresh.stdout.splitlines()[1::2]
    assert setting == f"['3', 'extra'] {tmp_path} value 1 __main__"
    again = preloaded_processes.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    # torch's, numpy's and Python's global random states are drawn afresh in every child, as in
    # every new interpreter, not inherited from the server
    assert all(a != b for a, b in zip(again.stdout.splitlines()[2].split(), draws.split()))


def test_a_module_runs_as_main(tmp_path):
    package = tmp_path / "probe_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:])\nraise SystemExit('refused: ' + sys.argv[1])\n"
    )
    forked, fresh = run_both([sys.executable, "-m", "probe_package", "x"], cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stdout == fresh.stdout == "__main__ ['x']\n"
    assert forked.stderr == fresh.stderr == "refused: x\n"


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text("raise ValueError('bad input')\n")
    forked, fresh = run_both([sys.executable, str(path)])
    assert forked.returncode == fresh.returncode == 1
    assert (
        forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == ("ValueError: bad input")
    )


def test_a_killed_child_reports_the_signal_and_a_timeout_raises(tmp_path):
    path = tmp_path / "waits.py"
    path.write_text("import sys, time\nprint('started', flush=True)\ntime.sleep(600)\n")
    process = preloaded_processes.popen(
        [sys.executable, "-u", str(path)], stdout=subprocess.PIPE, text=True
    )
    assert isinstance(process, preloaded_processes.ForkedProcess)
    assert process.stdout.readline() == "started\n"  # it runs: now the signal cannot come first
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    process.stdout.close()
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded_processes.run([sys.executable, str(path)], capture_output=True, timeout=0.5)


def test_commands_it_cannot_run_go_to_subprocess(monkeypatch):
    inline = preloaded_processes.popen([sys.executable, "-c", "pass"])
    assert isinstance(inline, subprocess.Popen)
    assert inline.wait() == 0
    monkeypatch.setenv("BAPO_TEST_FRESH_PROCESSES", "1")
    assert preloaded_processes.forkable([sys.executable, "-m", "json.tool"]) is None


def test_a_test_process_holding_over_1024_descriptors_can_wait(tmp_path):
    # the suite's process holds hundreds of gloo sockets by its end; select() refuses fds >= 1024
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (1200, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        done = preloaded_processes.run(
            [sys.executable, "-m", "json.tool", "--compact"],
            input='{"a": 1}',
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for fd in held:
            os.close(fd)
    assert (done.returncode, done.stdout) == (0, '{"a":1}\n')


STAND_IN_SCRIPT = """
import os, signal, sys, threading, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # before the line the test waits for
print("torch" in sys.modules, os.getpid(), threading.active_count(), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


@pytest.fixture
def stand_in_script(tmp_path):
    path = tmp_path / "stand_in.py"
    path.write_text(STAND_IN_SCRIPT)
    return path


def test_python_started_by_plain_subprocess_is_forked_through_its_stand_in(stand_in_script):
    # what torchrun, a shell script or a tool does: subprocess with this interpreter
    assert os.environ["BAPO_FORK_SERVER"]  # the conftest started the server
    done = subprocess.run([sys.executable, str(stand_in_script), "end"], capture_output=True)
    preloaded, pid, threads = done.stdout.split()
    # one thread, as in a new interpreter: a command may fork (tools/bench_weights.py does)
    assert (done.returncode, preloaded, threads) == (0, b"True", b"1")
    fresh = subprocess.run(
        [sys.executable, str(stand_in_script), "end"], capture_output=True, env=fresh_env()
    )
    assert fresh.stdout.split()[0] == b"False"


def test_a_stand_in_passes_signals_on_and_its_death_ends_the_command(stand_in_script):
    command = [sys.executable, "-u", str(stand_in_script), "wait"]
    stand_in = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    preloaded, pid, _ = stand_in.stdout.readline().split()
    assert preloaded == "True" and int(pid) != stand_in.pid  # the command runs in the fork
    stand_in.terminate()  # passed on: the command's handler exits 7, and so does the stand-in
    assert stand_in.wait(timeout=120) == 7
    stand_in.stdout.close()

    stand_in = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    _, pid, _ = stand_in.stdout.readline().split()
    stand_in.kill()  # cannot be passed on: the fork sees its stand-in gone and ends itself
    assert stand_in.wait(timeout=120) == -signal.SIGKILL
    stand_in.stdout.close()
    deadline = time.monotonic() + 120
    while os.path.exists(f"/proc/{pid}") and not is_zombie(int(pid)):
        assert time.monotonic() < deadline, "the forked command outlived its stand-in"
        time.sleep(0.05)


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
