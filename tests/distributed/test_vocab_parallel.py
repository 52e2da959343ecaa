"""Vocab-parallel log-probs and entropy against a float64 single-process computation.

Single process: values and gradients of :func:`token_logprobs_and_entropy` against
``torch.log_softmax`` and an explicit entropy in float64, with autograd through that plain
reference, at several temperatures; float32 / bf16 inputs; padded vocabularies; errors.

Real processes: 2 and 4 gloo workers (this file re-run as a script, one launch per world size
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

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 120.0
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------ reference


def reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 log-probs and entropy of softmax(logits / T) over the first ``vocab_size``
    columns (autograd-able; padded columns get no gradient)."""
    z = logits.to(torch.float64)[..., : vocab_size or logits.shape[-1]] / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def reference_with_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    x = logits.detach().to(torch.float64).requires_grad_(True)
    logp, ent = reference(x, targets, temperature, vocab_size)
    loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if w_ent is not None else 0.0)
    loss.backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "grad": x.grad}


def ours_with_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
    **kwargs,
) -> dict:
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(
        x, targets, temperature=temperature, with_entropy=w_ent is not None, **kwargs
    )
    loss = (logp * w_logp.to(logp.dtype)).sum()
    if w_ent is not None:
        loss = loss + (ent * w_ent.to(ent.dtype)).sum()
    loss.backward()
    return {"logp": logp.detach(), "entropy": None if ent is None else ent.detach(), "grad": x.grad}


def random_inputs(
    seed: int,
    shape: tuple[int, ...],
    vocab: int,
    scale: float = 3.0,
    target_limit: int | None = None,
):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, target_limit or vocab, shape, generator=g)
    w_logp = torch.randn(shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(shape, generator=g, dtype=torch.float64)
    return logits, targets, w_logp, w_ent


def assert_close(got, want, rtol, atol, what):
    torch.testing.assert_close(
        got.to(torch.float64), want, rtol=rtol, atol=atol, msg=lambda m: f"{what}\n{m}"
    )


# ------------------------------------------------------------------------- single process


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_float64_values_and_gradients(temperature):
    logits, targets, w_logp, w_ent = random_inputs(1, (3, 5), 37)
    want = reference_with_grad(logits, targets, temperature, w_logp, w_ent)
    got = ours_with_grad(logits, targets, temperature, w_logp, w_ent)
    assert got["logp"].dtype == got["entropy"].dtype == torch.float64
    assert_close(got["logp"], want["logp"], 0, 1e-12, "log-probs")
    assert_close(got["entropy"], want["entropy"], 0, 1e-12, "entropy")
    assert_close(got["grad"], want["grad"], 0, 1e-10, "logits gradient")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_each_output_alone_has_the_right_gradient(temperature):
    logits, targets, w_logp, w_ent = random_inputs(2, (4, 3), 19)
    for which in ("logp", "entropy"):
        x = logits.clone().requires_grad_(True)
        out = token_logprobs_and_entropy(x, targets, temperature=temperature)
        (out[0] if which == "logp" else out[1]).mul(w_logp).sum().backward()
        r = logits.clone().requires_grad_(True)
        ref = reference(r, targets, temperature)
        (ref[0] if which == "logp" else ref[1]).mul(w_logp).sum().backward()
        assert_close(x.grad, r.grad, 0, 1e-10, f"gradient of {which} alone")
    # Without the entropy: None, and the log-prob gradient is unchanged.
    got = ours_with_grad(logits, targets, temperature, w_logp, None)
    want = reference_with_grad(logits, targets, temperature, w_logp, None)
    assert got["entropy"] is None
    assert_close(got["grad"], want["grad"], 0, 1e-10, "gradient without entropy")


def test_gradcheck():
    logits, targets, _, _ = random_inputs(3, (2, 3), 6, scale=1.0)
    for temperature in (1.0, 0.7):
        assert torch.autograd.gradcheck(
            lambda x, temperature=temperature: token_logprobs_and_entropy(
                x, targets, temperature=temperature
            ),
            (logits.clone().requires_grad_(True),),
        )


@pytest.mark.parametrize(
    ("dtype", "tol", "grad_tol"), [(torch.float32, 2e-5, 1e-5), (torch.bfloat16, 2e-5, 2e-2)]
)
def test_low_precision_inputs(dtype, tol, grad_tol):
    """Computed in float32 from the rounded inputs; bf16 gradients come back in bf16."""
    logits, targets, w_logp, w_ent = random_inputs(4, (4, 8), 301, scale=4.0)
    low = logits.to(dtype)
    for temperature in (1.0, 0.6):
        want = reference_with_grad(low.double(), targets, temperature, w_logp, w_ent)
        got = ours_with_grad(low, targets, temperature, w_logp, w_ent)
        assert got["logp"].dtype == got["entropy"].dtype == torch.float32
        assert got["grad"].dtype == dtype
        assert_close(got["logp"], want["logp"], tol, tol, f"{dtype} log-probs")
        assert_close(got["entropy"], want["entropy"], tol, tol, f"{dtype} entropy")
        scale = want["grad"].abs().max()
        assert float((got["grad"].double() - want["grad"]).abs().max()) <= grad_tol * scale


def test_huge_logits_stay_finite():
    logits, targets, w_logp, w_ent = random_inputs(5, (3, 4), 50, scale=1e4)
    got = ours_with_grad(logits.float(), targets, 0.6, w_logp, w_ent)
    want = reference_with_grad(logits.float().double(), targets, 0.6, w_logp, w_ent)
    assert torch.isfinite(got["logp"]).all() and torch.isfinite(got["grad"]).all()
    assert_close(got["logp"], want["logp"], 1e-6, 1e-3, "log-probs of huge logits")
    assert_close(got["entropy"], want["entropy"], 0, 1e-4, "entropy of huge logits")


def test_padded_columns_leave_the_distribution():
    logits, targets, w_logp, w_ent = random_inputs(6, (3, 4), 16, target_limit=11)
    logits[..., 11:] = 50.0  # large padding logits must not matter
    want = reference_with_grad(logits, targets, 1.3, w_logp, w_ent, vocab_size=11)
    got = ours_with_grad(logits, targets, 1.3, w_logp, w_ent, vocab_size=11)
    assert_close(got["logp"], want["logp"], 0, 1e-12, "log-probs")
    assert_close(got["entropy"], want["entropy"], 0, 1e-12, "entropy")
    assert_close(got["grad"], want["grad"], 0, 1e-10, "gradient")
    assert not got["grad"][..., 11:].any()


def test_no_group_means_no_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective was called without a group")

    monkeypatch.setattr(dist, "all_reduce", forbidden)
    logits, targets, w_logp, w_ent = random_inputs(7, (2, 2), 9)
    ours_with_grad(logits, targets, 1.0, w_logp, w_ent)


if __name__ != "__main__":  # workers skip importing hypothesis (about 1 s each)
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(
        batch=st.integers(1, 3),
        seq=st.integers(1, 4),
        vocab=st.integers(1, 40),
        temperature=st.floats(0.05, 4.0),
        scale=st.floats(0.0, 30.0),
        seed=st.integers(0, 2**16),
    )
    def test_property_matches_reference(batch, seq, vocab, temperature, scale, seed):
        logits, targets, w_logp, w_ent = random_inputs(seed, (batch, seq), vocab, scale=scale)
        want = reference_with_grad(logits, targets, temperature, w_logp, w_ent)
        got = ours_with_grad(logits, targets, temperature, w_logp, w_ent)
        assert_close(got["logp"], want["logp"], 1e-12, 1e-11, "log-probs")
        assert_close(got["entropy"], want["entropy"], 1e-12, 1e-11, "entropy")
        assert_close(got["grad"], want["grad"], 1e-10, 1e-10, "gradient")


def test_errors():
    logits, targets, _, _ = random_inputs(8, (2, 3), 10)
    call = token_logprobs_and_entropy
    for bad in (10, -1):
        t = targets.clone()
        t[1, 2] = bad
        with pytest.raises(ValueError, match="targets"):
            call(logits, t)
    with pytest.raises(ValueError, match="targets"):  # a padded column is not a token
        call(logits, torch.full_like(targets, 9), vocab_size=9)
    with pytest.raises(ValueError, match="targets"):  # a shard alone does not own every target
        call(logits[..., 5:], targets, vocab_start=5)
    with pytest.raises(ValueError, match="targets"):
        call(logits, targets.double())
    with pytest.raises(ValueError, match="targets"):
        call(logits, targets[:, :2])
    with pytest.raises(ValueError, match="logits"):
        call(logits.long(), targets)
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            call(logits, targets, temperature=t)
    with pytest.raises(ValueError, match="vocab_start"):
        call(logits, targets, vocab_start=-1)


# ------------------------------------------------------------------------- real processes


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
