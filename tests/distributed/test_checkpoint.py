"""Trainer checkpoints resume a run exactly, and refuse what they cannot resume.

The resume scenario (tests/distributed/checkpoint_worker.py): train 2 steps, save, train 2 more; a
second actor built from another seed loads the checkpoint and trains the same 2 steps. On the CPU
both continuations must agree bit for bit: every metric (loss, grad norm, lr of the warmup/cosine
schedule, bapo/*, skipped steps) and every parameter; the generators (torch, Python, NumPy,
Megatron's tracker) draw the same numbers after the load as after the save; ``trainer_state`` comes
back as saved. In one process with the plain and the distributed optimizer (fp32, and bf16 with the
distributed one), and in 2 gloo workers at TP2, PP2 and DP2 with the distributed optimizer (ranks
hold different trainer states). Also: a checkpoint of an untrained actor, the folder as a weights
checkpoint, keep_last and latest_checkpoint (staging folders ignored), and clear ValueErrors for
damaged, weights-only or foreign checkpoints and unsavable states.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from bapo_megatron.trainer.checkpoint import (
    RANK_FILE,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from bapo_megatron.weights.megatron_checkpoint import INFO_FILE, load_megatron_checkpoint
from tests.distributed.checkpoint_worker import (
    LAYOUTS,
    STEPS_BEFORE,
    build,
    model_config,
    optimizer_config,
    parameters,
    resume_run,
    train,
)
from tests.helpers import gloo_launch

WORKER = Path(__file__).with_name("checkpoint_worker.py")
LAUNCH_TIMEOUT_S = 300.0


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _equal(a, b) -> bool:
    """Deep equality of nested dicts/lists/tuples holding tensors (compared exactly)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def assert_resumed_exactly(result: dict, trainer_state: dict, what: str) -> None:
    assert result["initial_differs"], f"{what}: the second actor must start from other weights"
    assert result["step"] == STEPS_BEFORE
    assert len(result["continued"]) == len(result["resumed"]) == 2
    for index, (want, got) in enumerate(zip(result["continued"], result["resumed"])):
        assert set(got) == set(want)
        assert any(key.startswith("bapo/") for key in want)
        different = {key: (want[key], got[key]) for key in want if not _same(want[key], got[key])}
        assert not different, f"{what}: step {STEPS_BEFORE + index} metrics differ: {different}"
        assert want["skipped_steps"] == 1.0 and want["skipped"] == 0.0
    assert result["continued"][0]["lr"] != result["continued"][1]["lr"]  # the schedule moves
    assert not result["unequal_params"], f"{what}: parameters differ: {result['unequal_params']}"
    torch_draw, python_draw, numpy_draw, tracker_draw = result["draws_after_load"]
    saved = result["draws_after_save"]
    assert torch.equal(torch_draw, saved[0]) and python_draw == saved[1] and numpy_draw == saved[2]
    assert torch.equal(tracker_draw, saved[3])
    assert _equal(result["trainer_state"], trainer_state)


@pytest.mark.parametrize(
    ("dtype", "distributed", "family"),
    [
        ("float32", False, "llama"),
        ("float32", True, "llama"),
        ("bfloat16", True, "llama"),
        ("bfloat16", False, "llama"),
        # q/k/v biases and norm weights in one optimizer group: Megatron 0.16's distributed
        # optimizer misnumbered such a group's state when the two had different dtypes
        ("bfloat16", True, "qwen2"),
    ],
    ids=[
        "optimizer",
        "distributed-optimizer",
        "bf16-distributed-optimizer",
        "bf16-optimizer",
        "bf16-qwen2-distributed-optimizer",
    ],
)
def test_resume_in_one_process_continues_exactly(context, tmp_path, dtype, distributed, family):
    state = {
        "epoch": 3,
        "replay": [torch.arange(4.0), "prompt-17"],
        "cursor": {"file": "a", "line": 9},
    }
    model = dataclasses.replace(model_config(), params_dtype=dtype, model_type=family)
    result = resume_run(
        context, tmp_path / "run", state, optimizer=optimizer_config(distributed), model=model
    )
    assert_resumed_exactly(result, state, "one process")
    assert {INFO_FILE, RANK_FILE.format(rank=0), "metadata.json"} <= set(result["files"])
    assert result["folder"] == tmp_path / "run" / "step_00000002"


def test_checkpoint_of_an_untrained_actor_resumes(context, tmp_path):
    """Step 0, before the optimizer has any state: the load gives a fresh optimizer that steps
    exactly like the original's first step."""
    actor = build(context, seed=5)
    folder = save_checkpoint(tmp_path, 0, actor, {}, keep_last=1)
    want = train(actor, [0])
    resumed = build(context, seed=6)
    assert load_checkpoint(folder, resumed) == (0, {})
    assert train(resumed, [0]) == want
    assert _equal(parameters(resumed), parameters(actor))


def test_trainer_checkpoint_is_also_a_weights_checkpoint(context, tmp_path):
    actor = build(context, seed=5)
    train(actor, [0])
    folder = save_checkpoint(tmp_path, 1, actor, {}, keep_last=None)
    other = build(context, seed=6)
    load_megatron_checkpoint(other.chunks, model_config(), folder)
    assert _equal(parameters(other), parameters(actor))


def test_keep_last_and_latest_checkpoint(context, tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    actor = build(context, seed=5)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, actor, {"step": step}, keep_last=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]
    assert save_checkpoint(tmp_path, 4, actor, {}, keep_last=2) == tmp_path / "step_00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]

    # What a killed save leaves, and names that are not checkpoints, are ignored.
    (tmp_path / ".step_00000009.incomplete").mkdir()
    (tmp_path / ".step_00000009.incomplete" / "metadata.json").write_text("{}")
    (tmp_path / "step_00000010.txt").write_text("not a folder")
    (tmp_path / "step_x").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    # Steps are compared as numbers, past 8 digits too.
    save_checkpoint(tmp_path, 123_456_789, actor, {}, keep_last=1)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_123456789"
    assert not (tmp_path / "step_00000004").exists() and (tmp_path / "step_x").exists()
    assert load_checkpoint(latest_checkpoint(tmp_path), build(context, seed=6))[0] == 123_456_789

    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 5, actor, {}, keep_last=0)
    with pytest.raises(TypeError, match="trainer_state must be a dict"):
        save_checkpoint(tmp_path, 5, actor, [1], keep_last=None)
    with pytest.raises(ValueError, match="trainer_state of rank 0 cannot be saved"):
        save_checkpoint(tmp_path, 5, actor, {"callback": lambda: 0}, keep_last=None)
    assert not (tmp_path / "step_00000005").exists()
    assert not (tmp_path / ".step_00000005.incomplete").exists()  # a failed save cleans up


def _edit_json(folder: Path, edit) -> None:
    path = folder / INFO_FILE
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:50])


BROKEN = {  # name -> (what is done to a good checkpoint, what the error must say)
    "json deleted": (lambda f: (f / INFO_FILE).unlink(), "bapo_checkpoint.json does not exist"),
    "json truncated": (lambda f: _truncate(f / INFO_FILE), "malformed"),
    "weights only": (lambda f: _edit_json(f, lambda i: i.pop("trainer")), "weights-only"),
    "step missing": (
        lambda f: _edit_json(f, lambda i: i["trainer"].pop("step")),
        "malformed.*'step'",
    ),
    "newer format": (
        lambda f: _edit_json(f, lambda i: i["trainer"].update(format_version=9)),
        "trainer.format_version 9",
    ),
    "megatron metadata deleted": (lambda f: (f / "metadata.json").unlink(), "metadata"),
    "rank file deleted": (
        lambda f: (f / RANK_FILE.format(rank=0)).unlink(),
        "rank_00000.pt missing",
    ),
    "rank file truncated": (
        lambda f: _truncate(f / RANK_FILE.format(rank=0)),
        "rank_00000.pt cannot be read",
    ),
    "other world size": (
        lambda f: _edit_json(f, lambda i: i["trainer"].update(world_size=2)),
        "world size 2.*per-rank files",
    ),
    "other layout": (
        lambda f: _edit_json(
            f, lambda i: i["trainer"]["layout"].update(tensor_model_parallel_size=2)
        ),
        "parallel.tensor_model_parallel_size=2.*per-rank files",
    ),
    "other model": (
        lambda f: _edit_json(f, lambda i: i["model"].update(ffn_hidden_size=96)),
        "model.ffn_hidden_size is 96",
    ),
}


def test_broken_or_foreign_checkpoints_are_refused(context, tmp_path):
    actor = build(context, seed=5)
    train(actor, [0])
    good = save_checkpoint(tmp_path / "good", 1, actor, {"x": 1}, keep_last=None)
    before = parameters(actor)
    for name, (damage, message) in BROKEN.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, folder)
        damage(folder)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(folder, actor)
    # Refusals come before anything is loaded.
    assert all(torch.equal(before[k], p) for k, p in parameters(actor).items())

    # Another architecture, optimizer kind or schedule than the run's.
    other_model = build(
        context, seed=5, model=dataclasses.replace(model_config(), ffn_hidden_size=96)
    )
    with pytest.raises(ValueError, match="model.ffn_hidden_size is 64, but the model has 96"):
        load_checkpoint(good, other_model)
    with pytest.raises(ValueError, match="optimizer.use_distributed_optimizer=False"):
        load_checkpoint(good, build(context, seed=5, optimizer=optimizer_config(True)))
    with pytest.raises(ValueError, match=r"scheduler.max_lr.*optimizer.lr"):
        load_checkpoint(good, build(context, seed=5, optimizer=optimizer_config(lr=1e-3)))


@pytest.mark.multiprocess
def test_resume_in_two_processes_continues_exactly(tmp_path):
    results = gloo_launch.launch(WORKER, 2, tmp_path, ["--workdir", tmp_path], LAUNCH_TIMEOUT_S)
    for rank, result in enumerate(results):
        for layout in LAYOUTS:
            got = result[layout]
            assert_resumed_exactly(got, got["sent_state"], f"rank {rank} {layout} {got['ranks']}")
            assert got["trainer_state"]["rank"] == rank  # each rank gets its own back
            assert {RANK_FILE.format(rank=0), RANK_FILE.format(rank=1)} <= set(got["files"])
    for layout in LAYOUTS:  # every rank saw the same run
        assert results[0][layout]["continued"] == results[1][layout]["continued"]


class _CreatesFile:
    """Unpickling it opens (creates) ``marker``: what a crafted checkpoint file could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_loading_never_unpickles_objects_from_the_checkpoint(context, tmp_path):
    """Issue 20: a per-rank file (of the current format or of format 1) or Megatron's
    ``.metadata`` whose unpickling would run code is refused, naming the file, and the code
    does not run."""
    actor = build(context, seed=5)
    good = save_checkpoint(tmp_path / "good", 0, actor, {"x": 1}, keep_last=None)
    saved = torch.load(good / RANK_FILE.format(rank=0), weights_only=True)

    def crafted_rank_file(folder: Path, marker: Path) -> None:
        torch.save(
            dict(saved, trainer_state={"x": _CreatesFile(marker)}),
            folder / RANK_FILE.format(rank=0),
        )

    def format_1(folder: Path, marker: Path) -> None:
        crafted_rank_file(folder, marker)
        _edit_json(folder, lambda info: info["trainer"].update(format_version=1))

    def crafted_metadata(folder: Path, marker: Path) -> None:
        (folder / ".metadata").write_bytes(pickle.dumps(_CreatesFile(marker)))

    cases = {
        "rank file": (
            crafted_rank_file,
            (
                r"rank_00000\.pt cannot be read safely: it holds "
                r"pickled Python objects"
            ),
        ),
        "format 1": (
            format_1,
            (
                r"trainer\.format_version is 1, whose per-rank files "
                r".*rank_00000\.pt.*unpickling.*train\.load_checkpoint="
            ),
        ),
        "megatron metadata": (crafted_metadata, r"\.metadata is refused.*(builtins|io)\.open"),
    }
    for name, (craft, message) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(good, folder)
        marker = tmp_path / f"{folder.name}.marker"
        craft(folder, marker)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(folder, build(context, seed=6))
        assert not marker.exists(), f"{name}: loading ran code from the file"
    # The same .metadata check guards the weights-only load (evaluation, conversion,
    # train.load_checkpoint).
    marker = tmp_path / "weights.marker"
    crafted_metadata(tmp_path / "megatron-metadata", marker)
    with pytest.raises(ValueError, match=r"\.metadata is refused"):
        load_megatron_checkpoint(
            build(context, seed=6).chunks, model_config(), tmp_path / "megatron-metadata"
        )
    assert not marker.exists()


def test_trainer_state_must_be_plain_data(context, tmp_path):
    actor = build(context, seed=5)
    with pytest.raises(
        ValueError,
        match=r"trainer_state of rank 0 cannot be saved: "
        r"trainer_state\['replay'\]\[0\] is a PosixPath",
    ):
        save_checkpoint(tmp_path, 1, actor, {"replay": [Path("x")]}, keep_last=None)
    with pytest.raises(ValueError, match=r"trainer_state has the key \(1, 2\)"):
        save_checkpoint(tmp_path, 1, actor, {(1, 2): 0}, keep_last=None)
    assert not any(tmp_path.iterdir())
