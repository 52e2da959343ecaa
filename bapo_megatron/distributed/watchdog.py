"""Which rank has not reached which phase: each rank writes the phase it is in to the process
group's key-value store, so that when a step stalls (a frozen or dead rank leaves the others
waiting in a collective) any rank can say who is behind, without a collective.

- :class:`PhaseWatchdog` records phases (``with watchdog.phase("train"):``) and runs a thread
  that logs the report once a phase has lasted ``stall_s``;
- a collective that times out inside a phase gets the same report added to its error, so the
  run stops naming the rank that did not come, not only the collective that waited.

The store is the one the process group was set up with (torchrun's rendezvous store), so the
report reaches every rank even while collectives are stuck.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

log = logging.getLogger(__name__)

_KEY = "bapo_megatron/phase/{rank}"


class KeyValueStore(Protocol):
    """What the watchdog needs of ``torch.distributed.Store``."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def stall_report(phases: dict[int, tuple[str, float] | None], rank: int, now: float) -> str:
    """Where each other rank is, from ``phases`` (rank -> (phase, wall time entered) or None if
    it never wrote one), for this ``rank``'s point of view."""
    mine = phases.get(rank)
    lines = []
    for other, entry in sorted(phases.items()):
        if other == rank:
            continue
        if entry is None:
            lines.append(f"rank {other} has not reported any phase")
        elif mine is not None and entry[0] != mine[0]:
            lines.append(
                f"rank {other} has not reached {mine[0]!r}: it is in {entry[0]!r} "
                f"since {now - entry[1]:.0f} s"
            )
    here = f"rank {rank} in {mine[0]!r} since {now - mine[1]:.0f} s" if mine else f"rank {rank}"
    if not lines:
        return f"{here}; every other rank reports the same phase"
    return f"{here}; " + "; ".join(lines)


class PhaseWatchdog:
    """Records this rank's phase in ``store`` and watches for stalls (see the module docstring).
    ``store`` None (one process) records locally only."""

    def __init__(
        self,
        store: KeyValueStore | None,
        rank: int,
        world_size: int,
        *,
        stall_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_s, self.clock = stall_s, clock
        self.current: tuple[str, float] | None = None
        self.reported: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, phase: str) -> None:
        self.current = (phase, self.clock())
        self.reported = None
        if self.store is not None:
            self.store.set(_KEY.format(rank=self.rank), f"{self.current[1]!r} {phase}")

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Enter ``phase``; an error raised inside it (a collective that timed out waiting for
        a rank) gets the report of where every rank is."""
        self.enter(phase)
        try:
            yield
        except Exception as error:
            self.annotate(error)
            raise

    def annotate(self, error: BaseException) -> None:
        """Add the report of where every rank is to ``error`` (multi-rank runs; a store that no
        longer answers leaves the error as it is)."""
        if self.world_size == 1:
            return
        try:
            error.add_note(f"where the ranks are: {self.report()}")
        except Exception as err:  # noqa: BLE001 - the original error matters more
            log.warning("phase watchdog: no report (%s)", err)

    def phases(self) -> dict[int, tuple[str, float] | None]:
        """Every rank's last phase, read from the store (this rank's from memory)."""
        found: dict[int, tuple[str, float] | None] = {self.rank: self.current}
        for other in range(self.world_size):
            if other == self.rank or self.store is None:
                continue
            key = _KEY.format(rank=other)
            if not self.store.check([key]):
                found[other] = None
                continue
            stamp, _, name = self.store.get(key).decode().partition(" ")
            found[other] = (name, float(stamp))
        return found

    def report(self) -> str:
        return stall_report(self.phases(), self.rank, self.clock())

    def check(self) -> str | None:
        """The report if this rank's phase has lasted ``stall_s`` (logged once per phase)."""
        if self.current is None or self.reported == self.current[0]:
            return None
        if self.clock() - self.current[1] < self.stall_s:
            return None
        self.reported = self.current[0]
        report = self.report()
        log.warning("step stalled for over %.0f s: %s", self.stall_s, report)
        return report

    def start(self, interval_s: float = 1.0) -> PhaseWatchdog:
        """Check every ``interval_s`` on a daemon thread until :meth:`close`."""

        def watch() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check()
                except Exception as err:  # noqa: BLE001 - a dead store must not end the run here
                    log.warning("phase watchdog: %s", err)

        self._thread = threading.Thread(target=watch, name="phase-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
