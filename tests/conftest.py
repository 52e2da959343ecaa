"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest


@pytest.fixture
def single_process():
    """A one-process ParallelContext (gloo world of one rank), torn down after the test."""
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.parallel import ParallelContext

    context = ParallelContext.initialize(ParallelConfig())
    try:
        yield context
    finally:
        context.teardown()


@pytest.fixture
def context(single_process):
    """The same one-process context, under the name the train-step and weights tests use."""
    return single_process
