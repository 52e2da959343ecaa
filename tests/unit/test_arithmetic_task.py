"""The arithmetic prompt sets (bapo_megatron/data/arithmetic_task.py, bapo-make-arithmetic)."""

from __future__ import annotations

import json
import re

import pytest

from bapo_megatron.data import arithmetic_task
from bapo_megatron.data.arithmetic_task import split_problems, write_task
from bapo_megatron.data.prompts import load_prompts
from bapo_megatron.rewards.final_number import final_number_reward

QUESTION = re.compile(r"What is \(?(-?\d+)\)? ([-+*]) \(?(-?\d+)\)?\?")


def problems_of(path) -> list[tuple[int, str, int, str]]:
    """(a, op, b, answer) of every row of a written file, read back from its text."""
    found = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        a, op, b = QUESTION.fullmatch(row["prompt"][0]["content"]).groups()
        found.append((int(a), op, int(b), row["answer"]))
    return found


def test_the_default_files_hold_every_sum_once_the_answers_right(tmp_path):
    train_path, test_path, train, test = write_task(tmp_path / "data")
    assert (train, test) == (200, 200)  # 20 x 20 sums: 200 held out, all the rest to train
    train_rows, test_rows = problems_of(train_path), problems_of(test_path)
    assert len(train_rows) == 200 and len(test_rows) == 200
    seen = [(a, op, b) for a, op, b, _ in train_rows + test_rows]
    assert sorted(seen) == [(a, "+", b) for a in range(1, 21) for b in range(1, 21)]
    for a, _, b, answer in train_rows + test_rows:
        assert answer == str(a + b)


def test_the_same_seed_writes_the_same_files_and_another_seed_others(tmp_path):
    options = {"test": 30, "train": 50, "low": -9, "high": 9, "ops": "+-*"}
    write_task(tmp_path / "a", seed=3, **options)
    write_task(tmp_path / "b", seed=3, **options)
    write_task(tmp_path / "c", seed=4, **options)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_train_and_test_are_disjoint_and_every_answer_is_right(tmp_path):
    train_path, test_path, _, _ = write_task(
        tmp_path, test=100, train=400, low=-5, high=12, ops="*-+", seed=1
    )
    train_rows, test_rows = problems_of(train_path), problems_of(test_path)
    train_set = {(a, op, b) for a, op, b, _ in train_rows}
    test_set = {(a, op, b) for a, op, b, _ in test_rows}
    assert len(train_set) == 400 and len(test_set) == 100 and not train_set & test_set
    results = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for a, op, b, answer in train_rows + test_rows:
        assert -5 <= a <= 12 and -5 <= b <= 12
        assert answer == str(results[op](a, b))
    assert {op for _, op, _ in train_set} == {"+", "-", "*"}


def test_the_rows_load_as_a_prompt_set_the_final_number_reward_scores(tmp_path):
    train_path, test_path, _, _ = write_task(tmp_path, test=5, train=7, seed=2)
    for path, size, split in ((train_path, 7, "train"), (test_path, 5, "test")):
        rows = load_prompts(path).rows
        assert [r.id for r in rows] == [f"{split}-{i}" for i in range(size)]
        for row in rows:
            assert row.data_source == "arithmetic"
            (message,) = row.prompt
            assert message.role == "user"
            a, _, b = QUESTION.fullmatch(message.content).groups()
            assert final_number_reward(f"{a} + {b} is {int(a) + int(b)}.", row.answer) == 1.0


def test_sizes_beyond_the_distinct_problems_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"201 train \+ 200 test .* make only 400 distinct"):
        split_problems(train=201)
    with pytest.raises(ValueError, match="a test set of 400 leaves no problem for training"):
        split_problems(test=400)
    with pytest.raises(ValueError, match="too many to take all the rest"):
        split_problems(low=1, high=2000)
    assert len(split_problems(low=1, high=2000, train=10, test=10)[0]) == 10  # sampled lazily
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['/'\]"):
        split_problems(ops="+/")
    with pytest.raises(ValueError, match=r"low \(5\) must not exceed high \(4\)"):
        split_problems(low=5, high=4)
    assert not list(tmp_path.iterdir())


def test_the_command_line_writes_both_files_and_refuses_bad_sizes(tmp_path, capsys):
    arithmetic_task.main(
        ["--out", str(tmp_path / "d"), "--test", "4", "--train", "6", "--seed", "9"]
    )
    assert "(6 problems)" in capsys.readouterr().out
    assert len(problems_of(tmp_path / "d" / "train.jsonl")) == 6
    assert len(problems_of(tmp_path / "d" / "test.jsonl")) == 4
    with pytest.raises(SystemExit) as exit_:
        arithmetic_task.main(
            ["--out", str(tmp_path / "e"), "--ops=-", "--high", "3", "--test", "10"]
        )
    assert exit_.value.code == 2
    assert "make only 9 distinct problems" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
