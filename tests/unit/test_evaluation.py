"""Evaluation (bapo_megatron.repro.evaluate, tools/evaluate.py): the pass@k estimator and whole
runs.

The estimator is checked against a float64 enumeration of every k-subset of n samples. The whole
run uses a tiny Llama whose answers are known exactly: its attention and MLP outputs are zero,
so the hidden state at the last position is the embedding of the last token, and embeddings and
output layer are set so that each letter a..j is followed by the digit 0..9, a digit by the end
token, and the letter z by 1 or 2 with equal probability. A problem ending in "d" is answered
"3"; one ending in "z" gets a seeded coin flip per sample. The same benchmark is then evaluated
from the HF folder, from a Megatron checkpoint converted from it, from a trainer checkpoint
holding it (found from the run's checkpoint root, tokenizer given apart), and through the path
vLLM/SGLang take (a Megatron checkpoint converted to a temporary HF folder, here loaded by the
embedded engine): the reports must be equal. Reward errors and timeouts are counted per problem
(a fake engine and a reward that hangs on one answer).

Top-level imports stay light: the reward pool's workers import this module for `_hanging_reward`.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import pytest

from bapo_megatron.data.synthetic_task import EOS, character_tokenizer

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ?"
K = 4

# (row as written to the benchmark file, correct count expected, or None for the coin flip)
ROWS = [
    ({"id": "p1", "problem": "find d", "answer": "3"}, K),
    ({"problem": "what is h", "answer": "7.0"}, K),  # id: its position, "1"
    ({"id": "p3", "prompt": "take c", "answer": "\\frac{4}{2}"}, K),  # `prompt`, not `problem`
    ({"id": "wrong", "problem": "say b", "answer": "5"}, 0),
    ({"id": "coin", "problem": "flip z", "answer": "1"}, None),
    ({"id": "unscorable", "problem": "give e", "answer": "\\boxed{}"}, 0),  # reward raises
]
BAD_LINES = [
    '{"problem": "", "answer": "1"}',
    '{"problem": "x"}',
    "not json",
    json.dumps({"id": "long", "problem": "a" * 70, "answer": "0"}),
]  # > 64 positions


def _hanging_reward(response: str, ground_truth: str) -> float:
    """Exact match, except that the response "9" hangs the check."""
    if response.strip() == "9":
        time.sleep(600)
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


# ------------------------------------------------------------------------ the estimator


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_of_all_subsets():
    import numpy as np

    from bapo_megatron.repro.evaluate import pass_at_k

    rng = random.Random(0)
    cases = [(n, c, k) for n in (1, 2, 5) for c in range(n + 1) for k in range(1, n + 1)]
    sizes = [rng.randint(6, 12) for _ in range(40)]
    cases += [(n, rng.randint(0, n), rng.randint(1, n)) for n in sizes]
    for n, c, k in cases:
        want = np.float64(_brute_force_pass_at_k(n, c, k))
        assert abs(pass_at_k(n, c, k) - want) <= 1e-12, (n, c, k)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 is the accuracy
    assert pass_at_k(1000, 1, 1000) == 1.0 and 0 < pass_at_k(10**6, 1, 1) < 1e-5  # no overflow
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_settings_are_validated():
    from bapo_megatron.repro.evaluate import EvalSettings

    assert EvalSettings(k=6).pass_ks == (1, 2, 4, 6)
    assert EvalSettings(k=8, pass_ks=(8, 1, 1)).pass_ks == (1, 8)
    for bad in [{"k": 0}, {"k": 4, "pass_ks": (5,)}, {"temperature": 0.0}, {"batch_size": 0}]:
        with pytest.raises(ValueError):
            EvalSettings(**bad)


def test_aime_format_parquet_is_read(tmp_path):
    """AIME-format files name the field `problem` and store integer ids and answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bapo_megatron.data.prompts import PromptRow, load_prompts

    rows = [
        {"id": 60, "problem": "Find x.", "answer": 204, "solution": "..."},
        {"id": 61, "problem": "", "answer": 1, "solution": "..."},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime.parquet")
    loaded = load_prompts(tmp_path / "aime.parquet", skip_bad_rows=True)
    assert loaded.rows == [PromptRow(id="60", prompt="Find x.", answer="204")]
    assert len(loaded.skipped) == 1 and "row 1: field 'problem'" in loaded.skipped[0]


# ------------------------------------------------------------------------ known answers


def _tokenizer():
    # The user turn alone, so the last prompt token is the problem's last character.
    return character_tokenizer(
        CHARS, "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )


def _known_answer_folder(folder: Path) -> None:
    import torch
    import transformers

    tokenizer = _tokenizer()
    vocab, hidden = len(tokenizer), 64
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # no layer writes to the residual stream
        # The final norm turns one-hot embeddings into 8 * one-hot; each logit row then reads one
        # input token: 5 * 8 = 40 for the followers, 0 elsewhere (others get ~1e-16 probability).
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):
            head[ids(EOS), token] = 5.0
        for letter, digit in zip("abcdefghij", "0123456789"):
            head[:, ids(letter)] = 0.0
            head[ids(digit), ids(letter)] = 5.0
        head[:, ids("z")] = 0.0
        head[ids("1"), ids("z")] = head[ids("2"), ids("z")] = 5.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def known_answers(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF folder with known answers, the benchmark file with good and bad rows)."""
    root = tmp_path_factory.mktemp("evaluation")
    _known_answer_folder(root / "hf")
    lines = (
        [json.dumps(row) for row, _ in ROWS[:4]]
        + BAD_LINES[:2]
        + [json.dumps(row) for row, _ in ROWS[4:]]
        + BAD_LINES[2:]
    )
    (root / "bench.jsonl").write_text("\n".join(lines) + "\n")
    return root / "hf", root / "bench.jsonl"


def _without_origin(report: dict) -> dict:
    return {
        key: value
        for key, value in report.items()
        if key not in ("checkpoint", "checkpoint_kind", "engine", "tokenizer", "wall_time_s")
    }


def _tool_main(argv: list[str]) -> dict:
    """The command line (tools/evaluate.py, bapo-evaluate) in this process (a second interpreter
    start is slow here)."""
    from bapo_megatron.repro.evaluate_cli import run

    return run(argv)


def _args(out: Path) -> list[str]:
    return [
        "--k",
        str(K),
        "--pass-k",
        "1,2,4",
        "--max-new-tokens",
        "4",
        "--batch-size",
        "3",
        "--reward",
        "math_lenient",
        "--reward-workers",
        "1",
        "--reward-timeout",
        "60",
        "--seed",
        "3",
        "--no-progress",
        "--out",
        str(out),
    ]


def test_known_answers_through_the_command_line(known_answers, tmp_path):
    from bapo_megatron.repro.evaluate import pass_at_k

    hf, bench = known_answers
    _tool_main([str(hf), str(bench), *_args(tmp_path / "report.json"), "--keep-responses"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # nothing left aside
    problems = {p["id"]: p for p in report["per_problem"]}
    assert list(problems) == ["p1", "1", "p3", "wrong", "coin", "unscorable"]
    for row, want in ROWS:
        got = problems[row.get("id", "1")]
        assert got["n"] == K
        if want is not None:
            assert got["correct"] == want, got
    assert problems["p1"]["responses"][0] == {"text": "3", "finish_reason": "stop", "reward": 1.0}
    coin = problems["coin"]
    assert {r["text"] for r in coin["responses"]} <= {"1", "2"}
    assert coin["correct"] == sum(r["text"] == "1" for r in coin["responses"])
    # the unscorable answer: every check raised, counted, and scored incorrect
    assert problems["unscorable"]["scoring_errors"] == K and report["scoring_errors"] == K
    assert report["scoring_error_messages"][0].startswith(
        "problem 'unscorable' sample 0: reward 'math_lenient' on response "
    )
    assert "ValueError: ground truth" in report["scoring_error_messages"][0]
    assert report["timeouts"] == 0 and report["truncated"] == 0
    # 3 malformed rows and one prompt too long for the model's 64 positions
    assert report["bad_rows"] == 4
    assert "'problem' must be a non-empty string" in report["bad_row_messages"][0]
    assert "exceed the model's 64 positions" in report["bad_row_messages"][-1]
    counts = [p["correct"] for p in report["per_problem"]]
    assert report["problems"] == 6 and report["samples"] == 6 * K
    assert report["avg@k"] == pytest.approx(sum(counts) / (6 * K))
    for k in (1, 2, 4):
        want = sum(pass_at_k(K, c, k) for c in counts) / 6
        assert report["pass@k"][str(k)] == pytest.approx(want)
    assert report["settings"]["k"] == K and report["settings"]["pass_ks"] == [1, 2, 4]
    assert report["checkpoint_kind"] == "hf" and report["wall_time_s"] > 0


def test_megatron_and_trainer_checkpoints_give_the_hf_report(known_answers, tmp_path, monkeypatch):

    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.config import ActorConfig, OptimizerConfig, ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.repro import checkpoint_source
    from bapo_megatron.repro import evaluate as evaluation
    from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
    from bapo_megatron.trainer.checkpoint import save_checkpoint
    from bapo_megatron.weights.convert import hf_to_megatron, load_hf_weights
    from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

    hf, bench = known_answers
    context = ParallelContext.initialize(ParallelConfig())
    try:
        model, _ = hf_to_megatron(hf, tmp_path / "megatron", context)
        actor = build_actor(model, ActorConfig(), OptimizerConfig(lr=1e-6), context)
        with HFCheckpoint.open(hf) as checkpoint:
            load_hf_weights(actor.chunks, checkpoint, context)
        save_checkpoint(tmp_path / "run" / "checkpoints", 5, actor, {}, keep_last=None)
    finally:
        context.teardown()
    reports = {}
    runs = [
        ("hf", hf, []),
        ("megatron", tmp_path / "megatron", []),
        ("trainer", tmp_path / "run" / "checkpoints", ["--tokenizer", str(hf)]),
    ]
    for name, source, extra in runs:
        reports[name] = _tool_main(
            [str(source), str(bench), *_args(tmp_path / f"{name}.json"), *extra]
        )
    assert reports["megatron"]["checkpoint_kind"] == "megatron"
    assert reports["trainer"]["checkpoint"] == str(
        tmp_path / "run" / "checkpoints" / "step_00000005"
    )
    # The path of vLLM/SGLang: a temporary HF folder, opened by the engine factory (faked here).
    opened = []

    def fake_build_engine(rollout, model, *, model_path, pad_token_id, **_):
        opened.append((rollout.engine, sorted(p.name for p in Path(model_path).iterdir())))
        return EmbeddedEngine.from_pretrained(model_path, pad_token_id=pad_token_id)

    monkeypatch.setattr(checkpoint_source, "build_engine", fake_build_engine)
    settings = evaluation.EvalSettings(
        k=K,
        pass_ks=(1, 2, 4),
        max_new_tokens=4,
        batch_size=3,
        reward="math_lenient",
        reward_workers=1,
        reward_timeout_s=60,
        seed=3,
    )
    reports["vllm"] = evaluation.run_evaluation(
        tmp_path / "megatron", bench, settings, engine="vllm", progress=False
    )
    engine_kind, files = opened[0]
    assert engine_kind == "vllm" and {"config.json", "tokenizer.json"} <= set(files)
    want = _without_origin(reports["hf"])
    assert 0 < reports["hf"]["avg@k"] < 1
    for name in ("megatron", "trainer", "vllm"):
        assert _without_origin(reports[name]) == want, name
    # a trainer checkpoint carries no tokenizer: it must be given
    with pytest.raises(SystemExit):
        _tool_main([str(tmp_path / "run" / "checkpoints"), str(bench), *_args(tmp_path / "x.json")])


# ------------------------------------------------------------------------ errors and timeouts


class _FixedEngine:
    """A rollout engine whose responses are fixed texts, one list per prompt."""

    def __init__(self, tokenizer, texts: list[list[str]]):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, 0

    def generate(self, prompts, params, *, round_tokens=None):
        from bapo_megatron.rollout.protocol import RolloutSample

        samples = []
        for p, _ in enumerate(prompts):
            texts = self.texts[self.calls + p]
            assert len(texts) == params.n
            samples += [
                RolloutSample(
                    prompt_index=p,
                    sample_index=i,
                    prompt_token_ids=[2],
                    token_ids=self.tokenizer.encode(text) + [1],
                    finish_reason="stop",
                )
                for i, text in enumerate(texts)
            ]
        self.calls += len(prompts)
        return samples


def test_reward_errors_and_timeouts_are_counted_per_problem():
    from bapo_megatron.data.prompts import PromptRow
    from bapo_megatron.repro.evaluate import (
        Counts,
        EvalSettings,
        encode_rows,
        evaluate_rows,
        reward_pool,
    )

    tokenizer = _tokenizer()
    rows = [PromptRow(id="a", prompt="a", answer="1"), PromptRow(id="b", prompt="b", answer="2")]
    engine = _FixedEngine(tokenizer, [["1", "9", "1"], ["2", "3", "9"]])
    settings = EvalSettings(
        k=3,
        reward="tests.unit.test_evaluation:_hanging_reward",
        reward_workers=2,
        reward_timeout_s=1.0,
        batch_size=2,
    )
    counts = Counts()
    with reward_pool(settings) as pool:
        results = evaluate_rows(
            engine,
            tokenizer,
            encode_rows(tokenizer, rows, settings),
            settings,
            pool,
            counts=counts,
            progress=False,
        )
    assert [(r.id, r.correct, r.timeouts, r.scoring_errors) for r in results] == [
        ("a", 2, 1, 0),
        ("b", 1, 1, 0),
    ]
    assert not counts.scoring_errors and not counts.bad_rows


# ------------------------------------------------------------------------ the field's layouts


def _option(args: list[str], name: str, value: str) -> list[str]:
    """``args`` with option ``name`` set to ``value``."""
    at = args.index(name)
    return [*args[:at], name, value, *args[at + 2 :]]


def test_verl_and_openrlhf_benchmarks_through_the_command_line(known_answers, tmp_path):
    """A verl-format parquet file (chat messages, a system turn included, the answer at
    reward_model.ground_truth) scored by a verl compute_score that dispatches on data_source,
    and an OpenRLHF-style JSONL file with its own keys: the known answers, bad rows counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf, _ = known_answers

    def verl_row(source, turns, truth, index):
        return {
            "data_source": source,
            "prompt": [{"role": role, "content": text} for role, text in turns],
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": index},
        }

    rows = [
        verl_row("count_to", [("system", "be brief "), ("user", "find d")], "3", 0),  # right
        verl_row("count_to", [("user", "say b")], "5", 1),  # wrong
        verl_row("words", [("user", "what is h")], "7", 2),  # right
        {**verl_row("count_to", [("user", "take c")], "2", 3), "reward_model": None},  # bad row
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    args = _option(
        _args(tmp_path / "verl.json"), "--reward", "tests.helpers.verl_rewards:compute_score"
    )
    report = _tool_main(
        [
            str(hf),
            str(tmp_path / "verl.parquet"),
            *args,
            "--answer-key",
            "reward_model.ground_truth",
        ]
    )
    assert {p["id"]: p["correct"] for p in report["per_problem"]} == {"0": K, "1": 0, "2": K}
    assert report["scoring_errors"] == 0 and report["bad_rows"] == 1
    assert report["bad_row_messages"] == [
        f"{tmp_path / 'verl.parquet'} 0-based row 3: field 'reward_model.ground_truth' is "
        "missing ('reward_model' is null)"
    ]
    # acc and index come from the `count_to` rows' 2 x K checks, words from the `words` row's K
    assert report["reward_metrics"] == {"acc": 0.5, "index": 0.5, "words": 1.0}
    assert report["settings"]["answer_key"] == "reward_model.ground_truth"

    openrlhf = tmp_path / "openrlhf.jsonl"
    lines = [
        {"input": "find d", "label": 3},
        {"input": [{"role": "user", "content": "say b"}], "label": "5"},
        {"input": "what is h"},
    ]
    openrlhf.write_text("".join(json.dumps(line) + "\n" for line in lines))
    keys = ["--prompt-key", "input", "--answer-key", "label"]
    report = _tool_main([str(hf), str(openrlhf), *_args(tmp_path / "openrlhf.json"), *keys])
    assert {p["id"]: p["correct"] for p in report["per_problem"]} == {"0": K, "1": 0}
    assert report["bad_row_messages"] == [
        f"{openrlhf}:3: field 'label' must be a non-empty string or a finite number, got None"
    ]
    assert report["reward_metrics"] == {}  # math_lenient returns numbers


# ------------------------------------------------------------------------ refusals before the run


def test_an_unwritable_report_path_is_refused_before_the_evaluation(
    known_answers, tmp_path, monkeypatch, capsys
):
    from bapo_megatron.repro import evaluate as evaluation

    hf, bench = known_answers

    def never(*args, **kwargs):
        raise AssertionError("the evaluation ran before --out was checked")

    monkeypatch.setattr(evaluation, "run_evaluation", never)
    (tmp_path / "a_file").write_text("")
    for out, why in [
        (tmp_path / "a_file" / "report.json", f"{tmp_path / 'a_file'} is not a folder"),
        (tmp_path, "is a folder"),
        (Path("/proc/report.json"), "not writable: cannot create a file in /proc"),  # even as root
    ]:
        with pytest.raises(SystemExit) as failed:
            _tool_main([str(hf), str(bench), *_args(out)])
        assert failed.value.code == 2
        err = capsys.readouterr().err
        assert f"error: report path {out}" in err and why in err, err
        assert len(err.strip().splitlines()) == 1, err
    # a path whose folders do not exist yet passes, and the check leaves nothing behind
    evaluation.check_report_path(tmp_path / "new" / "deeper" / "report.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_benchmark_whose_rows_are_all_too_long_is_an_error(known_answers, tmp_path, capsys):
    hf, _ = known_answers
    bench = tmp_path / "long.jsonl"
    rows = [{"id": f"long{i}", "problem": "a" * (61 + i), "answer": "0"} for i in range(3)]
    bench.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit) as failed:
        _tool_main([str(hf), str(bench), *_args(tmp_path / "report.json")])
    assert failed.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"error: benchmark {bench}: no problem left to evaluate: all 3 row(s) were skipped; "
        "the first: problem 'long0': 61 prompt tokens + max_new_tokens (4) exceed the model's "
        "64 positions"
    ) in err, err
    assert not (tmp_path / "report.json").exists()
