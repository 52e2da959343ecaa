"""HF <-> Megatron conversion in one process (TP1/PP1), against transformers itself.

Tiny random Llama, Llama 3.2-style (scaled RoPE), Qwen2 and Qwen3 models (tied and untied) are
built and saved with transformers (tests/helpers/hf_models.py). Converted to Megatron they must
give transformers' logits; converted back they must be bitwise the saved tensors, with config and
tokenizer files byte for byte, and load in transformers. An interrupted conversion must leave
nothing that looks complete. The name maps: test_weight_name_maps.py; bad input:
test_weights_convert_bad_input.py. The layouts TP2/PP1, TP1/PP2, TP2/PP2, resharding and the live
export at TP2/PP2 are in tests/distributed/test_weights_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bapo_megatron.files.atomic import staging_path
from bapo_megatron.models.name_maps import (
    chunk_parameters,
    name_map_for,
)
from bapo_megatron.weights import megatron_checkpoint
from bapo_megatron.weights.convert import hf_to_megatron, load_hf_weights, megatron_to_hf
from bapo_megatron.weights.export import export_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint
from tests.helpers import hf_models


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """variant -> (saved HF folder, transformers' logits on hf_models.tokens())."""
    return hf_models.saved_folders(tmp_path_factory.mktemp("hf"))


def megatron_logits(chunk: torch.nn.Module) -> torch.Tensor:
    ids, positions = hf_models.tokens()
    with torch.no_grad():
        return chunk(ids, positions, None).float()


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
