"""Megatron's checkpoint writer hands its results through an in-process queue
(``bapo_megatron/megatron_patches/checkpoint_writer_queue.py``): saves write complete
checkpoints that convert back to the same weights, and start no process that stays (Megatron's
own first save starts a Manager server process that lives as long as the saving process). The
queue is reset first, so that the first save of this test creates it, whatever ran before."""

from __future__ import annotations

import queue

import psutil
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf
from tests.helpers import hf_models


def test_saves_use_an_in_process_queue_and_leave_no_process(tmp_path, context, monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    hf_models.save_hf_folder(tmp_path / "hf", "qwen2-tied", seed=5)
    hf_to_megatron(tmp_path / "hf", tmp_path / "first", context)
    assert type(filesystem_async._results_queue) is queue.Queue
    hf_to_megatron(tmp_path / "hf", tmp_path / "second", context)  # the queue serves again
    megatron_to_hf(tmp_path / "second", tmp_path / "back", context)
    original = hf_models.read_hf_tensors(tmp_path / "hf")
    back = hf_models.read_hf_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    left = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, left
