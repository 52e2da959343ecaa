"""End-to-end runs of the training loop on the tiny CPU example: the default path, every
off-policy mode (mini-batch reuse, lag, replay, partial rollout, recomputed old log-probs with
truncated importance weights), TensorBoard output, and bad configs and data."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bapo_megatron.trainer.main import main as train_main
from bapo_megatron.trainer.tracking import read_scalars
from tests.helpers import hf_models
from tests.helpers.train_runs import (
    TINY_CONFIG,
    read_metrics,
    rollout_records,
    run_in_process,
    run_subprocess,
)


def optimizer_records(records):
    return [r for r in records if "loss" in r and "reward/mean" not in r]


def test_warmup_lowers_the_cross_entropy_and_leaves_room_for_rl(warm_start):
    _, records = warm_start
    warmup = [r["warmup/cross_entropy"] for r in records if "warmup/cross_entropy" in r]
    assert len(warmup) == 150
    assert sum(warmup[-10:]) < 0.3 * sum(warmup[:10])
    first = rollout_records(records)[0]
    assert 0.0 < first["reward/mean"] < 1.0


def test_default_run_logs_every_step_to_tensorboard(tmp_path, warm_start):
    records = run_in_process(
        tmp_path, *warm_start[0], "train.steps=3", "logging.logprob_diff_interval=1"
    )
    rollouts = rollout_records(records)
    steps = optimizer_records(records)
    assert [r["rollout_step"] for r in rollouts] == [1, 2, 3]
    # two mini-batches per rollout step (the example's optimizer_steps_per_rollout): 6 updates
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        for key in (
            "loss",
            "entropy",
            "grad_norm",
            "bapo/c_low",
            "bapo/c_high",
            "bapo/rho_before",
            "bapo/rho_after",
            "bapo/search_steps",
            "bapo/ratio_min",
            "bapo/ratio_max",
            "staleness/mean",
            "staleness/max",
        ):
            assert math.isfinite(r[key]), key
    # mini-batch reuse: the second update of each rollout batch trains one version stale data
    assert [r["staleness/max"] for r in steps] == [0, 1, 0, 1, 0, 1]
    for r in rollouts:
        # trained tokens of both updates of the step (not only the last one) per train second
        trained = sum(
            u["response_tokens"] for u in steps if u["rollout_step"] == r["rollout_step"] - 1
        )
        assert r["throughput/train_tokens_per_s"] * r["time/train"] == pytest.approx(trained)
        assert 0 <= r["reward/mean"] <= 1
        assert r["rollout/generated_tokens"] > 0
        assert r["time/step"] >= r["time/rollout"] > 0
        # engine and actor agree on the same weights (fp32 on both sides)
        assert r["logprob_diff/mean_abs"] < 1e-4 and r["logprob_diff/max_abs"] < 1e-3
    assert any(r["reward/mean"] > 0 for r in rollouts) and any(r["grad_norm"] > 0 for r in steps)
    # TensorBoard's own reader sees the same values as the jsonl
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["bapo/rho_after"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in scalars["reward/mean"]] == pytest.approx(
        [r["reward/mean"] for r in rollouts]
    )
    assert (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize(
    "mode, overrides",
    [
        (
            "lag",
            ["algorithm.rollout_lag=2", "algorithm.optimizer_steps_per_rollout=1", "train.steps=5"],
        ),
        (
            "replay",
            [
                "algorithm.replay_fraction=0.5",
                "algorithm.optimizer_steps_per_rollout=1",
                "algorithm.replay_max_staleness=2",
                "train.steps=5",
            ],
        ),
        (
            "partial",
            [
                "rollout.partial_tokens_per_round=4",
                "algorithm.optimizer_steps_per_rollout=1",
                "train.steps=5",
            ],
        ),
        (
            "recompute-tis",
            [
                "algorithm.old_logprobs=recompute",
                "loss.truncated_is_cap=2.0",
                "algorithm.epochs=2",
                "train.steps=1",
            ],
        ),
        # mini-batches left empty on every rank: groups filtered out, or responses not finished yet
        (
            "filter-k4",
            [
                "algorithm.filter_equal_groups=true",
                "algorithm.optimizer_steps_per_rollout=4",
                "train.steps=4",
            ],
        ),
        # 8 groups of 2 samples per step in 8 mini-batches: a group ends when both its samples
        # have, so the steps' counts of finished groups spread over 0..8 (2 to 4 steps with 1 to
        # 7 of them in 13 seeds tried); 4 groups of 4 in 4 mini-batches mostly end together
        # (all 4 at the length cap, [0, 0, 4, 4]: half the seeds had no partly empty step)
        (
            "partial-k8",
            [
                "rollout.partial_tokens_per_round=6",
                "rollout.prompts_per_step=8",
                "rollout.samples_per_prompt=2",
                "algorithm.optimizer_steps_per_rollout=8",
                "train.steps=4",
            ],
        ),
    ],
)
def test_off_policy_modes(tmp_path, warm_start, mode, overrides):
    records = run_in_process(tmp_path, *warm_start[0], *overrides)
    steps = optimizer_records(records)
    rollouts = rollout_records(records)
    staleness = [r["staleness/max"] for r in steps]
    if mode == "lag":
        # steps 1-2 only fill the queue; step k >= 3 trains on step k-2's batch, sampled at
        # version max(0, k-4) and trained at version k-3
        assert [r["policy_version"] for r in rollouts] == [0, 0, 1, 2, 3]
        assert staleness == [0, 1, 2]
        assert [r["staleness/mean"] for r in steps] == staleness
    elif mode == "replay":
        assert len(steps) == 5
        assert max(staleness) >= 1 and max(staleness) <= 2  # replayed groups, never past the cap
    elif mode == "partial":
        # 4 tokens per round: no response of the `count_to` task (2 to 24 characters and the end
        # token) is certain to finish in one round, and continued ones mix policy versions
        assert all(r["rollout/generated_tokens"] <= 4 * 16 * 4 for r in rollouts)
        assert max(staleness) >= 1
        assert any(r["staleness/mean"] < r["staleness/max"] for r in steps)
    elif mode == "recompute-tis":
        assert len(steps) == 4  # 2 rollout steps x 2 mini-batches x 2 epochs
        assert staleness == [0, 1, 2, 3]
        # ratios against recomputed log-probs start at 1 exactly
        assert steps[0]["bapo/ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert steps[0]["bapo/ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert all("logprob_diff/mean_abs" in r for r in rollouts)
        # the capped weights reach the loss: behaviour and actor log-probs agree to float error
        # on these fresh samples, so every weight is 1 (a dropped weight would not be logged)
        for r in rollouts:
            assert r["is_weights/mean"] == pytest.approx(1.0, abs=1e-4)
            assert r["is_weights/capped_fraction"] == 0.0
    else:
        # the updates of each rollout step: one per mini-batch holding a group on some rank
        parts = 4 if mode == "filter-k4" else 8
        per_step = [sum(1 for u in steps if u["rollout_step"] == k) for k in range(4)]
        assert sum(per_step) == len(steps) > 0
        # some step trained some of its mini-batches and skipped the others, empty everywhere
        assert any(0 < n < parts for n in per_step), per_step
        assert all(r["policy_version"] == sum(per_step[: k + 1]) for k, r in enumerate(rollouts))
        # the groups that train: those with a reward signal, or those whose samples all ended
        key = "informative_groups" if mode == "filter-k4" else "finished_groups"
        trained = [int(r[f"rollout/{key}"]) for r in rollouts]
        assert per_step == [min(parts, n) for n in trained], (per_step, trained)
        assert min(trained) < parts


def test_console_line_per_step_and_a_fresh_start_replaces_the_old_records(
    tmp_path, warm_start, capsys
):
    run_in_process(
        tmp_path, *warm_start[0], "train.steps=2", "algorithm.optimizer_steps_per_rollout=1"
    )
    capsys.readouterr()
    records = run_in_process(
        tmp_path,
        *warm_start[0],
        "train.steps=1",
        "checkpoint.resume=false",
        "logging.console=true",
        "algorithm.optimizer_steps_per_rollout=1",
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith("step 1/1 | reward ") and " rho " in lines[0]
    # only the second run's records: one update, one rollout step
    assert [r["step"] for r in records if "warmup/cross_entropy" not in r] == [1, 1]
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["reward/mean"]] == [1]
    assert [v for _, v in scalars["reward/mean"]] == pytest.approx([records[-1]["reward/mean"]])


def test_bad_config_is_refused_naming_the_key(tmp_path):
    # the command line as a user runs it: one line on stderr, a failing exit code
    result = run_subprocess(tmp_path, "rollout.max_new_tokenz=8")
    assert result.returncode != 0
    assert "rollout" in result.stderr and "max_new_tokenz" in result.stderr
    # the same entry point in this process (sys.exit with that line): a bad value, and a
    # setting that needs another
    for override, key in (
        ("algorithm.old_logprobs=sometimes", "algorithm.old_logprobs"),
        ("loss.truncated_is_cap=2.0", "loss.truncated_is_cap"),  # needs recompute
    ):
        with pytest.raises(SystemExit) as exited:
            train_main(["--config", str(TINY_CONFIG), f"train.output_dir={tmp_path}", override])
        assert isinstance(exited.value.code, str) and key in exited.value.code
    assert not (tmp_path / "checkpoints").exists()


def test_an_engine_past_its_deadline_stops_the_run_naming_it(tmp_path):
    from bapo_megatron.rollout.guard import EngineFailure

    with pytest.raises(
        EngineFailure,
        match=r"stopped during rollout step 0 \(generation, rewards\): "
        r"rank 0: EngineFailure: rollout engine 'embedded' of "
        r"data-parallel replica 0: generate gave no result within "
        r"0.001 s",
    ):
        run_in_process(tmp_path, "warmup.steps=0", "rollout.timeout_s=0.001")
    assert read_metrics(tmp_path) == []  # nothing was logged for the step that failed


# family -> config.json fields of the tiny model (Qwen3 with its own head size; Llama 3.2-style
# scaled RoPE with factors that are not megatron-core's fixed ones)
_FAMILY_FIELDS = {
    "llama": dict(model_type="llama"),
    "qwen3-tied": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    "qwen3-untied": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
    "llama32-tied": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters={**hf_models.LLAMA3_ROPE, "original_max_position_embeddings": 32},
    ),
}


def _counting_model_folder(folder, family: str = "llama"):
    """A real HF folder: a tiny random model of ``family`` and the counting tasks' tokenizer, saved
    by transformers."""
    import transformers

    from bapo_megatron.data.synthetic_task import counting_tokenizer

    tokenizer = counting_tokenizer()
    config = transformers.AutoConfig.for_model(
        **_FAMILY_FIELDS[family],
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _prompt_file(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("family", ["qwen3-tied", "qwen3-untied", "llama32-tied"])
def test_training_starts_from_an_hf_folder_of_each_family(tmp_path, family):
    model = tmp_path / "model"
    _counting_model_folder(model, family)
    data = _prompt_file(tmp_path / "train.jsonl", [{"prompt": "7>12", "answer": "8 9 10 11 12"}])
    records = run_in_process(
        tmp_path / "run",
        "model=null",
        f"train.model_path={model}",
        "data.synthetic_task=null",
        f"data.train_file={data}",
        "warmup.steps=0",
        "train.steps=1",
        "rollout.prompts_per_step=2",
        "algorithm.optimizer_steps_per_rollout=1",
    )
    [step] = optimizer_records(records)
    [rollout] = rollout_records(records)
    assert math.isfinite(step["loss"]) and math.isfinite(step["entropy"])
    # the engine sampled with the actor's model: behaviour and actor log-probs agree
    assert rollout["logprob_diff/tokens"] > 0 and rollout["logprob_diff/max_abs"] < 1e-5
    assert abs(step["bapo/ratio_min"] - 1) < 1e-5 and abs(step["bapo/ratio_max"] - 1) < 1e-5


def test_verl_data_and_reward_train_unchanged(tmp_path):
    """A verl-format parquet file (chat messages, the answer in `reward_model`, `data_source`,
    `extra_info`) and a verl `compute_score` that dispatches on the data source and returns a
    dict: the run reads the answer at its dotted path, hands each check its row, and logs the
    dict's numbers as `reward/<key>`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "model"
    _counting_model_folder(model)
    rows = [
        {
            "data_source": "count_to",
            "prompt": [{"role": "user", "content": "7>12"}],
            "reward_model": {"style": "rule", "ground_truth": "8 9 10 11 12"},
            "extra_info": {"index": 7},
        },
        {
            "data_source": "words",
            "prompt": [{"role": "user", "content": "3>5"}],
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"index": 8},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    records = run_in_process(
        tmp_path / "run",
        "model=null",
        f"train.model_path={model}",
        "data.synthetic_task=null",
        f"data.train_file={tmp_path / 'train.parquet'}",
        "data.answer_key=reward_model.ground_truth",
        "reward.name=tests.helpers.verl_rewards:compute_score",
        "warmup.steps=0",
        "train.steps=1",
        "rollout.prompts_per_step=2",
        "algorithm.optimizer_steps_per_rollout=1",
    )
    [rollout] = rollout_records(records)
    assert rollout["reward/errors"] == 0  # both data sources dispatched
    # `index` is returned for the `count_to` row only (its extra_info), `words` for the other
    assert rollout["reward/index"] == 7.0 and rollout["reward/words"] >= 0
    assert 0 <= rollout["reward/acc"] <= 1 and "reward/pred" not in rollout  # text: not logged


def test_prompt_file_and_hf_model_with_bad_rows(tmp_path):
    model = tmp_path / "model"
    _counting_model_folder(model)
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "7>12", "answer": "8 9 10 11 12"},
        {"prompt": "", "answer": "1"},
        {"prompt": "3>1", "answer": "2 1", "id": "q3"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    common = [
        "model=null",
        f"train.model_path={model}",
        "data.synthetic_task=null",
        f"data.train_file={data}",
        "warmup.steps=0",
        "train.steps=2",
        "rollout.prompts_per_step=2",
        "algorithm.optimizer_steps_per_rollout=1",
    ]
    result = run_subprocess(tmp_path / "strict", *common)
    assert result.returncode != 0
    assert f"{data}:2" in result.stderr and "'prompt'" in result.stderr
    records = run_in_process(tmp_path / "skip", *common, "data.skip_bad_rows=true")
    assert len(rollout_records(records)) == 2
    assert [r["data/skipped_rows"] for r in rollout_records(records)] == [2, 2]  # "" and "not json"
    assert read_metrics(tmp_path / "skip")[-1]["rollout_step"] == 2
