"""Whole runs of the evaluation (bapo-evaluate, tools/evaluate.py) on a tiny Llama whose answers
are known exactly (tests/helpers/known_answers.py). The same benchmark is evaluated from the HF
folder, from a Megatron checkpoint converted from it, from a trainer checkpoint holding it (found
from the run's checkpoint root, tokenizer given apart), and through the path vLLM/SGLang take (a
Megatron checkpoint converted to a temporary HF folder, here loaded by the embedded engine): the
reports must be equal. Also benchmarks in verl's and OpenRLHF's layouts, and what is refused
before a run starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.known_answers import (
    ROWS,
    K,
    command_line_args,
    evaluate_command_line,
    without_origin,
    write_known_answers,
)


@pytest.fixture(scope="module")
def known_answers(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF folder with known answers, the benchmark file with good and bad rows)."""
    return write_known_answers(tmp_path_factory.mktemp("evaluation"))


def test_known_answers_through_the_command_line(known_answers, tmp_path):
    from bapo_megatron.evaluation.evaluate import pass_at_k

    hf, bench = known_answers
    evaluate_command_line(
        [str(hf), str(bench), *command_line_args(tmp_path / "report.json"), "--keep-responses"]
    )
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
    from bapo_megatron.evaluation import checkpoint_source
    from bapo_megatron.evaluation import evaluate as evaluation
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
        reports[name] = evaluate_command_line(
            [str(source), str(bench), *command_line_args(tmp_path / f"{name}.json"), *extra]
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
    want = without_origin(reports["hf"])
    assert 0 < reports["hf"]["avg@k"] < 1
    for name in ("megatron", "trainer", "vllm"):
        assert without_origin(reports[name]) == want, name
    # a trainer checkpoint carries no tokenizer: it must be given
    with pytest.raises(SystemExit):
        evaluate_command_line(
            [
                str(tmp_path / "run" / "checkpoints"),
                str(bench),
                *command_line_args(tmp_path / "x.json"),
            ]
        )


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
        command_line_args(tmp_path / "verl.json"),
        "--reward",
        "tests.helpers.verl_rewards:compute_score",
    )
    report = evaluate_command_line(
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
    report = evaluate_command_line(
        [str(hf), str(openrlhf), *command_line_args(tmp_path / "openrlhf.json"), *keys]
    )
    assert {p["id"]: p["correct"] for p in report["per_problem"]} == {"0": K, "1": 0}
    assert report["bad_row_messages"] == [
        f"{openrlhf}:3: field 'label' must be a non-empty string or a finite number, got None"
    ]
    assert report["reward_metrics"] == {}  # math_lenient returns numbers


# ------------------------------------------------------------------------ refusals before the run


def test_an_unwritable_report_path_is_refused_before_the_evaluation(
    known_answers, tmp_path, monkeypatch, capsys
):
    from bapo_megatron.evaluation import evaluate as evaluation

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
            evaluate_command_line([str(hf), str(bench), *command_line_args(out)])
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
        evaluate_command_line([str(hf), str(bench), *command_line_args(tmp_path / "report.json")])
    assert failed.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"error: benchmark {bench}: no problem left to evaluate: all 3 row(s) were skipped; "
        "the first: problem 'long0': 61 prompt tokens + max_new_tokens (4) exceed the model's "
        "64 positions"
    ) in err, err
    assert not (tmp_path / "report.json").exists()


def test_the_command_leaves_the_engines_threads_alone(known_answers, tmp_path, monkeypatch):
    """No OMP_NUM_THREADS=1 of its own: the engine generates on the threads the process has
    (the reward workers are spawned processes and set their own)."""
    from bapo_megatron.evaluation import evaluate as evaluation

    hf, bench = known_answers
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached(os.environ.get("OMP_NUM_THREADS"))

    monkeypatch.setattr(evaluation, "run_evaluation", reached)
    with pytest.raises(Reached) as stopped:
        evaluate_command_line([str(hf), str(bench), *command_line_args(tmp_path / "r.json")])
    assert stopped.value.args == (None,)
