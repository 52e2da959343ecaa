"""Qwen3-MoE HF <-> Megatron: transformers' logits, and round trips that are bitwise at every
expert layout.

The parent saves a tiny random transformers ``Qwen3MoeForCausalLM`` (4 layers, the first dense,
4 experts, top-2, per-expert tensor names on disk) and, in one process, converts it and
compares the whole-vocabulary logits with transformers' and the folder written back with the
original, tensor by tensor and bitwise. Two gloo workers
(tests/distributed/moe_weights_layouts_worker.py) then, at EP2 (experts divided over the
data-parallel ranks), TP2 with sequence parallelism and EP2, TP2 with sequence parallelism
(every rank holds every expert), TP2 with sequence parallelism and expert tensor parallel 2
(each expert split over the ranks) and PP2:

- convert the HF folder at that layout: token log-probs and entropy through the pipeline equal
  transformers' (from its logits, so the whole distribution is compared);
- convert the checkpoint back to HF (each expert-parallel rank writes the experts it holds,
  gathered over the expert tensor-parallel group):
  bitwise the original folder's tensors; at EP2 the live export yields each rank's own experts;
- load the checkpoint saved at EP2 at that layout (Megatron resharding on load) and write it
  as HF: bitwise again;
- export as the weight sync does, colocated and disaggregated (experts gathered over the
  expert-parallel group, also across replicas and with expert tensor parallelism): each
  engine's stream holds the whole model, bitwise.

The command line (tools/convert_checkpoint.py) converts the folder on 4 processes started as
torchrun starts them at TP2 x PP2 x EP2 (no sequence parallelism asked for), and back in one
process (the checkpoint resharded on load): bitwise the original.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf
from tests.distributed.moe_weights_layouts_worker import LAYOUTS
from tests.e2e.test_train_disaggregated import finish
from tests.helpers import gloo_launch, hf_models
from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import start_ranks

WORKER = Path(__file__).with_name("moe_weights_layouts_worker.py")
LAUNCH_TIMEOUT_S = 300.0


def reference_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probs and entropy [b, s] from transformers' logits (column 0: 0)."""
    ids, _ = hf_models.tokens()
    logp = torch.log_softmax(logits.double(), dim=-1)
    chosen = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(ids.shape[0], 1, dtype=torch.float64)
    return torch.cat([zero, chosen], 1).float(), torch.cat([zero, entropy], 1).float()


def assert_same_tensors(folder: Path, want: dict[str, torch.Tensor]) -> None:
    got = hf_models.read_hf_tensors(folder)
    assert sorted(got) == sorted(want), folder
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{folder}: {key}"


@pytest.mark.multiprocess
def test_qwen3_moe_converts_at_every_expert_layout(tmp_path, single_process):
    hf = hf_models.save_hf_moe_folder(tmp_path / "hf", seed=3)
    original = hf_models.read_hf_tensors(tmp_path / "hf")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in original  # per-expert on disk
    want_logits = hf_models.hf_logits(hf)

    # one process: the whole logits, and the round trip
    _, [chunk] = hf_to_megatron(tmp_path / "hf", tmp_path / "ckpt-1", single_process)
    ids, positions = hf_models.tokens()
    with torch.no_grad():
        logits = chunk(ids, positions, None)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
    megatron_to_hf(tmp_path / "ckpt-1", tmp_path / "hf-1", single_process)
    assert_same_tensors(tmp_path / "hf-1", original)

    want_logprobs, want_entropy = reference_logprobs(want_logits)
    results = gloo_launch.launch(WORKER, 2, tmp_path, ["--workdir", tmp_path], LAUNCH_TIMEOUT_S)
    for rank, result in enumerate(results):
        for name in LAYOUTS:
            logprobs, entropy = result["logprobs", name]
            what = f"rank {rank} {name}"
            torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5, msg=what)
            torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5, msg=what)
    for name in LAYOUTS:
        assert_same_tensors(tmp_path / f"hf-{name}", original)
        if name != "ep2":
            assert_same_tensors(tmp_path / f"hf-{name}-from-ep2", original)
    # the weight sync's view: each engine (colocated: every replica's; disaggregated: the one
    # stream of replica 0) gets every tensor of the model, bitwise, whichever rank held it
    for name in LAYOUTS:
        for placement in ("colocated", "disaggregated"):
            views = [r["engine", name, placement] for r in results]
            if name == "pp2":  # one sender per stage: together the whole model, once
                assert None not in views
                assert not set(views[0]) & set(views[1])
                views = [{**views[0], **views[1]}]
            views = [view for view in views if view is not None]
            replicas = 2 if name == "ep2" and placement == "colocated" else 1
            assert len(views) == replicas, (name, placement)
            for view in views:
                assert sorted(view) == sorted(original), (name, placement)
                for key, value in original.items():
                    assert torch.equal(view[key], value), (name, placement, key)
    # at EP2 (dense tensors asked of data-parallel rank 0 only) the live export yields on each
    # rank the experts it holds, tagged with its expert-parallel rank
    for rank, result in enumerate(results):
        dense = [name for expert, names in result["export"] if expert is None for name in names]
        experts = {
            name.split(".")[5]
            for expert, names in result["export"]
            if expert is not None
            for name in names
        }
        assert {expert for expert, _ in result["export"]} - {None} == {rank}
        assert experts == ({"0", "1"} if rank == 0 else {"2", "3"})
        assert bool(dense) == (rank == 0)


@pytest.mark.multiprocess
def test_command_line_converts_at_tp2_pp2_ep2_and_back(tmp_path, capsys):
    from bapo_megatron.weights import convert_cli

    hf_models.save_hf_moe_folder(tmp_path / "hf", seed=5)
    hf, ckpt, back = (str(tmp_path / name) for name in ("hf", "ckpt", "back"))
    tool = [sys.executable, str(REPO_ROOT / "tools" / "convert_checkpoint.py")]
    layout = ["--tp", "2", "--pp", "2", "--ep", "2"]  # no sequence parallelism asked for
    ranks = start_ranks([*tool, "hf-to-megatron", hf, ckpt, *layout, "--no-progress"], 4)
    outputs = finish(ranks, LAUNCH_TIMEOUT_S)
    assert [r.returncode for r in ranks] == [0] * 4, "\n".join(o[-3000:] for o in outputs)
    assert (  # rank 0 says what it wrote
        f"wrote Megatron checkpoint {ckpt} (qwen3_moe, 4 layers, float32) at TP2/PP2/EP2/ETP1"
    ) in outputs[0]
    # back in this process (a fifth interpreter start would cost more than the conversion)
    convert_cli.main(["megatron-to-hf", ckpt, back, "--no-progress"])
    assert f"wrote HF folder {back} from {ckpt} at TP1/PP1" in capsys.readouterr().out
    assert_same_tensors(tmp_path / "back", hf_models.read_hf_tensors(tmp_path / "hf"))
