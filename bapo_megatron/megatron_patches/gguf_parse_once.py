"""One parse of a GGUF file per conversion (gguf 0.19 with transformers 5.23).

transformers' GGUF loader for the families here (``modeling_gguf_pytorch_utils``) builds a new
``gguf.GGUFReader`` each time it reads the file: for the tokenizer's config, for the model's
config and for the weights. gguf parses the whole header every time, the tokenizer's arrays one
numpy element at a time (about 100,000 strings for SmolLM2: seconds per parse). While mapping
names it also calls ``gguf.get_tensor_name_map`` once per module of the model (about 400 times
for 30 layers), building the same table each time. Inside :func:`gguf_parsed_once` the package's
``GGUFReader`` returns one reader per file and ``get_tensor_name_map`` one table per
(architecture, layer count): transformers only reads both. The names are restored on exit.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def gguf_parsed_once(gguf_module: Any) -> Iterator[None]:
    """Within the block, ``gguf_module.GGUFReader(path)`` (read mode) and
    ``gguf_module.get_tensor_name_map(arch, blocks)`` return cached results; restored after.
    ``gguf_module`` is the imported ``gguf`` package (passed in: it is an optional one)."""
    reader_class = gguf_module.GGUFReader
    name_map = gguf_module.get_tensor_name_map
    readers: dict[str, Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        if mode != "r":
            return reader_class(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf_module.GGUFReader = shared_reader
    gguf_module.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf_module.GGUFReader = reader_class
        gguf_module.get_tensor_name_map = name_map
