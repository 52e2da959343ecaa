"""The synthetic `count_to` task: its tokenizer (through transformers, as real models are used), its
rows and reference responses, and the exact-match reward that scores it."""

from __future__ import annotations

import random

import pytest

from bapo_megatron.data.prompts import prompt_token_ids
from bapo_megatron.data.synthetic_task import (
    MAX_DISTANCE,
    MAX_NUMBER,
    SYNTHETIC_TASKS,
    count_response,
    count_to_rows,
    count_up_and_stop_rows,
    counting_tokenizer,
    longest_response_tokens,
    synthetic_rows,
)
from bapo_megatron.rewards.registry import get_reward


def test_tokenizer_round_trips_every_character_and_saves(tmp_path):
    import transformers

    tokenizer = counting_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    text = "12>3:11 10 9 8 7 6 5 4 3"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    tokenizer.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids


def test_chat_template_opens_the_response():
    tokenizer = counting_tokenizer()
    row = count_to_rows(1, seed=3)[0]
    ids = prompt_token_ids(tokenizer, row)
    assert tokenizer.decode(ids) == row.prompt + ":"


def test_rows_and_reference_responses():
    rows = count_to_rows(500, seed=7)
    assert rows == count_to_rows(500, seed=7) and rows != count_to_rows(500, seed=8)
    for row in rows:
        start, target = map(int, row.prompt.split(">"))
        assert 0 <= start <= MAX_NUMBER and 0 <= target <= MAX_NUMBER
        assert 1 <= abs(target - start) <= MAX_DISTANCE
        numbers = [int(n) for n in row.answer.split(" ")]
        step = 1 if target > start else -1
        assert numbers == list(range(start + step, target + step, step))
    assert count_response(9, 12) == "10 11 12" and count_response(3, 1) == "2 1"
    assert longest_response_tokens() == len(count_response(31, 39)) + 1


def test_exact_match_reward():
    reward = get_reward("exact_match")
    assert reward(" 8 9 10\n", "8 9 10") == 1.0
    assert reward("8 9 10 11", "8 9 10") == 0.0
    assert reward("", "8") == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_a_response_that_misses_the_target_is_wrong(seed):
    rng = random.Random(seed)
    reward = get_reward("exact_match")
    for row in count_to_rows(50, seed=seed):
        numbers = row.answer.split(" ")
        overshoot = " ".join(numbers + [str(rng.randint(0, MAX_NUMBER))])
        assert reward(overshoot, row.answer) == 0.0
        assert reward(" ".join(numbers[:-1]), row.answer) == 0.0  # stopped short


def test_the_registry_names_each_task_and_refuses_others():
    assert set(SYNTHETIC_TASKS) == {"count_to", "count_up_and_stop"}
    assert synthetic_rows("count_to", 20, seed=3) == count_to_rows(20, seed=3)
    assert synthetic_rows("count_up_and_stop", 20, seed=3) == count_up_and_stop_rows(20, seed=3)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic_rows("seek", 1, seed=0)


@pytest.mark.parametrize("name", ["count_to", "count_up_and_stop"])
def test_load_task_generates_the_named_task(name):
    from bapo_megatron.config.loading import load_config
    from bapo_megatron.data.synthetic_task import synthetic_rows
    from bapo_megatron.data.task import load_task
    from tests.helpers.train_runs import TINY_CONFIG

    cfg = load_config(TINY_CONFIG, [f"data.synthetic_task={name}", "data.synthetic_size=30"])
    task = load_task(cfg)
    assert task.rows == synthetic_rows(name, 30, seed=cfg.train.seed)
    assert task.model == cfg.model and task.eos_token_id == 1


def test_warmup_batches_with_cached_prompts_equal_freshly_encoded_ones():
    # the warm-up keeps each row's encoded prompt (trainer/warmup.py): the batches it builds
    # from the cache, for rows drawn again and again, are the ones encoding afresh gives
    import torch

    from bapo_megatron.config.loading import load_config
    from bapo_megatron.data.task import load_task
    from bapo_megatron.trainer.warmup import supervised_batch
    from tests.helpers.train_runs import TINY_CONFIG

    cfg = load_config(TINY_CONFIG, ["data.synthetic_size=12"])
    task = load_task(cfg)
    rng, cache = random.Random(5), {}
    for _ in range(4):
        rows = rng.sample(task.rows, 6)
        args = (task, rows, cfg.data.system_prompt, cfg.rollout.max_new_tokens)
        cached, fresh = supervised_batch(*args, prompt_ids=cache), supervised_batch(*args)
        assert torch.equal(cached.tokens, fresh.tokens)
        assert torch.equal(cached.response_mask, fresh.response_mask)
    assert len(cache) == len({id(row) for row in task.rows if id(row) in cache}) <= 12
