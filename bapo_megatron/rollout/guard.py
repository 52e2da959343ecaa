"""An engine's failures, named: the trainer talks to its engine through :class:`GuardedEngine`.

Whatever goes wrong inside an engine (a vLLM engine core that died, a server that went away or
stopped answering, output that fails the checks, a refused weight update) reaches the trainer as
:class:`EngineFailure`, whose message says which engine it was. A generation call may also have a
deadline: when it passes, a watchdog thread calls the engine's ``abort`` (which every engine
accepts from another thread), the call returns with its cut samples, and the guard raises
instead of handing them on. Generation itself stays on the caller's thread, where every engine
expects it (SGLang's in-process engine drives its event loop there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from bapo_megatron.rollout.protocol import RolloutEngine, RolloutSample, SamplingParams

Result = TypeVar("Result")


class EngineFailure(RuntimeError):
    """A rollout engine failed, refused or ran past its deadline; the message names it."""


class GuardedEngine:
    """``engine`` with the errors of every protocol method raised as :class:`EngineFailure`
    naming ``name``, and each ``generate`` / ``continue_generation`` call aborted after
    ``timeout_s`` seconds (None: no deadline). Attributes outside the protocol are the engine's
    own."""

    def __init__(self, engine: RolloutEngine, *, name: str, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
        self.engine = engine
        self.name = name
        self.timeout_s = timeout_s

    @property
    def version(self) -> int:
        """The engine's policy version."""
        return self.engine.version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, round_tokens: int | None = None
    ) -> list[RolloutSample]:
        """The engine's ``generate``, under the deadline."""
        return self._generation(
            "generate", lambda: self.engine.generate(prompts, params, round_tokens=round_tokens)
        )

    def continue_generation(
        self,
        samples: list[RolloutSample],
        params: SamplingParams,
        *,
        round_tokens: int | None = None,
    ) -> list[RolloutSample]:
        """The engine's ``continue_generation``, under the deadline."""
        return self._generation(
            "continue_generation",
            lambda: self.engine.continue_generation(samples, params, round_tokens=round_tokens),
        )

    def abort(self) -> None:
        """The engine's ``abort`` (callable from another thread, as the engine's is)."""
        self._named("abort", self.engine.abort)

    def pause(self) -> None:
        """The engine's ``pause``."""
        self._named("pause", self.engine.pause)

    def resume(self) -> None:
        """The engine's ``resume``."""
        self._named("resume", self.engine.resume)

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        checksum: bool = False,
    ) -> str | None:
        """The engine's ``update_weights``."""
        return self._named(
            "update_weights",
            lambda: self.engine.update_weights(named_tensors, version=version, checksum=checksum),
        )

    def release_memory(self) -> None:
        """The engine's ``release_memory``."""
        self._named("release_memory", self.engine.release_memory)

    def resume_memory(self) -> None:
        """The engine's ``resume_memory``."""
        self._named("resume_memory", self.engine.resume_memory)

    def health(self) -> bool:
        """The engine's ``health``; an engine whose health check itself fails raises."""
        return self._named("health", self.engine.health)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.engine, attribute)

    def _named(self, method: str, call: Callable[[], Result]) -> Result:
        try:
            return call()
        except EngineFailure:
            raise
        except Exception as error:
            raise EngineFailure(
                f"{self.name}: {method} failed: {type(error).__name__}: {error}"
            ) from error

    def _generation(self, method: str, call: Callable[[], Result]) -> Result:
        if self.timeout_s is None:
            return self._named(method, call)
        expired = threading.Event()
        abort_errors: list[Exception] = []

        def expire() -> None:
            expired.set()
            try:
                self.engine.abort()
            except Exception as error:  # noqa: BLE001 - reported by the caller's thread
                abort_errors.append(error)

        watchdog = threading.Timer(self.timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            result = self._named(method, call)
        except EngineFailure as failure:
            if expired.is_set():
                raise EngineFailure(self._late(method, abort_errors)) from failure
            raise
        finally:
            watchdog.cancel()
            watchdog.join()  # an abort under way finishes before the call returns
        if expired.is_set():
            raise EngineFailure(self._late(method, abort_errors))
        return result

    def _late(self, method: str, abort_errors: list[Exception]) -> str:
        late = (
            f"{self.name}: {method} gave no result within {self.timeout_s:g} s (rollout.timeout_s)"
        )
        if abort_errors:
            error = abort_errors[0]
            return f"{late}; aborting the engine failed: {type(error).__name__}: {error}"
        return f"{late}; the engine was aborted"
