"""Vocab-parallel log-probs and entropy against a float64 single-process computation, in one
process: values and gradients of :func:`token_logprobs_and_entropy` against
``torch.log_softmax`` and an explicit entropy in float64, with autograd through that plain
reference, at several temperatures; float32 / bf16 inputs; padded vocabularies; errors. The
vocabulary split over processes: tests/distributed/test_vocab_parallel_shards.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bapo_megatron.algo import vocab_parallel
from bapo_megatron.algo.vocab_parallel import token_logprobs_and_entropy
from tests.helpers.logprob_reference import (
    assert_close,
    ours_with_grad,
    random_inputs,
    reference,
    reference_with_grad,
)


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


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 5])
def test_rows_in_chunks_match_the_reference(monkeypatch, rows_per_chunk):
    """Rows go through the vocabulary a chunk at a time (7 x 3 rows: uneven last chunks), padding
    columns included: values and gradients still match float64, and the chunks were used."""
    vocab = 23
    monkeypatch.setattr(vocab_parallel, "_CHUNK_ELEMENTS", rows_per_chunk * 19)  # 19 real columns
    seen = []
    chunks = vocab_parallel._chunks
    monkeypatch.setattr(vocab_parallel, "_chunks", lambda *a: seen.append(chunks(*a)) or seen[-1])
    logits, targets, w_logp, w_ent = random_inputs(11, (7, 3), vocab, target_limit=19)
    for temperature in (1.0, 0.7):
        want = reference_with_grad(logits, targets, temperature, w_logp, w_ent, vocab_size=19)
        got = ours_with_grad(logits, targets, temperature, w_logp, w_ent, vocab_size=19)
        assert_close(got["logp"], want["logp"], 0, 1e-12, "log-probs")
        assert_close(got["entropy"], want["entropy"], 0, 1e-12, "entropy")
        assert_close(got["grad"], want["grad"], 0, 1e-10, "gradient")
        assert not got["grad"][..., 19:].any()
    assert len(seen) == 4  # forward and backward, at both temperatures
    assert all(len(parts) == -(-21 // rows_per_chunk) for parts in seen)


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
