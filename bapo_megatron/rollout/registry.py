"""Build the rollout engine a run's configuration names (``rollout.engine``): a registry of
engine kinds, filled by the engine families.

Each family (:mod:`.embedded`, :mod:`.vllm`, :mod:`.sglang`) registers a builder for its
in-process engine under its name and, when it has one, a builder for its server client under
``<name>-server``. The adapters import vllm/sglang only when an engine starts, so registering
needs neither; the embedded engine needs nothing more, and vLLM and
SGLang need their packages installed on the ranks that hold an engine (docs/rollout-engines.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.config import ModelConfig, RolloutConfig
from bapo_megatron.rollout import embedded, sglang, vllm
from bapo_megatron.rollout.engine_setup import EngineSetup
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.protocol import RolloutEngine

Builder = Callable[[EngineSetup], RolloutEngine]
"""Starts (or connects to) one engine."""


@dataclass(frozen=True)
class EngineKind:
    """A registered value of ``rollout.engine``."""

    builder: Builder
    server_client: bool
    """Whether it connects to a server at ``rollout.server_urls``."""


_KINDS: dict[str, EngineKind] = {}


def register_family(
    name: str, *, in_process: Builder, server_client: Builder | None = None
) -> None:
    """Register engine family ``name``: its in-process engine as kind ``name`` and, when given,
    its server client as ``name-server``. A kind registered twice is refused."""
    entries = {name: EngineKind(in_process, server_client=False)}
    if server_client is not None:
        entries[f"{name}-server"] = EngineKind(server_client, server_client=True)
    taken = sorted(set(entries) & set(_KINDS))
    if taken:
        raise ValueError(f"rollout engine kinds {taken} are already registered")
    _KINDS.update(entries)


def engine_kinds() -> tuple[str, ...]:
    """The registered values of ``rollout.engine``, in registration order."""
    return tuple(_KINDS)


for _family in (embedded, vllm, sglang):
    register_family(
        _family.FAMILY,
        in_process=_family.start_in_process,
        server_client=getattr(_family, "connect_server", None),
    )


def build_engine(
    rollout: RolloutConfig,
    model: ModelConfig,
    *,
    model_path: str | None,
    dp_rank: int,
    work_dir: Path,
    pad_token_id: int,
    device: str = "cpu",
    record_routes: bool = False,
    longest_prompt_tokens: int | None = None,
) -> RolloutEngine:
    """The engine of data-parallel replica ``dp_rank``, of the kind ``rollout.engine`` names.
    ``model_path`` is the HF folder the run started from (vLLM and SGLang load their first
    weights, and their tokenizer-free config, from it; the trainer pushes its own weights before
    the first rollout anyway). ``work_dir`` is where engines that take weights from disk (the
    vLLM server) get them; ``device`` is where an embedded engine computes; ``record_routes``
    asks vLLM and SGLang for each token's experts (:attr:`EngineSetup.record_routes`);
    ``longest_prompt_tokens`` sizes an in-process vLLM (:attr:`EngineSetup`). The engine comes
    guarded: its failures name it, and generation has ``rollout.timeout_s``."""
    kind = _KINDS.get(rollout.engine)
    if kind is None:
        raise ValueError(
            f"rollout.engine is {rollout.engine!r}; the known engine kinds are "
            f"{list(engine_kinds())}"
        )
    name = f"rollout engine {rollout.engine!r} of data-parallel replica {dp_rank}"
    url = None
    if kind.server_client:
        urls = rollout.server_urls
        if len(urls) > 1 and len(urls) <= dp_rank:
            raise ValueError(
                f"rollout.server_urls has {len(urls)} entries; data-parallel rank "
                f"{dp_rank} has none (give one per data-parallel rank, or one)"
            )
        url = urls[dp_rank] if len(urls) > 1 else urls[0]
        name += f" at {url}"
    setup = EngineSetup(
        rollout=rollout,
        model=model,
        model_path=model_path,
        url=url,
        dp_rank=dp_rank,
        work_dir=work_dir,
        pad_token_id=pad_token_id,
        device=device,
        record_routes=record_routes,
        longest_prompt_tokens=longest_prompt_tokens,
    )
    try:
        engine = kind.builder(setup)
    except Exception as error:
        raise EngineFailure(f"{name} could not start: {type(error).__name__}: {error}") from error
    return GuardedEngine(engine, name=name, timeout_s=rollout.timeout_s)
