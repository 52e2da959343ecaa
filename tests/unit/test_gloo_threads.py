"""The test session's release of idle gloo groups (tests/helpers/gloo_threads.py)."""

from __future__ import annotations

import gc

import torch.distributed as dist

from tests.helpers.gloo_threads import (
    gloo_transport_threads,
    gloo_transport_threads_reaching,
    release_idle_gloo_groups,
)


def test_groups_held_by_a_cycle_lose_their_threads_once_the_world_is_gone():
    gc.collect()
    before = gloo_transport_threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    holder = {"groups": [dist.new_group([0], backend="gloo") for _ in range(3)]}
    holder["self"] = holder  # as an actor, its optimizer and their hooks hold one another
    assert gloo_transport_threads_reaching(before + 4) == before + 4  # the world's, the groups'
    gc.disable()  # the one collection must be release_idle_gloo_groups's own
    try:
        release_idle_gloo_groups()  # a world still exists: nothing is collected yet
        dist.destroy_process_group()
        del holder
        assert gloo_transport_threads() >= before + 3  # the cycle keeps the groups alive
        release_idle_gloo_groups()
        assert gloo_transport_threads_reaching(before) == before
    finally:
        gc.enable()
