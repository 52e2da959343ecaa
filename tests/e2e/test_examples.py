"""The example recipes and launch scripts, checked without running them.

The GPU recipes (examples/deepseek-r1-distill-qwen-*, qwen3-*, llama3.2-3b, and the
mixture-of-experts qwen3-30b-a3b and qwen3-235b-a22b) cannot run here: these tests and the layout
planner's (tests/unit/test_layout_planner.py) are all the validation they get. Each is loaded
with ``load_config`` (unknown keys fail), passes ``check_training``, and its parallel layout is
checked against the architecture it names (its published config.json) at the world size its
launch comment gives, as if on an FP8-capable GPU with Transformer Engine. No model is built.
The launch scripts: test_launch_scripts.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from bapo_megatron.config import Config, ModelConfig, check_training
from bapo_megatron.config.checks import check_model
from bapo_megatron.config.loading import load_config
from bapo_megatron.distributed.layout import Accelerator, split_world, validate_layout
from tests.helpers.published_configs import config_path, skip_unless_supported

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"

# What each GPU recipe promises: the published config.json of the model it names
# (tests/data/published_configs), its engine, its model folder's size tag.
GPU_RECIPES = {
    "deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml": {
        "hf_config": "DeepSeek-R1-Distill-Qwen-7B",
        "engine": "vllm",
        "size": "7B",
        "world": 16,
    },
    "deepseek-r1-distill-qwen-32b/train.yaml": {
        "hf_config": "DeepSeek-R1-Distill-Qwen-32B",
        "engine": "vllm",
        "size": "32B",
        "world": 32,
    },
    "deepseek-r1-distill-qwen-7b-tp2-dp8/train.yaml": {
        "hf_config": "DeepSeek-R1-Distill-Qwen-7B",
        "engine": "vllm",
        "size": "7B",
        "world": 16,
    },
    # The recipe the README gives one-node users.
    "deepseek-r1-distill-qwen-7b-tp4-dp2/train.yaml": {
        "hf_config": "DeepSeek-R1-Distill-Qwen-7B",
        "engine": "vllm",
        "size": "7B",
        "world": 8,
        "one_node": True,
    },
    "qwen3-8b/train.yaml": {"hf_config": "Qwen3-8B", "engine": "vllm", "size": "8B", "world": 16},
    "qwen3-32b/train.yaml": {
        "hf_config": "Qwen3-32B",
        "engine": "vllm",
        "size": "32B",
        "world": 32,
    },
    "llama3.2-3b/train.yaml": {
        "hf_config": "Llama-3.2-3B",
        "engine": "vllm",
        "size": "3B",
        "world": 16,
    },
    "qwen3-30b-a3b/train.yaml": {
        "hf_config": "Qwen3-30B-A3B",
        "engine": "vllm",
        "size": "30B-A3B",
        "world": 8,
        "one_node": True,  # its optimizer state offloaded to the host
    },
    # The engine on servers of its own: 470 GB of bf16 weights leave no room colocated.
    "qwen3-235b-a22b/train.yaml": {
        "hf_config": "Qwen3-235B-A22B",
        "engine": "sglang-server",
        "size": "235B-A22B",
        "world": 64,
    },
}
# Qwen3 and Llama 3.2 run once this checkout reads their families (skipped on that refusal only).
GPU_RECIPE_PARAMS = [
    pytest.param(name, marks=skip_unless_supported(promise["hf_config"]), id=name)
    for name, promise in sorted(GPU_RECIPES.items())
]


def architecture(name: str) -> ModelConfig:
    """The published architecture the recipe ``name`` trains, in bf16."""
    path = config_path(GPU_RECIPES[name]["hf_config"])
    return ModelConfig.from_hf_config(path, params_dtype="bfloat16")


# The disaggregated, asynchronous variants and the colocated recipe each one varies: only the
# fields of ASYNC_FIELDS may differ from it, so the trainer side is the recipe checked above.
ASYNC_RECIPES = {
    f"{folder}/train_async.yaml": f"{folder}/train.yaml"
    for folder in (
        "deepseek-r1-distill-qwen-7b-tp4-dp4",
        "deepseek-r1-distill-qwen-7b-tp2-dp8",
        "deepseek-r1-distill-qwen-32b",
        "qwen3-32b",
    )
}
ASYNC_FIELDS = {
    "rollout.placement",
    "rollout.engine_ranks",
    "rollout.gpu_memory_utilization",  # the engine's GPUs are its own
    "rollout.inflight_update",
    "rollout.sync_interval",
    "algorithm.max_staleness",
    "algorithm.optimizer_steps_per_rollout",  # versions per rollout step, against max_staleness
    "train.output_dir",
}
# The world sizes their launch comments give: trainer nodes x 8 ranks + engine nodes' ranks.
ASYNC_WORLDS = {
    "deepseek-r1-distill-qwen-7b-tp4-dp4/train_async.yaml": 16 + 4,
    "deepseek-r1-distill-qwen-7b-tp2-dp8/train_async.yaml": 16 + 8,
    "deepseek-r1-distill-qwen-32b/train_async.yaml": 32 + 2,
    "qwen3-32b/train_async.yaml": 32 + 2,
}
ASYNC_RECIPE_PARAMS = [
    pytest.param(name, marks=skip_unless_supported(GPU_RECIPES[colocated]["hf_config"]), id=name)
    for name, colocated in sorted(ASYNC_RECIPES.items())
]

CPU_RECIPES = ("tiny_cpu/train.yaml", "tiny_cpu_moe/train.yaml", "smollm2-135m-cpu/train.yaml")
NOT_TRAINING = ("loss.yaml",)  # the loss demo's config: a loss section only

H100_WITH_TE = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=True)
PROMPT_ROOM = 1024  # prompt tokens a recipe must leave room for beside max_new_tokens


def _all_examples() -> list[str]:
    return sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml"))


def _launch_world(text: str) -> tuple[int, int]:
    """(nodes, GPUs per node) from the recipe's launch comment."""
    nodes = re.findall(r"^#.*\bNNODES=(\d+)", text, re.MULTILINE)
    gpus = re.findall(r"^#.*\bGPUS_PER_NODE=(\d+)", text, re.MULTILINE)
    assert len(set(nodes)) == 1 and len(set(gpus)) == 1, (
        "the launch comment must give NNODES= and GPUS_PER_NODE= once"
    )
    return int(nodes[0]), int(gpus[0])


def test_every_example_is_checked_here():
    # A new example must be added to one of the tables above, so that it is checked.
    assert sorted([*GPU_RECIPES, *ASYNC_RECIPES, *CPU_RECIPES, *NOT_TRAINING]) == _all_examples()


@pytest.mark.parametrize("name", _all_examples())
def test_every_example_loads(name):
    cfg = load_config(EXAMPLES / name)
    assert isinstance(cfg, Config)
    if name not in NOT_TRAINING:
        check_training(cfg)


def test_tiny_cpu_example_trains_on_the_cpu():
    cfg = load_config(EXAMPLES / "tiny_cpu" / "train.yaml")
    check_training(cfg)
    assert cfg.rollout.engine == "embedded"
    cpu = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)
    assert validate_layout(cfg.model, cfg.parallel, 1, cpu) == 1


@pytest.mark.parametrize("name", GPU_RECIPE_PARAMS)
def test_gpu_recipe(name):
    promise = GPU_RECIPES[name]
    path = EXAMPLES / name
    text = path.read_text()
    assert "NOT RUN" in text, "a recipe that was never run must say so"
    cfg = load_config(path)
    check_training(cfg)
    model = architecture(name)

    # Weights from an HF folder in bf16, prompts from a file, math reward.
    assert cfg.model is None and cfg.train.model_path.startswith("/")
    assert promise["size"] in Path(cfg.train.model_path).name
    assert cfg.train.params_dtype == "bfloat16"
    assert cfg.data.train_file is not None and cfg.data.synthetic_task is None
    from bapo_megatron.rewards.registry import get_reward

    assert cfg.reward.name == "math" and get_reward(cfg.reward.name)

    # The layout, at the world size the launch comment gives, on H100s with Transformer Engine.
    nodes, gpus_per_node = _launch_world(text)
    world = nodes * gpus_per_node
    assert nodes > 1 or promise.get("one_node"), "a multi-node recipe, unless it says otherwise"
    assert world == promise["world"]
    dp = validate_layout(model, cfg.parallel, world, H100_WITH_TE)
    assert dp >= 1
    assert gpus_per_node % cfg.parallel.tensor_model_parallel_size == 0, (
        "a TP group stays inside a node"
    )
    assert cfg.parallel.sequence_parallel
    assert cfg.parallel.fp8 is None, "FP8 stays off in the recipe (shown commented)"

    # Every replica gets whole mini-batches of whole groups.
    steps = cfg.algorithm.optimizer_steps_per_rollout
    assert cfg.rollout.prompts_per_step % dp == 0
    assert (cfg.rollout.prompts_per_step // dp) % steps == 0
    assert cfg.rollout.max_new_tokens + PROMPT_ROOM <= model.max_position_embeddings

    # The engine the recipe promises (colocated, on GPUs of the engine rank's node, unless a
    # server).
    assert cfg.rollout.engine == promise["engine"]
    assert 0 < cfg.rollout.gpu_memory_utilization < 1
    assert cfg.rollout.engine_tensor_parallel_size <= gpus_per_node
    if cfg.rollout.engine in ("vllm", "sglang"):
        # In process: the engine's workers split the attention heads (vLLM's and SGLang's rule)
        # and take the GPUs from their replica's first rank up to the next replica's first rank
        # at most, never past a node (the layout planner checks the GPUs and their memory).
        check_model(cfg, model)
        parallel = cfg.parallel
        spacing = parallel.tensor_model_parallel_size * parallel.context_parallel_size
        assert cfg.rollout.engine_tensor_parallel_size <= spacing
        assert gpus_per_node % spacing == 0
    if model.is_moe:
        # Experts divided over several ranks, each whole (the weight sync needs it), and routes
        # replayed: the engine's (R3) where it can record them, and the actor's own (R2) with
        # vLLM 0.32, which records routes only on its Model Runner V2, while the full-vocabulary
        # log-prob hook needs its V1 model runner.
        assert cfg.parallel.expert_model_parallel_size > 1
        assert cfg.parallel.expert_tensor_parallel_size == 1
        replay = "trainer" if cfg.rollout.engine == "vllm" else "rollout"
        assert cfg.algorithm.routing_replay == replay

    # The paper's settings (docs/algorithm.md section 10) and an off-policy schedule.
    assert cfg.optimizer.lr == 2e-6
    assert cfg.actor.temperature == 0.6
    assert cfg.loss.clip.preset == "paper"
    assert steps > 1
    assert cfg.checkpoint.interval > 0


@pytest.mark.parametrize("name", GPU_RECIPE_PARAMS)
def test_commented_fp8_line_validates_where_fp8_runs(name):
    path = EXAMPLES / name
    assert re.search(r"^\s*#\s*fp8: hybrid\s*$", path.read_text(), re.MULTILINE)
    cfg = load_config(path, ["parallel.fp8=hybrid"])
    model = architecture(name)
    nodes, gpus_per_node = _launch_world(path.read_text())
    assert validate_layout(model, cfg.parallel, nodes * gpus_per_node, H100_WITH_TE) >= 1
    a100 = dataclasses.replace(H100_WITH_TE, fp8_gpu=False)
    with pytest.raises(ValueError, match="parallel.fp8='hybrid' needs a GPU with FP8"):
        validate_layout(model, cfg.parallel, nodes * gpus_per_node, a100)


def _launch_variable(text: str, name: str) -> int:
    """The one value the launch comment gives the variable ``name`` (it may appear on several
    lines: the torchrun and the Slurm command)."""
    values = set(re.findall(rf"^#.*\b{name}=(\d+)", text, re.MULTILINE))
    assert len(values) == 1, f"the launch comment must give {name}= one value, got {values}"
    return int(values.pop())


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict's leaves by dotted name."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("name", ASYNC_RECIPE_PARAMS)
def test_async_recipe_is_its_colocated_recipe_with_engine_nodes(name):
    colocated = ASYNC_RECIPES[name]
    text = (EXAMPLES / name).read_text()
    assert "NOT RUN" in text, "a recipe that was never run must say so"
    cfg = load_config(EXAMPLES / name)
    check_training(cfg)
    base = load_config(EXAMPLES / colocated)
    ours, theirs = _flat(dataclasses.asdict(cfg)), _flat(dataclasses.asdict(base))
    changed = {key for key in ours if ours[key] != theirs[key]}
    assert changed <= ASYNC_FIELDS, sorted(changed - ASYNC_FIELDS)
    assert cfg.rollout.placement == "disaggregated"
    assert 1 <= cfg.algorithm.max_staleness <= 2
    assert cfg.rollout.engine == base.rollout.engine
    assert cfg.train.output_dir != base.train.output_dir, "a run of its own, in a folder of its own"

    # The world of the launch comment: trainer nodes first, then the engine nodes.
    nodes = _launch_variable(text, "NNODES")
    gpus_per_node = _launch_variable(text, "GPUS_PER_NODE")
    engine_nodes = _launch_variable(text, "ENGINE_NODES")
    engines_per_node = _launch_variable(text, "ENGINE_RANKS_PER_NODE")
    assert re.search(rf"^#.*sbatch --nodes={nodes}\b", text, re.MULTILINE)
    trainer_world = (nodes - engine_nodes) * gpus_per_node
    world = trainer_world + engine_nodes * engines_per_node
    assert world == ASYNC_WORLDS[name]
    split = split_world(cfg.parallel, cfg.rollout, world)
    # The engine ranks are exactly the engine nodes' ranks: no node mixes the two roles.
    assert split.engine_count == engine_nodes * engines_per_node
    node_of_rank = [n for n in range(nodes - engine_nodes) for _ in range(gpus_per_node)]
    node_of_rank += [n for n in range(nodes - engine_nodes, nodes) for _ in range(engines_per_node)]
    for rank, node in enumerate(node_of_rank):
        assert split.is_engine(rank) == (node >= nodes - engine_nodes), rank

    # The trainer's layout over its ranks, as the colocated recipe's over its world.
    model = architecture(colocated)
    dp = validate_layout(model, cfg.parallel, trainer_world, H100_WITH_TE)
    assert dp == split.data_parallel_size == cfg.rollout.engine_ranks
    assert trainer_world == GPU_RECIPES[colocated]["world"]
    steps = cfg.algorithm.optimizer_steps_per_rollout
    assert (cfg.rollout.prompts_per_step // dp) % steps == 0

    # Each engine node holds its engine replicas' GPUs.
    assert engines_per_node * cfg.rollout.engine_tensor_parallel_size <= gpus_per_node
    assert 0 < cfg.rollout.gpu_memory_utilization < 1


@pytest.mark.parametrize(
    "text,field",
    [
        ("rollout:\n  prompts_per_stepp: 16\n", "prompts_per_stepp"),
        ("rolout:\n  prompts_per_step: 16\n", "rolout"),
        ("parallel:\n  tensor_parallel_size: 4\n", "tensor_parallel_size"),
    ],
)
def test_misspelled_key_is_refused_by_name(tmp_path, text, field):
    recipe = (EXAMPLES / "tiny_cpu" / "train.yaml").read_text()
    # into the recipe's own section when it has one: a section written twice is refused as such
    header = re.compile("^" + re.escape(text.partition("\n")[0]) + "\n", re.MULTILINE)
    recipe = header.sub(lambda _: text, recipe, count=1) if header.search(recipe) else recipe + text
    path = tmp_path / "train.yaml"
    path.write_text(recipe)
    with pytest.raises(ValueError, match=rf"unknown field\(s\) \['{field}'\]"):
        load_config(path)
