"""vLLM 0.32 warms its chat template up when ``vllm.LLM`` starts, even started with
``skip_tokenizer_init=True`` (``entrypoints/llm.py`` calls ``renderer.warmup``), where there is
no tokenizer to render with: it logs ``WARNING [base.py:380] Chat template warmup failed`` with
the traceback of ``ValueError: Tokenizer not available when `skip_tokenizer_init=True```
(``renderers/base.py``) at every start. The adapters work on token ids and never render a
chat, so :func:`tokenizer_free_warmup_quiet` drops that one record while the engine starts; any
other warmup failure still shows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

RENDERER_LOGGER = "vllm.renderers.base"
"""The logger of vLLM 0.32's ``renderers/base.py``, which logs the warmup failure."""


class TokenizerFreeWarmupFilter(logging.Filter):
    """Drops the warmup failure of a renderer that has no tokenizer (see the module
    docstring); passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Chat template warmup failed" or not record.exc_info:
            return True
        error = record.exc_info[1]
        return not (isinstance(error, ValueError) and "skip_tokenizer_init" in str(error))


@contextlib.contextmanager
def tokenizer_free_warmup_quiet() -> Iterator[None]:
    """Install :class:`TokenizerFreeWarmupFilter` on vLLM's renderer logger for the block."""
    logger = logging.getLogger(RENDERER_LOGGER)
    quiet = TokenizerFreeWarmupFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
