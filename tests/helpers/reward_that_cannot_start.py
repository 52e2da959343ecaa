"""A reward whose module imports in the trainer's process (which checks the name) and fails to
import in every reward worker, as a scoring library missing on the workers' side would."""

from __future__ import annotations

import multiprocessing

if multiprocessing.parent_process() is not None:
    raise ImportError("the scoring library is missing in this worker process")


def score(response: str, truth: str) -> float:
    return float(response == truth)
