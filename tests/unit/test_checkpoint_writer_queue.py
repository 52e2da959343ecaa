"""Megatron's checkpoint writer hands its results through an in-process queue
(``bapo_megatron/megatron_patches/checkpoint_writer_queue.py``): saves write complete
checkpoints that convert back to the same weights, and no process is left behind (Megatron's
own first save starts a Manager server process that stays until the saving process ends).
Run in a fresh interpreter, so that no earlier save in this one decided the queue."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.train_runs import REPO_ROOT, subprocess_env

SCRIPT = textwrap.dedent(
    """
    import os, queue, sys
    from pathlib import Path
    import psutil, torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf
    from tests.helpers import hf_models

    work = Path(sys.argv[1])
    hf_models.save_hf_folder(work / "hf", "qwen2-tied", seed=5)
    context = ParallelContext.initialize(ParallelConfig())
    try:
        for name in ("first", "second"):  # the queue is reused by the next save
            hf_to_megatron(work / "hf", work / name, context)
            megatron_to_hf(work / name, work / (name + "-hf"), context)
    finally:
        context.teardown()
    original = hf_models.read_hf_tensors(work / "hf")
    for name in ("first-hf", "second-hf"):
        back = hf_models.read_hf_tensors(work / name)
        assert back.keys() == original.keys(), name
        assert all(torch.equal(back[k], original[k]) for k in original), name
    assert type(filesystem_async._results_queue) is queue.Queue, filesystem_async._results_queue
    left = [p.cmdline() for p in psutil.Process().children(recursive=True)]
    assert not left, left
    print("ok")
    """
)


def test_saves_use_an_in_process_queue_and_leave_no_process(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
