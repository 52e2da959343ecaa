"""SmolLM2-135M-Instruct through the conversion command and back: HF -> Megatron -> HF at
TP1/PP1 (in this process), PP2 (2 gloo workers, 15 layers a stage) and TP3 (3 workers: its 9
heads and 3 key/value groups split into 3 and 1 a rank) gives back bitwise the tensors of the
original ``model.safetensors``, and the config, generation config, tokenizer and chat template
byte for byte. TP2 is refused, naming the attention heads, both by the layout check and by the
command at TP2 over 2 processes, before anything is written.

Workers: tests/real_model/conversion_worker.py. The folders (about 1 GB per layout) are removed
once a test has compared them; a failing test leaves them for a look.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bapo_megatron.config import ParallelConfig
from bapo_megatron.distributed.layout import Accelerator, validate_layout
from bapo_megatron.weights import convert_cli
from bapo_megatron.weights.hf_checkpoint import read_model_config
from tests.helpers import gloo_launch, hf_models

WORKER = Path(__file__).with_name("conversion_worker.py")
# A guard against a hung collective, not a speed requirement: a conversion of this model takes
# well under a minute a direction here.
LAUNCH_TIMEOUT_S = 1200.0
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
HEADS_REFUSED = (
    "model.num_attention_heads (9) is not divisible by parallel.tensor_model_parallel_size (2)"
)


@pytest.fixture(scope="module")
def original(real_model) -> dict[str, torch.Tensor]:
    """Every tensor of the model's ``model.safetensors``."""
    return hf_models.read_hf_tensors(real_model)


def assert_bitwise_copy(back: Path, real_model: Path, original: dict[str, torch.Tensor]) -> None:
    """``back`` holds exactly the original tensors, bit for bit, and its carried files."""
    tensors = hf_models.read_hf_tensors(back)
    assert sorted(tensors) == sorted(original)  # tied: no lm_head.weight, as in the original
    assert len(original) == 2 + 9 * 30  # embedding, final norm, 9 tensors in each of 30 layers
    for name, tensor in original.items():
        copy = tensors[name]
        assert copy.dtype == tensor.dtype == torch.float32, name
        assert copy.shape == tensor.shape, name
        assert torch.equal(copy.view(torch.int32), tensor.view(torch.int32)), name
    for name in CARRIED_FILES:
        assert (back / name).read_bytes() == (real_model / name).read_bytes(), name


def launch_round_trip(real_model: Path, work: Path, tp: int, pp: int, refuse_tp: int = 0):
    """Each rank's results of a TP x PP launch of the worker."""
    arguments = ["--hf", real_model, "--workdir", work, "--tp", tp, "--pp", pp]
    return gloo_launch.launch(
        WORKER, tp * pp, work, [*arguments, "--refuse-tp", refuse_tp], LAUNCH_TIMEOUT_S
    )


def assert_converted_at(results: list[dict], layout: str) -> None:
    """Both directions exited 0 on every rank, and rank 0 reported the layout."""
    for rank, result in enumerate(results):
        for step in ("to-megatron", "to-hf"):
            assert result[step]["code"] == 0, (rank, step, result[step]["stderr"])
    assert f"at {layout}" in results[0]["to-megatron"]["stdout"]
    assert f"at {layout}" in results[0]["to-hf"]["stdout"]


def remove_outputs(*folders: Path) -> None:
    for folder in folders:
        shutil.rmtree(folder)


def test_round_trip_at_tp1_pp1_is_bitwise(real_model, original, tmp_path, capsys):
    megatron, back = tmp_path / "megatron", tmp_path / "hf"
    convert_cli.main(["hf-to-megatron", str(real_model), str(megatron), "--no-progress"])
    convert_cli.main(["megatron-to-hf", str(megatron), str(back), "--no-progress"])
    printed = capsys.readouterr().out
    assert f"wrote Megatron checkpoint {megatron} (llama, 30 layers, float32) at TP1/PP1" in printed
    assert f"wrote HF folder {back} from {megatron} at TP1/PP1" in printed
    assert_bitwise_copy(back, real_model, original)
    remove_outputs(megatron, back)


@pytest.fixture(scope="module")
def pp2_launch(real_model, tmp_path_factory):
    """(work folder, every rank's results) of the PP2 launch, which also asks for TP2."""
    work = tmp_path_factory.mktemp("pp2")
    return work, launch_round_trip(real_model, work, tp=1, pp=2, refuse_tp=2)


@pytest.mark.multiprocess
def test_round_trip_at_pp2_is_bitwise(real_model, original, pp2_launch):
    work, results = pp2_launch
    assert_converted_at(results, "TP1/PP2")
    # each stage wrote the shard of its own 15 layers
    assert len(list((work / "hf").glob("model-*-of-00002.safetensors"))) == 2
    assert_bitwise_copy(work / "hf", real_model, original)
    remove_outputs(work / "megatron", work / "hf")


@pytest.mark.multiprocess
def test_round_trip_at_tp3_is_bitwise(real_model, original, tmp_path):
    results = launch_round_trip(real_model, tmp_path, tp=3, pp=1)
    assert_converted_at(results, "TP3/PP1")
    assert_bitwise_copy(tmp_path / "hf", real_model, original)
    remove_outputs(tmp_path / "megatron", tmp_path / "hf")


def test_tp2_is_refused_by_the_layout_check_naming_the_heads(real_model):
    model = read_model_config(real_model)
    assert (model.num_attention_heads, model.num_query_groups) == (9, 3)
    no_gpu = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)
    with pytest.raises(ValueError) as refused:
        validate_layout(model, ParallelConfig(tensor_model_parallel_size=2), 2, no_gpu)
    assert str(refused.value) == HEADS_REFUSED
    # the layouts this file converts at pass the same check
    for tp, pp in ((1, 1), (1, 2), (3, 1)):
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        assert validate_layout(model, parallel, tp * pp, no_gpu) == 1


@pytest.mark.multiprocess
def test_tp2_is_refused_by_the_command_before_writing(pp2_launch):
    work, results = pp2_launch
    for rank, result in enumerate(results):  # every rank stops with the same line, none hangs
        refused = result["refused"]
        assert refused["code"] == 2, (rank, refused)
        assert refused["stderr"].endswith(f"error: {HEADS_REFUSED}\n"), (rank, refused)
    assert not (work / "refused").exists()
    assert not list(work.glob(".refused*"))  # no staging folder or lock left behind
