"""What vLLM 0.32 printed needlessly and the adapter now tells it or filters
(bapo_megatron/rollout/vllm/reload_expectations.py, chat_warmup.py): the pure pieces, no vLLM
needed. With a real vLLM the tier checks them end to end (tests/vllm/test_rollout_vllm_engine.py:
a tied model's update logs no warning; test_rollout_vllm_loop.py: a training run prints no
traceback)."""

from __future__ import annotations

import logging
import sys
import types

import torch
from torch import nn

from bapo_megatron.rollout.vllm.chat_warmup import (
    RENDERER_LOGGER,
    TokenizerFreeWarmupFilter,
    tokenizer_free_warmup_quiet,
)
from bapo_megatron.rollout.vllm.reload_expectations import never_loaded


class Rotary(nn.Module):
    """Like vLLM's RotaryEmbedding: no parameters, a non-persistent ``cos_sin_cache``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)


class Counter(nn.Module):
    """No parameters, but a persistent buffer, which a checkpoint may hold."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))


def vllm_like_model(tied: bool) -> nn.Module:
    model = nn.Module()
    model.config = types.SimpleNamespace(tie_word_embeddings=tied)
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(8, 4)
    model.model.rotary_emb = Rotary()
    model.model.counter = Counter()
    model.lm_head = nn.Module()
    model.lm_head.weight = (
        model.model.embed_tokens.weight if tied else nn.Parameter(torch.zeros(8, 4))
    )
    return model


def test_a_tied_output_layer_and_buffer_only_modules_are_never_loaded():
    assert never_loaded(vllm_like_model(tied=True)) == {
        "model.rotary_emb": ["cos_sin_cache"],
        "lm_head": ["weight"],
    }
    # untied, the output layer's weight is in every checkpoint
    assert never_loaded(vllm_like_model(tied=False)) == {"model.rotary_emb": ["cos_sin_cache"]}


def warmup_failure(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    message = "Chat template warmup failed"
    return logging.LogRecord(RENDERER_LOGGER, logging.WARNING, "base.py", 0, message, (), exc_info)


def test_only_the_tokenizer_free_warmup_failure_is_dropped():
    quiet = TokenizerFreeWarmupFilter()
    no_tokenizer = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not quiet.filter(warmup_failure(no_tokenizer))
    assert quiet.filter(warmup_failure(RuntimeError("the template does not parse")))
    other = logging.LogRecord(RENDERER_LOGGER, logging.WARNING, "base.py", 1, "other", (), None)
    assert quiet.filter(other)


def test_the_filter_is_on_vllms_renderer_logger_only_while_the_engine_starts():
    logger = logging.getLogger(RENDERER_LOGGER)
    before = list(logger.filters)
    with tokenizer_free_warmup_quiet():
        assert any(isinstance(f, TokenizerFreeWarmupFilter) for f in logger.filters)
    assert logger.filters == before
