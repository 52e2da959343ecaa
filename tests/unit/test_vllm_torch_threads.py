"""The torch thread count an in-process vLLM start would lower is put back
(bapo_megatron/megatron_patches/vllm_torch_threads.py); on a real vLLM at tensor parallel 2:
tests/vllm/test_rollout_vllm_engine.py."""

import pytest
import torch

from bapo_megatron.megatron_patches.vllm_torch_threads import torch_threads_kept


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_count_before_the_block_is_the_count_after(two_threads):
    with torch_threads_kept():
        torch.set_num_threads(1)  # what vLLM's worker start does
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_count_is_put_back_when_the_start_fails(two_threads):
    with pytest.raises(RuntimeError, match="worker failed"), torch_threads_kept():
        torch.set_num_threads(1)
        raise RuntimeError("worker failed")
    assert torch.get_num_threads() == 2
