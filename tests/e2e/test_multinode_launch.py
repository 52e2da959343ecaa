"""The launch scripts of a disaggregated run, run for real on this machine:

- ``examples/tiny_cpu/torchrun_async.sh`` (one torchrun, 1 trainer + 1 engine process), at its
  own eta (4 with the example's 4 mini-batches: one rollout step ahead), checked by its
  admission and staleness metrics;
- ``examples/launch/torchrun_multinode.sh`` started twice, as on two nodes: two torchrun agents
  meeting in a c10d rendezvous on 127.0.0.1, node 0 with one trainer process and node 1 (the
  engine node, ``ENGINE_NODES=1``) with one engine process, which is killed once after a
  checkpoint (both nodes restart their workers in place); synchronous
  (``algorithm.max_staleness=0``, :data:`STALENESS`), so its metrics must be bitwise those of the
  colocated run in one process with the same seeds (the check of the synchronous disaggregated
  loop with one trainer rank and one engine rank: test_train_disaggregated.py runs it with
  parallel trainers).

Every process the test starts, and everything below it, is killed when the test ends, however
it ends."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.fault_rewards import KILL_AFTER, KILL_MARK, KILL_WORKER
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import (
    FAST,
    assert_same_run,
    read_metrics,
    subprocess_env,
)

pytestmark = [
    pytest.mark.multiprocess,
]
ASYNC_SCRIPT = REPO_ROOT / "examples" / "tiny_cpu" / "torchrun_async.sh"
MULTINODE_SCRIPT = REPO_ROOT / "examples" / "launch" / "torchrun_multinode.sh"
TINY_CONFIG = "examples/tiny_cpu/train.yaml"
STEPS = ["train.steps=3"]  # as the one-process run (conftest.colocated_three_steps)
# the two-agent run: synchronous, so that it can be compared bitwise
STALENESS = ["algorithm.max_staleness=0"]
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
TIMEOUT_S = 900


@pytest.fixture
def colocated(colocated_three_steps):
    """The colocated synchronous run in one process (trainer TP1, PP1), of STEPS; shared with
    the other files that compare with it."""
    return colocated_three_steps


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port for node 0's rendezvous store that nothing else can take while the test runs.

    The socket is bound (the system picks the port) with ``SO_REUSEADDR`` but never listens:
    Linux then refuses the port to every other bind, explicit or automatic, except one that also
    sets ``SO_REUSEADDR`` and listens, as the store's ``TCPStore`` does. A port merely found free
    and released could be taken before torchrun binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` from the repository root, output into ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**subprocess_env(), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_all(processes: list[subprocess.Popen], timeout: float) -> list[int]:
    """The exit codes of ``processes``. Whatever of them is left when they have ended or the
    time is up is killed with all its descendants (torchrun starts each worker in a session of
    its own, so killing the agent's process group would not reach them)."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0)) for p in processes]
    finally:
        for p in processes:
            kill_tree(p)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process below it, then reap it."""
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(process.pid)
        for member in [*tree.children(recursive=True), tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
    process.wait()


def logs(paths: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in paths)


def test_async_example_script_runs_one_trainer_and_one_engine(tmp_path, warm_start):
    output, log = tmp_path / "run", tmp_path / "torchrun.log"
    # the example's own 4 mini-batches per rollout step (FAST runs 2), as its eta is set for
    overrides = [
        *FAST,
        "algorithm.optimizer_steps_per_rollout=4",
        *warm_start[0],
        *STEPS,
        f"train.output_dir={output}",
    ]
    process = start(["bash", str(ASYNC_SCRIPT), *overrides], log, {})
    assert wait_all([process], TIMEOUT_S) == [0], logs([log])
    assert "engine stopped by its trainer" in log.read_text()
    records = read_metrics(output)
    rollouts = [r for r in records if "async/queued_items" in r]
    assert [r["rollout_step"] for r in rollouts] == [1, 2, 3]
    assert rollouts[0]["async/queued_items"] == 2  # eta 4 = one rollout step of 4 versions ahead
    # eta, plus the 3 later mini-batches of the step (counted from the step's first version)
    assert max(r["staleness/max"] for r in records if "staleness/max" in r) <= 7


def test_two_agents_one_trainer_node_one_engine_node(tmp_path, warm_start, colocated):
    """The engine rank is killed once checkpoint 1 exists (:func:`kills_a_rank_once`, in the
    next reward phase): both nodes restart their workers in place (``MAX_RESTARTS=1``), the
    trainer resumes from its checkpoint and the engine rank starts anew, and the run ends as
    the uninterrupted one."""
    output = tmp_path / "run"
    overrides = [
        *FAST,
        *warm_start[0],
        *STEPS,
        *DISAGGREGATED,
        *STALENESS,
        f"train.output_dir={output}",
        "checkpoint.interval=1",
        "reward.name=tests.helpers.fault_rewards:kills_a_rank_once",
    ]
    mark = tmp_path / "killed"
    node_logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    with reserved_port() as port:
        shape = {
            "NNODES": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GPUS_PER_NODE": "1",
            "ENGINE_NODES": "1",
            "ENGINE_RANKS_PER_NODE": "1",
            "OMP_NUM_THREADS": "1",
            "MAX_RESTARTS": "1",
            KILL_WORKER: "1 0",  # node 1's worker: the engine rank
            KILL_AFTER: str(output / "checkpoints" / "step_00000001"),
            KILL_MARK: str(mark),
        }
        # node 1 first: its agent waits for node 0's store, as a node that boots early does
        agents = [
            start(
                ["bash", str(MULTINODE_SCRIPT), TINY_CONFIG, *overrides],
                node_logs[rank],
                {**shape, "NODE_RANK": str(rank)},
            )
            for rank in (1, 0)
        ]
        codes = wait_all(agents, TIMEOUT_S)
    assert codes == [0, 0], logs(node_logs)
    assert mark.exists()  # the engine rank was killed
    trainer_log, engine_log = (path.read_text() for path in node_logs)
    # global rank 1, on node 1, ran the engine; rank 0, on node 0, trained
    assert "engine replica 0 (rank 1) answered" in engine_log, logs(node_logs)
    assert "answered" not in trainer_log  # (it names the engine rank it lost, though)
    # node 1's worker failed: its restart 1; node 0's was restarted with it
    assert "engine rank 1: torchrun restart count 1 (TORCHELASTIC_RESTART_COUNT): engine " in (
        engine_log
    ), logs(node_logs)
    resumed = re.findall(
        r"rank 0: torchrun restart count \d \(\S+\): resumed from (\S+)", trainer_log
    )
    assert len(resumed) == 1 and Path(resumed[0]).name >= "step_00000001", logs(node_logs)
    assert_same_run(read_metrics(output), colocated, rollout_steps=3, updates=6, bitwise=True)
