"""Qwen3-MoE HF <-> Megatron: transformers' logits, and round trips that are bitwise at every
expert layout.

The parent saves a tiny random transformers ``Qwen3MoeForCausalLM`` (4 layers, the first dense,
4 experts, top-2, per-expert tensor names on disk) and, in one process, converts it and
compares the whole-vocabulary logits with transformers' and the folder written back with the
original, tensor by tensor and bitwise. Two gloo workers then, at EP2 (experts divided over the
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

import os
import sys

if __name__ == "__main__":  # a worker: pin thread pools before torch loads
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bapo_megatron.actor.batch import PolicyBatch  # noqa: E402
from bapo_megatron.actor.logprobs import compute_logprobs  # noqa: E402
from bapo_megatron.actor.microbatches import Batching  # noqa: E402
from bapo_megatron.config import ParallelConfig  # noqa: E402
from bapo_megatron.distributed.context import ParallelContext  # noqa: E402
from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf  # noqa: E402
from bapo_megatron.weights.export import export_weights  # noqa: E402
from tests.e2e.test_train_disaggregated import finish  # noqa: E402
from tests.helpers import gloo_launch, hf_models  # noqa: E402
from tests.helpers.gloo_launch import REPO_ROOT  # noqa: E402
from tests.helpers.train_runs import start_ranks  # noqa: E402

SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {  # ep2 first: the others load its checkpoint
    "ep2": ParallelConfig(expert_model_parallel_size=2),
    "tp2-sp-ep2": ParallelConfig(**SP, expert_model_parallel_size=2),
    "tp2-sp": ParallelConfig(**SP),
    "tp2-sp-etp2": ParallelConfig(**SP, expert_tensor_parallel_size=2),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
}
LAUNCH_TIMEOUT_S = 300.0


def token_batch() -> PolicyBatch:
    ids, _ = hf_models.tokens()
    return PolicyBatch(tokens=ids, response_mask=torch.zeros_like(ids, dtype=torch.bool))


def reference_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probs and entropy [b, s] from transformers' logits (column 0: 0)."""
    ids, _ = hf_models.tokens()
    logp = torch.log_softmax(logits.double(), dim=-1)
    chosen = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(ids.shape[0], 1, dtype=torch.float64)
    return torch.cat([zero, chosen], 1).float(), torch.cat([zero, entropy], 1).float()


def engine_view(chunks, model, context, placement: str) -> dict[str, torch.Tensor] | None:
    """What the weight sync hands an engine from this rank, exporting as it does
    (``weights/sync.py``): colocated, every rank with all experts, each replica's tensor rank 0
    the engine's side; disaggregated, replica 0's dense tensors and the experts of expert
    data-parallel rank 0, replica 0's tensor rank 0 the sender. None on the other ranks."""
    disaggregated = placement == "disaggregated"
    dense = context.dp_rank == 0 if disaggregated else True
    experts = context.edp_rank == 0 if disaggregated else True
    buckets = export_weights(
        chunks, model, context, version=0, dense=dense, experts=experts, all_experts=True
    )
    tensors = {n: t.clone() for bucket in buckets for n, t in bucket.tensors.items()}
    sender = context.tp_rank == 0 and (context.dp_rank == 0 or not disaggregated)
    return tensors if sender else None


def worker(args) -> None:
    gloo_launch.join_group(args, timeout_s=120)
    work = Path(args.workdir)
    results = {}
    for name, layout in LAYOUTS.items():
        context = ParallelContext.initialize(layout)
        model, chunks = hf_to_megatron(work / "hf", work / f"ckpt-{name}", context)
        results["logprobs", name] = compute_logprobs(
            chunks, token_batch(), context, batching=Batching(2), temperature=1.0
        )
        if name == "ep2":  # what the live export yields on each rank
            results["export"] = [
                (bucket.expert_rank, sorted(bucket.tensors))
                for bucket in export_weights(
                    chunks, model, context, version=0, dense=context.dp_rank == 0
                )
            ]
        for placement in ("colocated", "disaggregated"):
            results["engine", name, placement] = engine_view(chunks, model, context, placement)
        megatron_to_hf(work / f"ckpt-{name}", work / f"hf-{name}", context)
        if name != "ep2":
            megatron_to_hf(work / "ckpt-ep2", work / f"hf-{name}-from-ep2", context)
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


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
    results = gloo_launch.launch(__file__, 2, tmp_path, ["--workdir", tmp_path], LAUNCH_TIMEOUT_S)
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


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], workdir=str))
