"""Bad input to the HF <-> Megatron conversion is refused with a message naming the file or
tensor: unknown architectures, missing or truncated shards, missing, unexpected or misshapen
tensors, other formats; and the command line (``bapo-convert-checkpoint``) both ways, with its
reports of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bapo_megatron.weights import megatron_checkpoint
from bapo_megatron.weights.convert import hf_to_megatron
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint, read_model_config
from tests.helpers import hf_models


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """variant -> (saved HF folder, transformers' logits on hf_models.tokens())."""
    return hf_models.saved_folders(tmp_path_factory.mktemp("hf"))


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
