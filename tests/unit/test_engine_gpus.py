"""The GPUs an engine rank's in-process engine is given (``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import pytest

from bapo_megatron.disaggregated.engine_gpus import engine_gpus, pin_engine_gpus


@pytest.mark.parametrize(
    ("local_rank", "tp", "visible", "expected"),
    [
        (4, 1, None, "4"),  # trainer ranks 0..3 and engine ranks 4..7 on one node
        (7, 1, "", "7"),
        (0, 8, None, "0,1,2,3,4,5,6,7"),  # one engine rank spanning its node
        (1, 2, "3,5,6,7", "6,7"),  # of the devices the launcher left visible
        (0, 1, " 2 , 4 ", "2"),
    ],
)
def test_each_engine_rank_takes_its_own_gpus(local_rank, tp, visible, expected):
    assert engine_gpus(local_rank, tp, visible) == expected


def test_too_few_visible_gpus_are_refused_naming_the_settings():
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 .*engine_tensor_parallel_size=2 .*shows 4"):
        engine_gpus(2, 2, "0,1,2,3")


def test_only_gpu_engines_under_torchrun_are_pinned():
    env = {"LOCAL_RANK": "3"}
    pin_engine_gpus("embedded", 1, env)
    assert "CUDA_VISIBLE_DEVICES" not in env
    pin_engine_gpus("vllm", 1, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    alone: dict[str, str] = {}
    pin_engine_gpus("sglang", 1, alone)
    assert alone == {}
