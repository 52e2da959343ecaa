"""Vocab-parallel log-probs and entropy over real processes against a float64 single-process
computation (one process: test_vocab_parallel.py).

2 and 4 gloo workers (this file re-run as a script, one launch per world size
running every case) each hold a vocabulary shard (even, uneven such as 10 = 3+3+2+2, one with an
empty shard, padded) of the same logits; their outputs and their local logits gradients,
concatenated along the vocabulary, must equal the single-process ones. The workers also count
collectives: two all-reduces in forward, none in backward, none with a group of one.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: pin thread pools before torch loads
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bapo_megatron.algo.vocab_parallel import token_logprobs_and_entropy
from tests.helpers import gloo_launch
from tests.helpers.logprob_reference import (
    DTYPES,
    assert_close,
    ours_with_grad,
    random_inputs,
    reference_with_grad,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int  # full (padded) width of the logits
    layout: str  # even | split (array_split: 10 over 4 -> 3,3,2,2) | empty-shard
    temperature: float = 1.0
    dtype: str = "float64"
    vocab_size: int | None = None
    with_entropy: bool = True
    seed: int = 0


CASES = [
    Case("even-t1", 24, "even", 1.0, seed=11),
    Case("even-t0.6", 24, "even", 0.6, seed=12),
    Case("even-t1.3", 24, "even", 1.3, seed=13),
    Case("split-10", 10, "split", 1.0, seed=14),
    Case("split-10-t0.6", 10, "split", 0.6, seed=15),
    Case("split-13-t1.3", 13, "split", 1.3, seed=16),
    Case("empty-shard", 13, "empty-shard", 0.7, seed=17),
    Case("padded", 16, "even", 1.3, vocab_size=11, seed=18),
    Case("no-entropy", 13, "split", 0.6, with_entropy=False, seed=19),
    Case("float32", 24, "split", 0.6, dtype="float32", seed=20),
    Case("bfloat16", 24, "split", 1.0, dtype="bfloat16", seed=21),
]
SHAPE = (3, 5)


def shard_bounds(vocab: int, layout: str, world_size: int) -> list[int]:
    if layout == "even":
        assert vocab % world_size == 0
        return [vocab * r // world_size for r in range(world_size + 1)]
    if layout == "split":
        widths = [len(c) for c in torch.arange(vocab).tensor_split(world_size)]
        return [sum(widths[:r]) for r in range(world_size + 1)]
    return [0, 0, vocab] if world_size == 2 else [0, 4, 4, 7, vocab]  # rank 1 / 0 empty


def case_inputs(case: Case, world_size: int) -> dict:
    logits, targets, w_logp, w_ent = random_inputs(
        case.seed, SHAPE, case.vocab, target_limit=case.vocab_size
    )
    bounds = shard_bounds(case.vocab, case.layout, world_size)
    flat = targets.view(-1)  # some targets on the first and last column of every shard
    edges = [b for lo, hi in zip(bounds, bounds[1:]) if hi > lo for b in (lo, hi - 1)]
    edges = [b for b in edges if case.vocab_size is None or b < case.vocab_size]
    flat[: len(edges)] = torch.tensor(edges)
    return {
        "logits": logits.to(DTYPES[case.dtype]),
        "targets": targets,
        "w_logp": w_logp,
        "w_ent": w_ent if case.with_entropy else None,
        "bounds": bounds,
    }


class CollectiveCounter:
    """Counts ``dist`` collectives (and forbids gathers) while installed."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "reduce_scatter_tensor",
        "all_to_all_single",
    )

    def __init__(self):
        self.calls: list[str] = []
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return self.saved[name](*args, **kwargs)

        return counted

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def rank_part(case: Case, data: dict, rank: int, group, counter: CollectiveCounter) -> dict:
    lo, hi = data["bounds"][rank], data["bounds"][rank + 1]
    x = data["logits"][..., lo:hi].clone().requires_grad_(True)
    counter.take()
    logp, ent = token_logprobs_and_entropy(
        x,
        data["targets"],
        vocab_start=lo,
        group=group,
        temperature=case.temperature,
        vocab_size=case.vocab_size,
        with_entropy=case.with_entropy,
    )
    forward_calls = counter.take()
    loss = (logp * data["w_logp"].to(logp.dtype)).sum()
    if ent is not None:
        loss = loss + (ent * data["w_ent"].to(ent.dtype)).sum()
    loss.backward()
    return {
        "logp": logp.detach(),
        "entropy": None if ent is None else ent.detach(),
        "grad": x.grad,
        "forward_calls": forward_calls,
        "backward_calls": counter.take(),
    }


def worker_main(argv: list[str]) -> None:
    args = gloo_launch.worker_arguments(argv, data=str, fail_rank=int)
    rank, world_size, data_path = args.rank, args.world_size, args.data
    fail_rank = args.fail_rank
    torch.set_num_threads(1)
    gloo_launch.join_group(args, timeout_s=LAUNCH_TIMEOUT_S)
    try:
        if rank == fail_rank:  # the others go on into the collectives and wait there
            raise RuntimeError(f"injected failure on rank {rank}")
        payload = torch.load(data_path, weights_only=False)
        singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates each
        counter = CollectiveCounter()
        results = {
            c.name: rank_part(c, payload[c.name], rank, dist.group.WORLD, counter)
            for c in map(lambda d: Case(**d), payload["cases"])
        }
        # A group of one: the whole vocabulary here, no collective at all.
        case = Case(**payload["cases"][0])
        whole = dict(payload[case.name], bounds=[0, case.vocab])
        results["group-of-one"] = rank_part(case, whole, 0, singles[rank], counter)
        # Out-of-range targets: every rank raises, and nobody is left inside a collective.
        errors = []
        for bad in (-1, payload[case.name]["logits"].shape[-1]):
            data = payload[case.name]
            targets = data["targets"].clone()
            targets[0, 0] = bad
            lo, hi = data["bounds"][rank], data["bounds"][rank + 1]
            try:
                token_logprobs_and_entropy(
                    data["logits"][..., lo:hi], targets, vocab_start=lo, group=dist.group.WORLD
                )
                errors.append("no error")
            except ValueError as error:
                errors.append(str(error))
        results["errors"] = errors
        alive = torch.ones(1)
        dist.all_reduce(alive)  # the group still works after the errors
        results["alive"] = float(alive)
        dist.barrier()
        gloo_launch.save_result(results, args.out)
    finally:
        dist.destroy_process_group()


def launch(world_size: int, workdir: Path, data_path: Path) -> list[dict]:
    """Every rank's results of one launch of this file's workers (see
    tests/helpers/gloo_launch.py)."""
    return gloo_launch.launch(
        __file__, world_size, workdir, ["--data", data_path, "--fail-rank", -1], LAUNCH_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cache: dict[int, tuple] = {}

    def get(world_size: int):
        if world_size not in cache:
            cache[world_size] = None  # a failed launch is not retried by later tests
            workdir = tmp_path_factory.mktemp(f"vocab_parallel_world{world_size}")
            inputs = {c.name: case_inputs(c, world_size) for c in CASES}
            torch.save({**inputs, "cases": [asdict(c) for c in CASES]}, workdir / "data.pt")
            cache[world_size] = (inputs, launch(world_size, workdir, workdir / "data.pt"))
        if cache[world_size] is None:
            pytest.fail(f"the {world_size}-process launch failed earlier", pytrace=False)
        return cache[world_size]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_match_single_process(launched, world_size, case):
    inputs, ranks = launched(world_size)
    data = inputs[case.name]
    where = f"{case.name}, world size {world_size}, shards {data['bounds']}"
    single = ours_with_grad(
        data["logits"],
        data["targets"],
        case.temperature,
        data["w_logp"],
        data["w_ent"],
        vocab_size=case.vocab_size,
    )
    ref = reference_with_grad(
        data["logits"],
        data["targets"],
        case.temperature,
        data["w_logp"],
        data["w_ent"],
        vocab_size=case.vocab_size,
    )
    per_rank = [r[case.name] for r in ranks]
    grad = torch.cat([r["grad"] for r in per_rank], dim=-1)
    if case.dtype == "float64":  # against the plain float64 computation
        assert_close(grad, ref["grad"], 0, 1e-10, f"{where}: gradient")
        outputs = {"logp": (ref["logp"], 1e-12)}
        if case.with_entropy:
            outputs["entropy"] = (ref["entropy"], 1e-12)
    else:  # the same float32 arithmetic in another order, and close to float64
        scale = float(ref["grad"].abs().max())
        grad_tol = 1e-6 if case.dtype == "float32" else 1e-2
        assert grad.dtype == data["logits"].dtype, where
        assert float((grad.double() - ref["grad"]).abs().max()) <= grad_tol * scale, where
        assert_close(grad.double(), single["grad"].double(), 1e-5, 1e-6 * scale, where)
        outputs = {"logp": (ref["logp"], 2e-5), "entropy": (ref["entropy"], 2e-5)}
    for key, (want, tol) in outputs.items():
        for rank, got in enumerate(per_rank):
            assert_close(got[key], want, tol, tol, f"{where}, rank {rank}: {key}")
            assert torch.equal(got[key], per_rank[0][key]), f"{where}: ranks disagree on {key}"
    if not case.with_entropy:
        assert all(r["entropy"] is None for r in per_rank), where
    if case.vocab_size is not None:
        assert not grad[..., case.vocab_size :].any(), where
    for rank, got in enumerate(per_rank):
        assert got["forward_calls"] == ["all_reduce", "all_reduce"], (where, rank)
        assert got["backward_calls"] == [], (where, rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_group_of_one_and_errors(launched, world_size):
    inputs, ranks = launched(world_size)
    case = CASES[0]
    data = inputs[case.name]
    ref = reference_with_grad(
        data["logits"], data["targets"], case.temperature, data["w_logp"], data["w_ent"]
    )
    for rank, got in enumerate(ranks):
        one = got["group-of-one"]
        assert one["forward_calls"] == [] and one["backward_calls"] == [], rank
        assert_close(one["logp"], ref["logp"], 0, 1e-12, f"rank {rank}: group of one")
        assert_close(one["grad"], ref["grad"], 0, 1e-10, f"rank {rank}: group of one")
        assert len(got["errors"]) == 2 and all("targets" in e for e in got["errors"]), got
        assert got["alive"] == world_size


if __name__ == "__main__":
    worker_main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
