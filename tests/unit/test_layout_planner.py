"""The layout planner (``bapo-plan-layout``) on the GPU recipes at their real size: one replica's
ranks (every pipeline stage x tensor-parallel rank; the other data-parallel replicas hold the same
shards; for the mixture-of-experts recipes also every expert-parallel rank) built on the meta
device under a fake process group, the export plan over all stages, the shards' distinct
parameters against the published totals, and the memory of every GPU of the world against 80 GB.
Oversized layouts (dense and MoE) and layouts that do not divide are refused with the numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import re
from pathlib import Path

import pytest

from bapo_megatron.config.loading import load_config
from bapo_megatron.planning.cli import main
from bapo_megatron.weights.convert_cli import build_parser as convert_parser
from tests.e2e.test_examples import GPU_RECIPE_PARAMS, GPU_RECIPES
from tests.helpers.published_configs import PUBLISHED_PARAMETERS, config_path, published_config
from tests.helpers.tiny_models import tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@functools.cache
def planner_output(recipe: str, world: int, hf_config: str, *extra: str) -> tuple[int, str, str]:
    """The planner's exit code, stdout and stderr on ``recipe`` (each distinct call runs once
    per session: a large recipe's meta ranks take seconds, and tests share its plan)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                str(EXAMPLES / recipe),
                "--world-size",
                str(world),
                "--hf-config",
                str(config_path(hf_config)),
                *extra,
            ]
        )
    return code, out.getvalue(), err.getvalue()


def run_planner(recipe: str, world: int, hf_config: str, *extra: str):
    """:func:`planner_output` with its last line, the JSON summary, read."""
    code, out, err = planner_output(recipe, world, hf_config, *extra)
    return code, json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.parametrize("name", GPU_RECIPE_PARAMS)
def test_recipe_passes_the_planner(name):
    promise = GPU_RECIPES[name]
    code, summary, err = run_planner(name, promise["world"], promise["hf_config"])
    assert code == 0 and summary["ok"], err
    assert summary["model_parameters"] == PUBLISHED_PARAMETERS[promise["hf_config"]]
    # every tensor of the shards once (replicated norms and routers once, all experts)
    assert summary["shard_parameters"] == PUBLISHED_PARAMETERS[promise["hf_config"]]
    export = summary["export"]
    assert export["complete"] and not export["missing"] and not export["duplicated"]
    worst = summary["worst_rank_memory_gb"]
    assert 0 < worst["total"] <= 80
    parts = ("weights", "gradients", "optimizer", "activations")
    assert all(worst[k] > 0 for k in parts)
    assert worst["optimizer_distributed"] < worst["optimizer_replicated"]


@pytest.mark.parametrize(
    "name,world,hf_config",
    [
        ("qwen3-30b-a3b/train.yaml", 8, "Qwen3-30B-A3B"),
        ("qwen3-235b-a22b/train.yaml", 64, "Qwen3-235B-A22B"),
    ],
)
def test_moe_recipe_ranks_hold_their_experts(name, world, hf_config):
    code, summary, _ = run_planner(name, world, hf_config)
    assert code == 0
    hf = published_config(hf_config)
    loaded = load_config(EXAMPLES / name)
    recipe, offloaded = loaded.parallel, loaded.optimizer.cpu_offload_fraction
    pp, ep = recipe.pipeline_model_parallel_size, recipe.expert_model_parallel_size
    tp, stage = recipe.tensor_model_parallel_size, world // pp
    # Every layer is an MoE layer: per rank, the stage's layers x its experts x 3 matrices.
    per_rank = (
        hf["num_hidden_layers"]
        // pp
        * (hf["num_experts"] // ep)
        * 3
        * hf["hidden_size"]
        * hf["moe_intermediate_size"]
    )
    # Simulated: data-parallel rank 0's TP ranks and expert data-parallel rank 0's EP ranks of
    # each stage; here EP spans the whole stage (expert data parallel 1).
    assert stage == ep and tp < ep
    assert summary["simulated_ranks"] == list(range(world))
    assert summary["expert_parameters_per_rank"] == {str(r): per_rank for r in range(world)}
    # The experts of all ranks are the model's experts, once (expert data parallel 1).
    experts = hf["num_hidden_layers"] * hf["num_experts"] * 3 * hf["hidden_size"]
    experts *= hf["moe_intermediate_size"]
    assert world * per_rank == experts
    assert summary["expert_data_parallel_size"] == 1
    worst = summary["worst_rank_memory_gb"]
    assert worst["expert_weights"] == round(per_rank * 2 / 1e9, 2)  # bf16
    assert worst["expert_gradients"] == round(per_rank * 4 / 1e9, 2)  # fp32 buffers
    # Not sharded (EDP 1): fp32 main weights and two moments, the offloaded moments on the host.
    moved = math.ceil(per_rank * offloaded)
    assert worst["expert_optimizer"] == round((per_rank * 12 - moved * 8) / 1e9, 2)
    assert worst["optimizer_host"] >= round(moved * 16 / 1e9, 2)
    assert worst["dispatcher"] > 0 and worst["activations"] > 0
    # the conversion at the recipe's layout: the command the planner prints is the one the
    # recipe's header quotes, and the converter takes it
    command = summary["conversion_command"]
    assert command in recipe_commands(EXAMPLES / name)
    words = command.split("tools/convert_checkpoint.py ")[1].split()
    parsed = convert_parser().parse_args(words)
    want = (tp, pp, ep, recipe.expert_tensor_parallel_size)
    assert (parsed.tp, parsed.pp, parsed.ep, parsed.etp) == want
    assert parsed.hf == loaded.train.model_path and parsed.params_dtype == "bfloat16"
    # the fewest processes that hold the layout: PP x lcm(TP, EP x ETP), the world here
    launched = re.search(r"(?:--nnodes (\d+) )?--nproc-per-node (\d+)", command)
    assert int(launched.group(1) or 1) * int(launched.group(2)) == world


@pytest.mark.parametrize(
    "layout, want",
    [
        ([], "torchrun --nproc-per-node 1 {tool}"),
        (
            ["tensor_model_parallel_size=2", "expert_model_parallel_size=4"],
            "torchrun --nproc-per-node 4 {tool} --tp 2 --ep 4",
        ),
        (
            ["pipeline_model_parallel_size=2", "expert_model_parallel_size=8"],
            "torchrun --nnodes 2 --nproc-per-node 8 --node-rank <0..1> --master-addr "
            "<node 0 address> {tool} --pp 2 --ep 8",
        ),
        (  # 12 processes do not fill nodes of 8 GPUs: one machine's CPU
            ["tensor_model_parallel_size=4", "expert_model_parallel_size=3"],
            "BAPO_DEVICE=cpu torchrun --nproc-per-node 12 {tool} --tp 4 --ep 3",
        ),
    ],
)
def test_conversion_command_launches_the_fewest_processes_of_the_layout(layout, want):
    from bapo_megatron.planning.conversion import conversion_command

    overrides = ["model=null", "data.train_file=x.jsonl", "train.model_path=/m/"]
    config = load_config(None, overrides + [f"parallel.{field}" for field in layout])
    tool = "tools/convert_checkpoint.py hf-to-megatron /m /m-megatron"
    assert conversion_command(config, gpus_per_node=8) == want.format(tool=tool)


def recipe_commands(recipe: Path) -> list[str]:
    """The commands quoted in a recipe's header comment (indented lines, continuations
    joined)."""
    header = [line[1:] for line in recipe.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.startswith("   ")]


@pytest.mark.parametrize(
    "name,hf_config,overrides,needs",
    [
        # 30B-A3B on one node without the offload its recipe sets: 18 bytes per parameter is
        # 70 GB per GPU before anything else.
        (
            "qwen3-30b-a3b/train.yaml",
            "Qwen3-30B-A3B",
            ["optimizer.cpu_offload_fraction=0"],
            85,
        ),
        # 235B-A22B on one node: 16 experts of each of the 94 layers per GPU.
        (
            "qwen3-235b-a22b/train.yaml",
            "Qwen3-235B-A22B",
            ["parallel.pipeline_model_parallel_size=1", "parallel.expert_model_parallel_size=8"],
            500,
        ),
    ],
    ids=["30b-a3b", "235b-a22b"],
)
def test_oversized_moe_layout_is_refused_with_the_numbers(name, hf_config, overrides, needs):
    code, summary, err = run_planner(name, 8, hf_config, *overrides)
    assert code == 1 and not summary["ok"]
    [problem] = [p for p in summary["problems"] if p.startswith("memory:")]
    worst = summary["worst_rank_memory_gb"]
    assert worst["total"] > needs
    assert f"needs {worst['total']:.2f} GB > 80.00 GB per GPU" in problem
    assert (
        f"of which experts: weights {worst['expert_weights']:.2f} + gradients "
        f"{worst['expert_gradients']:.2f} + optimizer {worst['expert_optimizer']:.2f} GB"
    ) in problem
    assert f"dispatcher {worst['dispatcher']:.2f}" in problem
    assert "REFUSED: memory:" in err
    # The experts' state alone is past the GPU: EP8 on 8 GPUs leaves no expert data parallel
    # to shard it over.
    assert summary["expert_data_parallel_size"] == 1
    assert worst["expert_weights"] + worst["expert_gradients"] + worst["expert_optimizer"] > 60


def test_one_node_moe_recipe_keeps_its_optimizer_state_on_the_host():
    code, out, _ = planner_output("qwen3-30b-a3b/train.yaml", 8, "Qwen3-30B-A3B")
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0
    worst = summary["worst_rank_memory_gb"]
    # Everything offloaded: of the fp32 main weights and two moments, the main weights stay.
    state = worst["optimizer_distributed"]  # 12 bytes per element, without offload
    assert worst["optimizer"] == pytest.approx(state / 3, abs=0.01)
    assert worst["optimizer_host"] == pytest.approx(state * 16 / 12, abs=0.02)
    # One node: its 8 ranks' host shares together (the dense shards differ by padding only).
    [node] = summary["host_optimizer_gb_per_node"]
    assert node == pytest.approx(8 * worst["optimizer_host"], rel=0.01)
    assert "host memory (optimizer.cpu_offload_fraction=1.0): up to" in out
    assert f"{node:.2f} GB on the fullest node of 8 GPUs" in out
    # room left for what the planner does not count, its activations measured low included
    assert worst["total"] <= 70


def test_moe_layout_whose_experts_do_not_divide_is_refused():
    code, summary, _ = run_planner(
        "qwen3-30b-a3b/train.yaml",
        12,
        "Qwen3-30B-A3B",
        "parallel.expert_model_parallel_size=3",
    )
    assert code == 1
    [problem] = summary["problems"]
    assert problem.startswith("layout: model.moe.num_experts (128) is not divisible by ")
    assert "parallel.expert_model_parallel_size (3)" in problem


def test_7b_recipe_ranks_hold_a_quarter_each():
    code, summary, _ = run_planner(
        "deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml", 16, "DeepSeek-R1-Distill-Qwen-7B"
    )
    assert code == 0
    # TP4 x DP4: one replica = ranks 0-3; each holds 1/4 of every split tensor and all norms.
    assert summary["simulated_ranks"] == [0, 1, 2, 3]
    counts = set(summary["parameters_per_rank"].values())
    assert len(counts) == 1
    (per_rank,) = counts
    norms = (2 * 28 + 1) * 3584
    assert per_rank == (7_615_616_512 - norms) // 4 + norms


def test_32b_recipe_simulates_every_stage_and_tensor_rank():
    code, summary, _ = run_planner(
        "deepseek-r1-distill-qwen-32b/train.yaml", 32, "DeepSeek-R1-Distill-Qwen-32B"
    )
    assert code == 0
    # TP8 x PP2 x DP2 in Megatron's order tp-cp-ep-dp-pp: replica 0 = ranks 0-7 and 16-23.
    assert summary["simulated_ranks"] == [*range(8), *range(16, 24)]
    total = sum(summary["parameters_per_rank"].values())
    norms = (2 * 64 + 1) * 5120
    assert total == 32_763_876_352 + 7 * norms  # norms are replicated over the 8 TP ranks


def test_oversized_recipe_is_refused_with_the_numbers():
    # The 32B recipe squeezed onto one node: TP8 alone, no distributed optimizer.
    code, summary, err = run_planner(
        "deepseek-r1-distill-qwen-32b/train.yaml",
        8,
        "DeepSeek-R1-Distill-Qwen-32B",
        "parallel.pipeline_model_parallel_size=1",
        "optimizer.use_distributed_optimizer=false",
        "rollout.prompts_per_step=32",
    )
    assert code == 1 and not summary["ok"]
    [problem] = [p for p in summary["problems"] if p.startswith("memory:")]
    assert (
        "GB > 80.00 GB per GPU" in problem and "optimizer" in problem and "activations" in problem
    )
    assert "REFUSED: memory:" in err
    assert summary["worst_rank_memory_gb"]["total"] > 80


def test_smaller_gpu_refuses_what_an_h100_fits():
    code, summary, _ = run_planner(
        "deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml",
        16,
        "DeepSeek-R1-Distill-Qwen-7B",
        "--gpu-memory-gb",
        "40",
    )
    assert code == 1 and any("40.00 GB per GPU" in p for p in summary["problems"])


def test_layout_that_does_not_divide_is_refused():
    code, summary, _ = run_planner(
        "deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml",
        12,
        "DeepSeek-R1-Distill-Qwen-7B",
        "parallel.tensor_model_parallel_size=3",
        "parallel.sequence_parallel=true",
    )
    assert code == 1
    assert summary["problems"][0].startswith("layout: ")
    assert "tensor_model_parallel_size (3)" in summary["problems"][0]


def test_bad_input_exits_2(capsys):
    code = main(
        [
            str(EXAMPLES / "deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml"),
            "--world-size",
            "16",
            "--hf-config",
            "/nonexistent/config.json",
        ]
    )
    out = capsys.readouterr()
    assert code == 2 and "does not exist" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["ok"] is False


def test_a_token_budget_plans_rows_of_the_budget_without_an_attention_term():
    """Packed rows under a token budget: the planner's worst case is a row of the budget (or
    of one sequence over it), with as many rows as whole sequences at the cap need, and its
    fused-attention estimate grows linearly with the row, with no s x s term."""
    from bapo_megatron.config import ActorConfig, ParallelConfig
    from bapo_megatron.planning.activations import layer_bytes, training_shape

    packed = ActorConfig(pack_sequences=True, max_tokens_per_microbatch=4096)
    shape = training_shape(packed, sequence_length=1000, sequences=10)
    assert (shape.micro_batch_size, shape.sequence_length, shape.micro_batches) == (1, 4096, 3)
    over = training_shape(packed, sequence_length=5000, sequences=10)  # each alone, over budget
    assert (over.sequence_length, over.micro_batches) == (5000, 10)
    padded = training_shape(ActorConfig(micro_batch_size=4), sequence_length=1000, sequences=10)
    assert (padded.micro_batch_size, padded.sequence_length, padded.micro_batches) == (4, 1000, 3)
    model = tiny_model(model_type="qwen2", max_position_embeddings=8192)
    for attention in ("sdpa", "flash"):
        one, two = (
            layer_bytes(
                model,
                ParallelConfig(),
                dataclasses.replace(shape, attention=attention, sequence_length=length),
            )
            for length in (2048, 4096)
        )
        assert two == 2 * one


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_planner_pauses_the_garbage_collector_and_gives_it_back(enabled_before, monkeypatch):
    import gc

    from bapo_megatron.planning import plan as planning

    class Seen(Exception):
        pass

    def replica(*_):
        raise Seen(gc.isenabled())

    monkeypatch.setattr(planning, "_replica", replica)
    promise = GPU_RECIPES["deepseek-r1-distill-qwen-32b/train.yaml"]
    config = load_config(EXAMPLES / "deepseek-r1-distill-qwen-32b/train.yaml")
    model = planning.ModelConfig.from_hf_config(config_path(promise["hf_config"]))
    (gc.enable if enabled_before else gc.disable)()
    try:
        with pytest.raises(Seen) as seen:
            planning.plan_layout(config, model, promise["world"])
        assert seen.value.args == (False,)  # off while the ranks are built
        assert gc.isenabled() == enabled_before  # as it was, also after an error
    finally:
        gc.enable()


@pytest.mark.parametrize("engine_tp,bound", [(2, 0.55), (4, 0.30)])
def test_shard_to_shard_sync_sends_each_engine_rank_its_shard_only(engine_tp, bound):
    code, summary, err = run_planner(
        "deepseek-r1-distill-qwen-32b/train.yaml",
        32,
        "DeepSeek-R1-Distill-Qwen-32B",
        "--engine-tp",
        str(engine_tp),
    )
    assert code == 0, err
    sync = summary["weight_sync"]
    whole = sync["broadcast"]["received_bytes_per_engine_rank"]
    assert whole == 2 * summary["model_parameters"]  # bf16
    received = sync["shard_to_shard"]["received_bytes"]
    replicas = summary["data_parallel_size"]
    assert len(received) == engine_tp * replicas
    assert sync["received_ratio"] <= bound
    # each replica receives the model once, plus the norms every worker keeps whole
    assert whole * replicas <= sum(received.values()) <= whole * replicas * 1.001
    sent = sync["shard_to_shard"]["sent_bytes"]
    assert sum(sent.values()) == sum(received.values())
    assert len(sent) == 32 and max(sent.values()) <= 1.01 * min(sent.values())  # spread evenly
    assert sync["broadcast"]["sent_bytes"]["0"] > 0.4 * whole  # one rank per stage sends it all


def test_a_kl_reference_holds_a_weights_shard_on_the_gpu_or_on_the_host():
    recipe = ("deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml", 16, "DeepSeek-R1-Distill-Qwen-7B")
    plain = run_planner(*recipe)[1]["worst_rank_memory_gb"]
    code, summary, err = run_planner(*recipe, 'algorithm.kl={"coef": 0.01}')
    assert code == 0, err
    held = summary["worst_rank_memory_gb"]
    # the reference is the actor's model on the actor's layout: the same weights shard
    assert held["reference_weights"] == held["weights"] > 0
    assert held["total"] == pytest.approx(plain["total"] + held["weights"], abs=0.02)
    code, summary, err = run_planner(*recipe, 'algorithm.kl={"coef": 0.01, "offload": true}')
    offloaded = summary["worst_rank_memory_gb"]
    assert offloaded["reference_weights"] == 0 and offloaded["reference_host"] == held["weights"]
    assert plain["total"] <= offloaded["total"] < held["total"]
