"""Faults a hostile user (or an unlucky cluster) brings, injected into real training runs: each
run either goes on, counting what it lost, or stops within a bounded time with an error naming
who or what failed. (The pool-level and data-level cases are in tests/unit: test_rewards.py,
test_prompts.py, test_folder_lock.py, test_folder_manifest.py, test_phase_watchdog.py.)"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import preloaded_processes
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import (
    Ranks,
    rollout_records,
    run_in_process,
    subprocess_env,
    training_command,
)

STEPS = ["train.steps=2"]


def _sum(records, key):
    return sum(r.get(key, 0.0) for r in rollout_records(records))


# ------------------------------------------------------------------------- rewards


def test_reward_workers_that_die_are_replaced_and_counted(tmp_path, warm_start):
    records = run_in_process(
        tmp_path, *warm_start[0], *STEPS, "reward.name=tests.helpers.fault_rewards:dies_sometimes"
    )
    assert len(rollout_records(records)) == 2  # the run went on
    assert _sum(records, "reward/errors") > 0  # each lost check is counted


def test_the_reward_phase_is_bounded_per_batch(tmp_path, warm_start):
    records = run_in_process(
        tmp_path,
        *warm_start[0],
        *STEPS,
        "reward.name=tests.helpers.fault_rewards:hangs_sometimes",
        "reward.timeout_s=3600",
        "reward.batch_timeout_s=0.5",  # the bound, not the hung checks (an hour), ends it
    )
    assert len(rollout_records(records)) == 2
    assert _sum(records, "reward/timeouts") > 0


# ------------------------------------------------------------------------- a frozen rank


def test_a_frozen_rank_stops_the_run_naming_it(tmp_path, warm_start):
    """Data-parallel rank 1 freezes (SIGSTOP) in its reward phase; rank 0 waits in the next
    collective until its parallel.collective_timeout_s and stops with an error saying which rank
    has not reached which phase.

    The deadline also bounds the start-up collectives, so a short one must not meet a rank that
    is still starting: rank 1 starts first, with the default deadline (it is the frozen one:
    its own deadline never ends the run), and rank 0 only once rank 1 waits for it in the
    rendezvous (rank 1's keys are in the store), so rank 0 never waits for rank 1's imports.
    From the rendezvous on, the two ranks do the same start-up work and rank 0 the little that
    rank 0 alone does, so rank 0's deadline of 10 s only has to outlast the drift of two equal
    processes between two collectives (under 0.3 s when measured: the run passed with 0.3 s);
    the wait for the frozen rank is then 10 s, not the 45 s a deadline covering the imports'
    skew needed."""
    common = [
        *warm_start[0],
        *STEPS,
        "reward.name=tests.helpers.fault_rewards:freezes_rank_1",
        "parallel.stall_report_s=2",
        "rollout.prompts_per_step=4",
    ]
    ranks = Ranks.serving()
    try:
        frozen = ranks.start(training_command(tmp_path, *common), 1, 2)
        deadline = time.monotonic() + 300
        while ranks.store.num_keys() == 0:  # rank 1 has not reached the rendezvous yet
            assert frozen.poll() is None, frozen.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "rank 1 did not reach the rendezvous in 300 s"
            time.sleep(0.05)
        waiting = ranks.start(
            training_command(tmp_path, *common, "parallel.collective_timeout_s=10"), 0, 2
        )
        output, _ = waiting.communicate(timeout=300)
    finally:
        for process in ranks:  # rank 1 is stopped: only SIGKILL ends it
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
            process.wait()
    assert waiting.returncode != 0
    assert "where the ranks are: rank 0 in 'rollout step 0: 3. off-policy selection'" in output, (
        output[-4000:]
    )
    assert (
        "rank 1 has not reached 'rollout step 0: 3. off-policy selection': it is in "
        "'rollout step 0: 2. reward'" in output
    ), output[-4000:]


# ------------------------------------------------------------------------- start-up


def test_a_rank_that_never_starts_ends_the_start_up_naming_it(tmp_path):
    """A world of 2 whose rank 1 never starts: rank 0 stops at its start-up deadline (3 s, not
    the collective timeout's 15 min), naming the rendezvous store and the missing rank."""
    ranks = Ranks.serving()
    try:
        alone = ranks.start(
            training_command(tmp_path, "parallel.startup_timeout_s=3", "train.steps=1"), 0, 2
        )
        output, _ = alone.communicate(timeout=300)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert alone.returncode == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert output.strip().splitlines()[-1] == (
        "rank 0: error: the ranks of torchrun attempt 0 did not all reach the rendezvous at "
        f"127.0.0.1:{ranks.store.port} within parallel.startup_timeout_s=3: rank(s) 1 of 2 did "
        "not arrive (a peer that never started or died while starting, or a node of another "
        "attempt)"
    ), output[-4000:]


# ------------------------------------------------------------------------- output folders


def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom bapo_megatron.files.lock import FolderLock\n"
            "FolderLock(sys.argv[1], 'training run').acquire()\nprint('held', flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(
            ValueError,
            match=rf"train.output_dir {tmp_path}: rank 0: {tmp_path} is "
            rf"in use by another process \(PID {holder.pid} on host ",
        ):
            run_in_process(tmp_path, "train.steps=1")
    finally:
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()
    assert not (tmp_path / "checkpoints").exists()  # nothing was written beside the holder's


def test_a_fresh_start_never_resumes_an_older_runs_checkpoint(tmp_path, warm_start):
    """The reproduction of the report: steps=4 writes step_2 and step_4; a fresh start with
    another seed writes step_2; resuming must continue the new run, not the old step_4."""
    common = [*warm_start[0], "checkpoint.interval=2", "checkpoint.keep_last=null"]
    run_in_process(tmp_path, *common, "train.steps=4")
    run_in_process(tmp_path, *common, "checkpoint.resume=false", "actor.seed=7", "train.steps=2")
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.replaced-")]
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    records = run_in_process(tmp_path, *common, "actor.seed=7", "train.steps=3")
    assert [r["rollout_step"] for r in rollout_records(records)] == [1, 2, 3]
    # a resume by a run with other identifying settings is refused, naming them
    with pytest.raises(
        ValueError,
        match=r"belongs to another run: it was saved with "
        r"actor.seed=7 \(this run: 1\)",
    ):
        run_in_process(tmp_path, *common, "train.steps=4")


# ------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, warm_start):
    folder = tmp_path_factory.mktemp("two_checkpoints")
    run_in_process(folder, *warm_start[0], "checkpoint.interval=1", "train.steps=2")
    return folder


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda step: _truncate(next(step.glob("*.distcp"))), ".distcp is "),
        (lambda step: (step / "metadata.json").write_text("{garbage"), "metadata.json"),
        (lambda step: _truncate(step / "common.pt"), "common.pt is "),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path, warm_start, two_checkpoints, caplog, damage, named
):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    damage(run / "checkpoints" / "step_00000002")
    with caplog.at_level(logging.WARNING):
        records = run_in_process(run, *warm_start[0], "checkpoint.interval=1", "train.steps=3")
    # resumed from step 1: steps 2 and 3 were trained again, and the skip was said
    assert [r["rollout_step"] for r in rollout_records(records)][-2:] == [2, 3]
    skipped = [m for m in caplog.messages if m.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and named in skipped[0], skipped


# ------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "override, message, as_command",
    [
        # the command a user runs: exit code 1, the line last on stderr, no traceback (this
        # error comes after the process group is set up)
        pytest.param(
            "parallel.tensor_model_parallel_size=4",
            "error: world size 1 is not divisible",
            True,
            id="layout-command",
        ),
        # errors the preflight finds before anything is set up: the same entry point in this
        # process (the line is the SystemExit message the interpreter prints, exit code 1)
        pytest.param(
            "reward.name=no_such_reward",
            "error: unknown reward 'no_such_reward'",
            False,
            id="reward",
        ),
        pytest.param(
            "train.output_dir={file}/run",
            "error: train.output_dir {file}/run: {file} is not a folder",
            False,
            id="output-dir",
        ),
    ],
)
def test_user_errors_are_one_line(tmp_path, override, message, as_command):
    file = tmp_path / "a_file"
    file.write_text("")
    command = [*training_command(tmp_path / "out"), override.format(file=file)]
    message = message.format(file=file)
    if not as_command:
        from bapo_megatron.trainer.main import main

        with pytest.raises(SystemExit) as exited:  # any other exception: a traceback
            main(command[3:])  # after `python -m bapo_megatron.train`
        assert isinstance(exited.value.code, str)
        assert exited.value.code.splitlines()[-1].startswith(message), exited.value.code
        return
    result = preloaded_processes.run(
        command,
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)
