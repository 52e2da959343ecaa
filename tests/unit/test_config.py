"""Typed configuration: presets, validation messages, YAML and dotted overrides."""

from __future__ import annotations

import pytest

from bapo_megatron.config import ClipSearchConfig, Config, check_training
from bapo_megatron.config.loading import load_config
from tests.helpers.tiny_models import tiny_model_overrides


def test_presets_match_the_spec():
    paper = ClipSearchConfig.from_preset("paper")
    assert (paper.c_low_start, paper.c_low_max, paper.c_low_step) == (0.6, 0.9, 0.02)
    assert (paper.c_high_start, paper.c_high_max, paper.c_high_step) == (1.2, 3.0, 0.05)
    assert (paper.schedule, paper.semantics, paper.target_unit, paper.target) == (
        "paper",
        "gradient",
        "share",
        0.4,
    )
    assert paper.dual_clip is None
    ref = ClipSearchConfig.from_preset("reference")
    assert (ref.c_low_start, ref.c_low_max, ref.c_low_step) == (0.6, 0.8, 0.05)
    assert (ref.c_high_start, ref.c_high_max, ref.c_high_step) == (1.2, 2.0, 0.05)
    assert (ref.schedule, ref.semantics, ref.target_unit, ref.target) == (
        "reference",
        "surrogate",
        "ratio",
        1.0,
    )
    assert ref.dual_clip == 3.0


def test_yaml_with_preset_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "loss:\n  aggregation: seq-mean-token-mean\n"
        "  clip:\n    preset: reference\n    c_high_max: 2.5\n"
    )
    cfg = load_config(path, ["loss.clip.dual_clip=null", "loss.clip.target=1.5"])
    assert isinstance(cfg, Config)
    assert cfg.loss.aggregation == "seq-mean-token-mean"
    clip = cfg.loss.clip
    assert (clip.preset, clip.schedule, clip.c_high_max, clip.dual_clip, clip.target) == (
        "reference",
        "reference",
        2.5,
        None,
        1.5,
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["loss.clip.c_hgh_max=2"], "loss.clip: unknown field"),
        (["loss.clip.c_high_max=abc"], "loss.clip.c_high_max: expected a number"),
        (["loss.clip.preset=ppo"], "loss.clip.preset must be one of"),
        (["loss.clip.schedule=fast"], "loss.clip.schedule: expected one of"),
        (["loss.aggregation=mean"], "loss.aggregation: expected one of"),
        (["loss.clip.c_low_max=0.5"], "c_low_start <= c_low_max"),
        (["loss.clip.c_high_start=0.9"], "1 <= c_high_start"),
        (["loss.clip.c_low_step=0"], "loss.clip.c_low_step must be > 0"),
        (["loss.clip.target=1.5"], "loss.clip.target is a share"),
        (["loss.clip.dual_clip=0.5"], "loss.clip.dual_clip must be > 1"),
        (["loss.clip=3"], "loss.clip: expected a mapping"),
        (["loss.clip.target"], "expected dotted.key=value"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


# Each ill-typed value, written once as YAML: (dotted key, YAML text of the value, expected in
# the message).
ILL_TYPED = [
    (
        "optimizer.lr",
        "'0.001'",
        "expected a number (float), got '0.001' (a string: a quoted number",
    ),
    ("optimizer.lr", '"1e-3"', "expected a number (float), got '1e-3' (a string"),
    ("rollout.max_new_tokens", "'64'", "expected an integer, got '64' (a string"),
    ("optimizer.lr", "[0.001]", "expected a number (float), got [0.001] (a list)"),
    (
        "rollout.max_new_tokens",
        "{tokens: 64}",
        "expected an integer, got {'tokens': 64} (a mapping)",
    ),
    ("optimizer.lr", "true", "expected a number (float), got true (a boolean)"),
    ("rollout.max_new_tokens", "false", "expected an integer, got false (a boolean)"),
    ("rollout.max_new_tokens", "2.5", "expected an integer, got 2.5 (a float)"),
    ("rollout.max_new_tokens", "2.0", "expected an integer, got 2.0 (a float)"),
    ("rollout.max_new_tokens", "1e3", "expected an integer, got 1000.0 (a float)"),
    ("optimizer.lr", "null", "expected a number (float), got null"),
    ("rollout.max_new_tokens", "null", "expected an integer, got null"),
    ("train.output_dir", "null", "expected a string, got null"),
    ("train.output_dir", "7", "expected a string, got 7 (an integer)"),
    ("data.shuffle", "1", "expected true or false, got 1 (an integer)"),
    ("data.shuffle", "'true'", "expected true or false, got 'true' (a string)"),
    ("loss.aggregation", "null", "expected one of ['token-mean'"),
    ("loss.aggregation", "[token-mean]", "expected one of ['token-mean'"),
    ("loss.clip.dual_clip", "'2'", "expected a number (float), got '2' (a string"),
    ("loss.clip.dual_clip", "[2]", "expected a number (float), got [2] (a list)"),
    ("rollout.server_urls", "{a: 1}", "expected a list of strings, got {'a': 1} (a mapping)"),
    ("rollout.server_urls", "null", "expected a list of strings, got null"),
    ("rollout.server_urls[1]", "[http://a, 8000]", "expected a string, got 8000 (an integer)"),
    ("rollout.timeout_s", "soon", "expected a number (float), got 'soon' (a string)"),
    ("rollout.timeout_s", "true", "expected a number (float), got true (a boolean)"),
    ("model.tie_word_embeddings", "'yes'", "expected true or false, got 'yes' (a string)"),
    ("algorithm.rollout_lag", "1.0", "expected an integer, got 1.0 (a float)"),
]


def _nested_yaml(dotted: str, value: str) -> str:
    *sections, name = dotted.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    return "\n".join(lines + [f"{'  ' * len(sections)}{name}: {value}"]) + "\n"


@pytest.mark.parametrize("where", ["yaml", "override"])
@pytest.mark.parametrize("key,value,message", ILL_TYPED)
def test_ill_typed_values_are_refused_with_the_dotted_key(tmp_path, where, key, value, message):
    field = key.partition("[")[0]  # the key the user writes; the message may add an item index
    path = tmp_path / "run.yaml"
    if where == "yaml":
        path.write_text(_nested_yaml(field, value))
        args = (path, [])
    else:
        args = (None, [f"{field}={value}"])
    with pytest.raises(ValueError) as raised:
        load_config(*args)
    assert f"{key}: {message}" in str(raised.value)


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_well_typed_values_are_accepted(tmp_path, where):
    values = {
        "optimizer.lr": "1e-3",
        "optimizer.min_lr": "0",
        "optimizer.adam_eps": "1.0e-6",
        "rollout.max_new_tokens": "64",
        "rollout.server_urls": "http://a:8000",
        "loss.clip.dual_clip": "2",
        "loss.aggregation": "seq-mean-token-sum",
        "data.shuffle": "false",
        "train.max_position_embeddings": "null",
    }
    if where == "yaml":
        path = tmp_path / "run.yaml"
        path.write_text(
            "optimizer:\n  lr: 1e-3\n  min_lr: 0\n  adam_eps: 1.0e-6\n"
            "rollout:\n  max_new_tokens: 64\n  server_urls: http://a:8000\n"
            "loss:\n  aggregation: seq-mean-token-sum\n  clip:\n    dual_clip: 2\n"
            "data:\n  synthetic_task: count_to\n  shuffle: false\n"
            "train:\n  max_position_embeddings: null\n"
        )
        cfg = load_config(path)
    else:
        cfg = load_config(
            None, ["data.synthetic_task=count_to"] + [f"{k}={v}" for k, v in values.items()]
        )
    assert cfg.optimizer.lr == 1e-3 and type(cfg.optimizer.lr) is float
    assert cfg.optimizer.min_lr == 0.0 and type(cfg.optimizer.min_lr) is float
    assert cfg.optimizer.adam_eps == 1e-6
    assert cfg.rollout.max_new_tokens == 64 and type(cfg.rollout.max_new_tokens) is int
    assert cfg.rollout.server_urls == ("http://a:8000",)
    assert cfg.loss.clip.dual_clip == 2.0 and type(cfg.loss.clip.dual_clip) is float
    assert cfg.loss.aggregation == "seq-mean-token-sum"
    assert cfg.data.shuffle is False and cfg.train.max_position_embeddings is None


def test_a_list_fills_a_tuple_field():
    cfg = load_config(None, ["rollout.server_urls=[http://a:1, http://b:2]"])
    assert cfg.rollout.server_urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_unparsable_yaml_names_the_file_or_override(tmp_path, where):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  lr: [1\n")
    args = (path, []) if where == "yaml" else (None, ["optimizer.lr=[1"])
    with pytest.raises(ValueError, match="not valid YAML") as raised:
        load_config(*args)
    assert (str(path) if where == "yaml" else "override 'optimizer.lr=[1'") in str(raised.value)


# A config that passes check_training: a tiny model from random weights on the synthetic task.
TRAINABLE = ["data.synthetic_task=count_to", *tiny_model_overrides()]


def test_the_trainable_config_trains():
    check_training(load_config(None, TRAINABLE))


@pytest.mark.parametrize("value", ["", "'  '"])
def test_an_empty_output_dir_is_refused(value):
    with pytest.raises(ValueError, match=r"train\.output_dir must name a folder") as raised:
        load_config(None, [f"train.output_dir={value}"])
    assert "current directory" in str(raised.value)


def test_a_rollout_lag_that_leaves_no_training_step_is_refused():
    cfg = load_config(None, TRAINABLE + ["algorithm.rollout_lag=5", "train.steps=5"])
    with pytest.raises(ValueError) as raised:
        check_training(cfg)
    assert str(raised.value).startswith(
        "algorithm.rollout_lag (5) must be smaller than train.steps (5): the first 5 rollout steps "
        "only generate"
    )
    check_training(load_config(None, TRAINABLE + ["algorithm.rollout_lag=5", "train.steps=6"]))


def test_one_sample_per_prompt_is_refused_for_training_only():
    cfg = load_config(None, TRAINABLE + ["rollout.samples_per_prompt=1"])  # fine outside training
    with pytest.raises(ValueError) as raised:
        check_training(cfg)
    message = str(raised.value)
    assert message.startswith("rollout.samples_per_prompt=1 cannot train")
    assert "a group of one gives every response the advantage 0" in message
    check_training(load_config(None, TRAINABLE + ["rollout.samples_per_prompt=2"]))


RECOMPUTE = ["algorithm.old_logprobs=recompute"]


@pytest.mark.parametrize(
    "overrides, correction",
    [
        ([], "none"),
        (RECOMPUTE, "none"),
        # configs written before algorithm.off_policy_correction: the cap alone is token-truncate
        (RECOMPUTE + ["loss.truncated_is_cap=2.0"], "token-truncate"),
        (RECOMPUTE + ["algorithm.off_policy_correction=none"], "none"),
        *(
            (
                RECOMPUTE + [f"algorithm.off_policy_correction={name}", "loss.truncated_is_cap=2"],
                name,
            )
            for name in ("token-truncate", "sequence-truncate", "sequence-mask")
        ),
        (
            RECOMPUTE
            + ["algorithm.off_policy_correction=sequence-mask", "loss.truncated_is_cap=1"],
            "sequence-mask",
        ),
    ],
)
def test_the_off_policy_correction_trains_as_named(overrides, correction):
    cfg = load_config(None, TRAINABLE + overrides)
    check_training(cfg)
    assert cfg.resolved_off_policy_correction() == correction


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.off_policy_correction=sequence-truncate", "loss.truncated_is_cap=2"],
            "algorithm.off_policy_correction=sequence-truncate needs "
            "algorithm.old_logprobs=recompute, got 'engine'",
        ),
        (
            ["loss.truncated_is_cap=2"],
            "loss.truncated_is_cap needs algorithm.old_logprobs=recompute",
        ),
        (
            RECOMPUTE + ["algorithm.off_policy_correction=token-truncate"],
            "algorithm.off_policy_correction=token-truncate needs loss.truncated_is_cap",
        ),
        (
            RECOMPUTE + ["algorithm.off_policy_correction=none", "loss.truncated_is_cap=2"],
            "loss.truncated_is_cap=2.0 caps an importance weight, but "
            "algorithm.off_policy_correction=none puts none on the loss",
        ),
        (
            RECOMPUTE
            + ["algorithm.off_policy_correction=sequence-mask", "loss.truncated_is_cap=0.5"],
            "algorithm.off_policy_correction=sequence-mask keeps the sequences whose weight lies "
            "in [1/C, C] with C = loss.truncated_is_cap=0.5",
        ),
    ],
)
def test_an_off_policy_correction_without_its_parts_is_refused(overrides, message):
    cfg = load_config(None, TRAINABLE + overrides)
    with pytest.raises(ValueError) as raised:
        check_training(cfg)
    assert str(raised.value).startswith(message)


def test_an_unknown_off_policy_correction_is_refused_with_the_choices():
    with pytest.raises(ValueError) as raised:
        load_config(None, ["algorithm.off_policy_correction=sequence-clip"])
    assert "algorithm.off_policy_correction" in str(raised.value)
    assert "sequence-clip" in str(raised.value)


@pytest.mark.parametrize(
    "text,key,lines",
    [
        (
            "train:\n  steps: 3\nloss:\n  aggregation: token-mean\ntrain:\n  seed: 1\n",
            "train",
            (1, 5),
        ),
        ("train:\n  steps: 3\n  seed: 1\n  steps: 4\n", "train.steps", (2, 4)),
        (
            "loss:\n  clip:\n    target: 0.3\n    preset: paper\n    target: 0.5\n",
            "loss.clip.target",
            (3, 5),
        ),
        ("rollout:\n  server_urls:\n    - {a: 1, a: 2}\n", "rollout.server_urls[0].a", (3, 3)),
    ],
)
def test_a_key_written_twice_is_refused_with_its_lines(tmp_path, text, key, lines):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as raised:
        load_config(path)
    assert str(raised.value).startswith(
        f"config file {path}: key {key!r} is written twice, on lines {lines[0]} and {lines[1]}"
    )


def test_a_key_written_twice_in_an_override_is_refused():
    with pytest.raises(
        ValueError,
        match=r"override 'loss=\{aggregation: token-mean, aggregation: "
        r"seq-mean-token-sum\}': key 'aggregation' is written twice",
    ):
        load_config(None, ["loss={aggregation: token-mean, aggregation: seq-mean-token-sum}"])


def test_a_merged_key_written_again_is_not_a_duplicate(tmp_path):
    # YAML's merge key: keys written beside `<<` replace the merged ones by design
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  clip:\n    <<: {target: 0.3, c_high_max: 2.5}\n    target: 0.35\n")
    clip = load_config(path).loss.clip
    assert (clip.target, clip.c_high_max) == (0.35, 2.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.weight_transport=folder"],
            r"^rollout\.weight_transport: expected one of \['process-group', 'same-host', "
            r"'shard-to-shard'\], got 'folder'",
        ),
        (
            ["rollout.engine=sglang", "rollout.weight_transport=shard-to-shard"],
            r"^rollout\.weight_transport=shard-to-shard applies to the engines \['embedded', "
            r"'vllm', 'vllm-server'\]; rollout\.engine='sglang' takes whole tensors",
        ),
        (
            ["rollout.weight_transport=same-host"],
            r"^rollout\.weight_transport=same-host applies to server engines .*"
            r"rollout\.engine='embedded'",
        ),
    ],
)
def test_bad_weight_transports_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_server_engines_take_either_weight_transport():
    for transport in ("process-group", "same-host"):
        cfg = load_config(
            None,
            [
                "rollout.engine=vllm-server",
                "rollout.server_urls=[http://a:1]",
                f"rollout.weight_transport={transport}",
            ],
        )
        assert cfg.rollout.weight_transport == transport
    assert load_config(None, []).rollout.weight_transport == "process-group"
