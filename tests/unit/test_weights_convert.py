"""HF <-> Megatron conversion in one process (TP1/PP1), against transformers itself.

Tiny random Llama, Llama 3.2-style (scaled RoPE), Qwen2 and Qwen3 models (tied and untied) are
built and saved with transformers (tests/helpers/hf_models.py). Converted to Megatron they must
give transformers' logits; converted back they must be bitwise the saved tensors, with config and
tokenizer files byte for byte, and load in transformers. The name map's merge/split and
tensor-parallel slicing are checked against a plain per-head construction of Megatron's layouts.
Bad input must be refused with a message naming the file or tensor, and an interrupted
conversion must leave nothing that looks complete. The layouts TP2/PP1, TP1/PP2, TP2/PP2,
resharding and the live export at TP2/PP2 are in tests/distributed/test_weights_layouts.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bapo_megatron.config import MODEL_TYPES, ModelConfig
from bapo_megatron.files.atomic import staging_path
from bapo_megatron.models.name_maps import (
    NAME_MAPS,
    chunk_parameters,
    megatron_shape,
    merge,
    name_map_for,
    place_shard,
    split,
    tp_slice,
)
from bapo_megatron.weights import megatron_checkpoint
from bapo_megatron.weights.convert import hf_to_megatron, load_hf_weights, megatron_to_hf
from bapo_megatron.weights.export import export_weights, plan_buckets, rule_nbytes
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint, read_model_config
from tests.helpers import hf_models


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """variant -> (saved HF folder, transformers' logits on hf_models.tokens())."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, variant in enumerate(hf_models.VARIANTS):
        model = hf_models.save_hf_folder(root / variant, variant, seed=seed)
        out[variant] = (root / variant, hf_models.hf_logits(model))
    return out


def megatron_logits(chunk: torch.nn.Module) -> torch.Tensor:
    ids, positions = hf_models.tokens()
    with torch.no_grad():
        return chunk(ids, positions, None).float()


# ------------------------------------------------------------------------ name maps (pure)


def test_registry_is_keyed_by_model_type_and_refuses_unknown_ones():
    assert set(NAME_MAPS) == set(MODEL_TYPES)
    assert all(name_map.model_type == key for key, name_map in NAME_MAPS.items())
    with pytest.raises(ValueError, match=r"no name map for HF model_type 'mistral'.*'llama'"):
        name_map_for("mistral")


@pytest.mark.parametrize("variant", list(hf_models.VARIANTS))
def test_name_map_names_and_shapes_are_those_of_transformers(variant):
    hf = hf_models.build_hf_model(variant)
    model = read_model_config_from(hf)
    expected = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    if model.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the same matrix as the embedding; not saved
    assert name_map_for(model.model_type).hf_shapes(model) == expected


def read_model_config_from(hf_model: torch.nn.Module) -> ModelConfig:
    config = hf_model.config.to_dict()
    return ModelConfig.from_hf_config(config, rope_theta=config["rope_parameters"]["rope_theta"])


def megatron_qkv_reference(q, k, v, groups: int) -> torch.Tensor:
    """Megatron's fused q/k/v rows built head by head: per query group, its q heads, then k,
    then v (head size d = rows of k per group)."""
    d = k.shape[0] // groups
    per_group = q.shape[0] // d // groups
    rows = []
    for g in range(groups):
        rows += [q[(g * per_group + h) * d : (g * per_group + h + 1) * d] for h in range(per_group)]
        rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (4, 4, 4), (6, 1, 1)])
def test_qkv_merge_split_and_tp_slices_follow_megatron_layout(heads, groups, tp):
    d, hidden = 4, heads * 4
    model = ModelConfig(
        model_type="qwen2",
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=8,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=8,
    )
    rules = {r.megatron: r for r in name_map_for("qwen2").rules(model)}
    gen = torch.Generator().manual_seed(0)
    for name in ("weight", "bias"):
        rule = rules[f"decoder.layers.0.self_attention.linear_qkv.{name}"]
        rest = (hidden,) if name == "weight" else ()
        q = torch.randn(heads * d, *rest, generator=gen)
        k, v = (torch.randn(groups * d, *rest, generator=gen) for _ in range(2))
        whole = megatron_qkv_reference(q, k, v, groups)
        assert torch.equal(merge(rule, [q, k, v], model), whole)
        assert all(torch.equal(a, b) for a, b in zip(split(rule, whole, model), (q, k, v)))
        # Megatron's TP shard of the fused tensor is a contiguous block of whole groups; it is
        # the merge of each rank's slices of q, k and v, and place_shard puts it back
        placed = [torch.zeros_like(t) for t in (q, k, v)]
        for rank in range(tp):
            slices = [t[tp_slice(rule, t.shape[0], rank, tp)] for t in (q, k, v)]
            shard = merge(rule, slices, model)
            assert torch.equal(shard, whole.chunk(tp)[rank])
            assert tuple(shard.shape) == megatron_shape(rule, model, tp)
            assert all(torch.equal(a, b) for a, b in zip(split(rule, shard, model), slices))
            place_shard(rule, placed, shard, rank, model)
        assert all(torch.equal(a, b) for a, b in zip(placed, (q, k, v)))


def test_gate_up_and_row_parallel_slices():
    model = ModelConfig(
        model_type="llama",
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=6,
        num_attention_heads=2,
        num_query_groups=2,
        vocab_size=8,
    )
    rules = {r.megatron: r for r in name_map_for("llama").rules(model)}
    fc1, fc2 = (
        rules["decoder.layers.0.mlp.linear_fc1.weight"],
        rules["decoder.layers.0.mlp.linear_fc2.weight"],
    )
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    assert torch.equal(merge(fc1, [gate, up], model), torch.cat([gate, up]))
    placed = [torch.zeros(6, 8), torch.zeros(6, 8), torch.zeros(8, 6)]
    for rank in range(2):  # rank r holds [gate_r; up_r] and the columns r of down
        shard = merge(fc1, [gate[tp_slice(fc1, 6, rank, 2)], up[tp_slice(fc1, 6, rank, 2)]], model)
        rows = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(shard, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(down[:, tp_slice(fc2, 6, rank, 2)], down[:, 3 * rank : 3 * rank + 3])
        place_shard(fc1, placed[:2], shard, rank, model)
        place_shard(fc2, placed[2:], down[:, 3 * rank : 3 * rank + 3], rank, model)
    assert all(torch.equal(a, b) for a, b in zip(placed, (gate, up, down)))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        tp_slice(fc1, 6, 0, 4)


def test_bucket_plan_keeps_order_and_bound():
    model = read_model_config_from(hf_models.build_hf_model("qwen2-tied"))
    rules = name_map_for("qwen2").rules(model)
    exported = [r for r in rules if r.exported]
    assert len(exported) == len(rules) - 1  # the tied output layer is not exported
    bound = 40_000
    buckets = plan_buckets(rules, model, bound, element_size=4)
    assert [r for bucket in buckets for r in bucket] == exported
    sizes = [sum(rule_nbytes(r, model, 4) for r in bucket) for bucket in buckets]
    assert all(size <= bound or len(bucket) == 1 for size, bucket in zip(sizes, buckets))
    assert any(size > bound for size in sizes)  # the 32 KB embedding + ... forces a lone bucket
    # greedy: the next bucket's first rule did not fit
    assert all(
        sizes[i] + rule_nbytes(buckets[i + 1][0], model, 4) > bound for i in range(len(buckets) - 1)
    )
    assert len(plan_buckets(rules, model, 1, 4)) == len(exported)


# ------------------------------------------------------------------------ conversion


@pytest.mark.parametrize("variant", list(hf_models.VARIANTS))
def test_hf_to_megatron_gives_transformers_logits_and_round_trips_bitwise(
    variant, hf_folders, context, tmp_path
):
    source, reference = hf_folders[variant]
    model, [chunk] = hf_to_megatron(source, tmp_path / "megatron", context)
    assert model.params_dtype == "float32" and model.rope_theta in (1e6, 5e5, 1e4)
    torch.testing.assert_close(megatron_logits(chunk), reference, rtol=0, atol=1e-5)
    names = dict(chunk_parameters(chunk))
    assert ("output_layer.weight" in names) == (not model.tie_word_embeddings)

    megatron_to_hf(tmp_path / "megatron", tmp_path / "back", context, max_shard_bytes=30_000)
    original, back = hf_models.read_hf_tensors(source), hf_models.read_hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name in original:
        assert back[name].dtype == original[name].dtype, name
        assert torch.equal(back[name].view(torch.uint8), original[name].view(torch.uint8)), name
    for file in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (tmp_path / "back" / file).read_bytes() == (source / file).read_bytes(), file
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert len(set(index["weight_map"].values())) > 1  # sharded at the requested size

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    torch.testing.assert_close(hf_models.hf_logits(reloaded), reference, rtol=0, atol=0)
    # (AutoTokenizer would pick Qwen2's BPE class for the word-level test vocabulary)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "back")
    assert tokenizer("w5 w7")["input_ids"] == [5, 7]


def test_bfloat16_checkpoint_round_trips_bitwise_and_can_widen(tmp_path, context):
    source = tmp_path / "hf-bf16"
    hf_models.save_hf_folder(source, "qwen2-untied", seed=3, dtype=torch.bfloat16)
    model, [chunk] = hf_to_megatron(source, tmp_path / "bf16", context)
    assert model.params_dtype == "bfloat16"
    # every parameter in bf16, the local spec's norm weights too
    assert all(p.dtype == torch.bfloat16 for n, p in chunk_parameters(chunk))
    megatron_to_hf(tmp_path / "bf16", tmp_path / "back", context)
    original = hf_models.read_hf_tensors(source)
    back = hf_models.read_hf_tensors(tmp_path / "back")
    assert all(
        torch.equal(back[k].view(torch.int16), original[k].view(torch.int16)) for k in original
    )
    assert (tmp_path / "back" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    # float32 Megatron weights from bf16 HF weights (exact), exported as float32: the config's
    # dtype follows the weights
    hf_to_megatron(source, tmp_path / "fp32", context, params_dtype="float32")
    megatron_to_hf(tmp_path / "fp32", tmp_path / "wide", context, dtype="float32")
    wide = hf_models.read_hf_tensors(tmp_path / "wide")
    assert all(
        wide[k].dtype == torch.float32 and torch.equal(wide[k], original[k].float())
        for k in original
    )
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["dtype"] == "float32"


def test_live_export_at_tp1_is_bounded_versioned_and_converts_dtype(hf_folders, context, tmp_path):
    source, _ = hf_folders["llama-untied"]
    model, chunks = hf_to_megatron(source, tmp_path / "megatron", context)
    original = hf_models.read_hf_tensors(source)
    bound = 50_000
    buckets = list(
        export_weights(chunks, model, context, version=7, bucket_bytes=bound, dtype=torch.bfloat16)
    )
    assert [b.index for b in buckets] == list(range(len(buckets))) and buckets[-1].last
    assert all(b.version == 7 and b.pipeline_rank == 0 for b in buckets)
    assert all(b.nbytes <= bound for b in buckets) and len(buckets) > 2
    exported = {name: t for b in buckets for name, t in b.tensors.items()}
    assert list(exported) == list(name_map_for("llama").hf_shapes(model))  # HF order
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, original[name].to(torch.bfloat16))
        for name, t in exported.items()
    )
    with pytest.raises(ValueError, match="transport must be 'auto', 'collective' or"):
        list(export_weights(chunks, model, context, version=7, transport="tcp"))
    # the yielded tensors are copies: training the actor does not change an exported bucket
    before = exported["model.norm.weight"].clone()
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)
    assert torch.equal(exported["model.norm.weight"], before)


def _with_transformer_engine_names(chunk: torch.nn.Module) -> None:
    """Move each layer's pre-norm weights where Transformer Engine's spec keeps them (the fused
    ``linear_qkv`` / ``linear_fc1`` own a ``layer_norm_weight``; Megatron's ModelOpt hooks map
    the same pairs), as on a GPU run: TE itself is not installed here."""
    for layer in chunk.decoder.layers:
        for norm, fused in (
            (layer.input_layernorm, layer.self_attention.linear_qkv),
            (layer.pre_mlp_layernorm, layer.mlp.linear_fc1),
        ):
            fused.register_parameter("layer_norm_weight", norm._parameters.pop("weight"))


def test_transformer_engine_parameter_names_export_and_load_like_the_local_ones(
    hf_folders, context, tmp_path
):
    source, _ = hf_folders["qwen2-tied"]
    model, [chunk] = hf_to_megatron(source, tmp_path / "megatron", context)
    local_names = [name for name, _ in chunk_parameters(chunk)]
    _with_transformer_engine_names(chunk)
    raw = [name for name, _ in chunk.named_parameters()]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in raw
    assert not any(
        name.endswith("layernorm.weight") for name in raw if name.startswith("decoder.layers.")
    )
    assert sorted(name for name, _ in chunk_parameters(chunk)) == sorted(local_names)

    original = hf_models.read_hf_tensors(source)
    exported = {
        n: t
        for b in export_weights([chunk], model, context, version=1)
        for n, t in b.tensors.items()
    }
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(t, original[n]) for n, t in exported.items())

    with torch.no_grad():
        for p in chunk.parameters():
            p.zero_()
    with HFCheckpoint.open(source) as hf:
        load_hf_weights([chunk], hf, context)
    reloaded = {
        n: t
        for b in export_weights([chunk], model, context, version=2)
        for n, t in b.tensors.items()
    }
    assert all(torch.equal(t, original[n]) for n, t in reloaded.items())


# ------------------------------------------------------------------------ refusals


def corrupt_copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "corrupt"
    shutil.copytree(source, target)
    return target


def shard_of(folder: Path, tensor: str) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]


def test_unknown_architecture_is_refused(hf_folders, tmp_path):
    folder = corrupt_copy(hf_folders["llama-untied"][0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'mistral' is not supported"):
        HFCheckpoint.open(folder)


def test_missing_and_truncated_shards_are_refused_by_file(hf_folders, tmp_path):
    folder = corrupt_copy(hf_folders["qwen2-tied"][0], tmp_path)
    shard = shard_of(folder, "model.layers.1.mlp.up_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"weight file .*{shard.name} cannot be read.*truncated"):
        HFCheckpoint.open(folder)
    shard.unlink()
    with pytest.raises(
        ValueError,
        match=rf"shard .*{shard.name} \(listed in "
        r"model.safetensors.index.json for tensor ",
    ):
        HFCheckpoint.open(folder)


def test_missing_unexpected_and_misshapen_tensors_are_refused_by_name(hf_folders, tmp_path):
    folder = corrupt_copy(hf_folders["llama-untied"][0], tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = shard_of(folder, name)
    tensors = load_file(str(shard))
    save_file({**tensors, name: tensors[name][:16]}, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=rf"tensor '{name}' has shape \(16, 64\), but "
        r"config.json implies \(32, 64\)",
    ):
        HFCheckpoint.open(folder)
    save_file(
        {k: v for k, v in tensors.items() if k != name} | {"extra.weight": tensors[name]},
        str(shard),
        metadata={"format": "pt"},
    )
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["extra.weight"] = index["weight_map"].pop(name)
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing"):
        HFCheckpoint.open(folder)
    index["weight_map"][name] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError,
        match=rf"puts tensor '{name}' in .*{shard.name}, which does "
        "not contain it",
    ):
        HFCheckpoint.open(folder)
    save_file(
        tensors | {"extra.weight": tensors[name].clone()}, str(shard), metadata={"format": "pt"}
    )
    with pytest.raises(ValueError, match=r"unexpected tensor 'extra.weight'"):
        HFCheckpoint.open(folder)


def test_other_formats_and_scaled_rope_are_refused(hf_folders, tmp_path):
    folder = corrupt_copy(hf_folders["llama-untied"][0], tmp_path)
    for path in folder.glob("model*.safetensors*"):
        path.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"only safetensors weights are supported, found "
        r"\['pytorch_model.bin'\]",
    ):
        HFCheckpoint.open(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='linear' is not supported"):
        read_model_config(folder)
    # transformers 4 spelling: a top-level rope_theta
    config.pop("rope_parameters")
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 2.5e5}))
    assert read_model_config(folder).rope_theta == 2.5e5


def test_tied_checkpoint_with_a_different_lm_head_is_refused(hf_folders, tmp_path, context):
    folder = corrupt_copy(hf_folders["qwen2-tied"][0], tmp_path)
    shard = shard_of(folder, "model.norm.weight")
    tensors = load_file(str(shard))
    save_file(
        tensors | {"lm_head.weight": torch.zeros(hf_models.VOCAB, hf_models.HIDDEN)},
        str(shard),
        metadata={"format": "pt"},
    )
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron(folder, tmp_path / "out", context)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ staged outputs


def test_interrupted_conversion_leaves_nothing_that_looks_complete(
    hf_folders, tmp_path, context, monkeypatch
):
    source, _ = hf_folders["llama-untied"]
    out = tmp_path / "megatron"
    staging_path(out).mkdir()  # left over by a killed run: cleared, never mistaken for output
    (staging_path(out) / "metadata.json").write_text("{}")

    def killed(state, folder, **kwargs):
        (Path(folder) / "__0_0.distcp").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(megatron_checkpoint.dist_checkpointing, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        hf_to_megatron(source, out, context)
    assert not out.exists() and not staging_path(out).exists()
    monkeypatch.undo()

    hf_to_megatron(source, out, context)
    assert (out / "bapo_checkpoint.json").is_file() and not staging_path(out).exists()
    with pytest.raises(ValueError, match="already exists"):
        hf_to_megatron(source, out, context)
    with pytest.raises(ValueError, match=r"bapo_checkpoint.json does not exist"):
        megatron_to_hf(source, tmp_path / "x", context)


# ------------------------------------------------------------------------ command line


def test_command_line_converts_both_ways_and_reports_bad_input(hf_folders, tmp_path, capsys):
    import os
    import subprocess
    import sys

    from bapo_megatron.weights import convert_cli as cli

    root = Path(__file__).resolve().parents[2]
    source, _ = hf_folders["qwen2-untied"]
    # the tools/ wrapper as a script in its own process (the checkout importable, as installed)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(root / "tools" / "convert_checkpoint.py"),
            "hf-to-megatron",
            str(source),
            str(tmp_path / "megatron"),
            "--params-dtype",
            "bfloat16",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote Megatron checkpoint" in done.stdout and "bfloat16" in done.stdout
    # its main() in this process (a second interpreter start is slow on these machines)
    args = [
        "megatron-to-hf",
        str(tmp_path / "megatron"),
        str(tmp_path / "back"),
        "--dtype",
        "float32",
        "--max-shard-size",
        "40KB",
        "--no-progress",
    ]
    cli.main(args)
    original, back = hf_models.read_hf_tensors(source), hf_models.read_hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():  # through bf16 (norms too): rounded, widened exactly
        assert torch.equal(back[name], tensor.to(torch.bfloat16).float()), name
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as failed:
        cli.main(args)
    assert failed.value.code == 2
    assert f"error: output {tmp_path / 'back'} already exists" in capsys.readouterr().err
    assert cli.byte_size("512MiB") == 512 * 2**20 and cli.byte_size("2GB") == 2 * 10**9
    # a layout the world cannot hold: one line, exit 2, and the process's world left as it was
    # (the expert layouts themselves: tests/distributed/test_moe_weights_layouts.py)
    for command in (
        ["hf-to-megatron", str(source)],
        ["megatron-to-hf", str(tmp_path / "megatron")],
    ):
        with pytest.raises(SystemExit) as failed:
            cli.main([*command, str(tmp_path / "x"), "--ep", "2", "--etp", "2"])
        assert failed.value.code == 2
        assert capsys.readouterr().err.endswith(
            "error: world size 1 / pipeline 1 is not divisible by expert tensor x expert model "
            "parallel = 4\n"
        )
        assert not torch.distributed.is_initialized()


def test_command_line_creates_the_missing_parent_folders_of_its_output(
    hf_folders, tmp_path, capsys
):
    from bapo_megatron.weights import convert_cli

    source, _ = hf_folders["qwen2-untied"]
    out = tmp_path / "not" / "yet" / "megatron"
    convert_cli.main(["hf-to-megatron", str(source), str(out), "--no-progress"])
    assert f"wrote Megatron checkpoint {out}" in capsys.readouterr().out
    assert megatron_checkpoint.read_checkpoint_info(out).model.model_type == "qwen2"
    assert sorted(p.name for p in (tmp_path / "not" / "yet").iterdir()) == ["megatron"]
