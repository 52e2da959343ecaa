"""The mode of the safetensors shards the converters and exports write."""

from __future__ import annotations

import torch


def test_written_shards_get_the_mode_of_any_new_file(tmp_path):
    """safetensors writes through a private temporary file; a converted folder must be as
    readable as the rest of its files (the umask's mode, not 0o600)."""
    from bapo_megatron.files.atomic import new_file_mode
    from bapo_megatron.weights.hf_checkpoint import write_shard

    path = tmp_path / "shard.safetensors"
    write_shard(path, {"w": torch.ones(3)})
    assert path.stat().st_mode & 0o777 == new_file_mode()
