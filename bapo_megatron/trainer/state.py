"""What the training loop carries from one rollout step to the next, and saves in checkpoints.

:class:`TrainerState` is the loop's whole progress on one rank; :meth:`TrainerState.to_checkpoint`
is the checkpoint schema of it: plain data only (dicts with string keys, lists, numbers, strings,
None), so a per-rank checkpoint file loads with ``torch.load(weights_only=True)`` and loading a
checkpoint never unpickles Python objects (which could run code from the file).

The state differs between ranks: the paused groups, the lag queue and the replay buffer live on
each replica's engine rank only (the other ranks keep them empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bapo_megatron.data.experience import (
    Group,
    ReplayBuffer,
    row_from_plain,
    row_to_plain,
    sample_from_plain,
    sample_to_plain,
)
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.rollout.protocol import RolloutSample

PausedGroup = tuple[PromptRow, list[RolloutSample]]
"""A prompt's samples of which some are paused by partial rollout (to be continued next step)."""

_COUNTERS = ("step", "version", "position")


@dataclass
class TrainerState:
    """The training loop's progress on this rank."""

    replay: ReplayBuffer
    """Groups of earlier rollout steps, replayed into later batches (``algorithm.replay_*``)."""
    step: int = 0
    """Rollout steps done."""
    version: int = 0
    """Policy version: optimizer steps done (the version the engines' weights carry)."""
    position: int = 0
    """Prompts of the endless data stream visited so far (over all replicas)."""
    paused_groups: list[PausedGroup] = field(default_factory=list)
    """Groups paused by partial rollout, continued at the next rollout step."""
    lag_queue: list[list[Group]] = field(default_factory=list)
    """Scored groups of the last ``algorithm.rollout_lag`` steps, waiting to be trained on."""
    refill_rounds: int = 0
    """Refill rounds this replica has taken (``algorithm.max_refill_rounds``): the position of
    its refill prompt stream."""
    tracker_runs: dict[str, str] = field(default_factory=dict)
    """The experiment trackers' run ids by tracker (``wandb``, ``mlflow``), on rank 0: a
    resumed run reopens these runs instead of starting new ones."""

    def to_checkpoint(self) -> dict[str, Any]:
        """The state as plain data (the checkpoint schema; see the module docstring)."""
        return {
            "step": self.step,
            "version": self.version,
            "position": self.position,
            "paused_groups": [
                {"row": row_to_plain(row), "samples": [sample_to_plain(s) for s in samples]}
                for row, samples in self.paused_groups
            ],
            "lag_queue": [[group.to_plain() for group in groups] for groups in self.lag_queue],
            "replay": self.replay.state_dict(),
            "tracker_runs": dict(self.tracker_runs),
            "refill_rounds": self.refill_rounds,
        }

    def load_checkpoint(self, saved: dict[str, Any], source: str) -> None:
        """Take over what :meth:`to_checkpoint` wrote (``source`` names the file, for errors):
        ``ValueError`` naming the field when something is missing or of the wrong kind."""
        if not isinstance(saved, dict):
            raise ValueError(  # noqa: TRY004 - a bad file, reported like every other field
                f"{source}: trainer_state is a {type(saved).__name__}, not a dict"
            )
        if "paused_groups" not in saved and "carry" in saved:  # the key's earlier name
            saved = {**saved, "paused_groups": saved["carry"]}
        required = (*_COUNTERS, "paused_groups", "lag_queue", "replay")
        missing = [key for key in required if key not in saved]
        if missing:
            raise ValueError(f"{source}: trainer_state lacks {', '.join(missing)}")
        for key in _COUNTERS:
            value = saved[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{source}: trainer_state.{key} is {value!r}, not an integer >= 0")
        try:
            paused_groups = [
                (row_from_plain(paused["row"]), [sample_from_plain(s) for s in paused["samples"]])
                for paused in saved["paused_groups"]
            ]
            lag_queue = [
                [Group.from_plain(group) for group in groups] for groups in saved["lag_queue"]
            ]
            self.replay.load_state_dict(saved["replay"])
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"{source}: trainer_state's paused groups, lag queue or replay "
                f"buffer are malformed ({err!r})"
            ) from None
        # absent from checkpoints written before the trackers: no tracker run to reopen
        tracker_runs = saved.get("tracker_runs", {})
        if not isinstance(tracker_runs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tracker_runs.items()
        ):
            raise ValueError(
                f"{source}: trainer_state.tracker_runs is {tracker_runs!r}, not a mapping of "
                "tracker names to run ids"
            )
        # absent from checkpoints written before dynamic sampling's refill: none taken
        refill_rounds = saved.get("refill_rounds", 0)
        if (
            isinstance(refill_rounds, bool)
            or not isinstance(refill_rounds, int)
            or refill_rounds < 0
        ):
            raise ValueError(
                f"{source}: trainer_state.refill_rounds is {refill_rounds!r}, not an integer >= 0"
            )
        self.refill_rounds = refill_rounds
        self.step, self.version, self.position = (saved[key] for key in _COUNTERS)
        self.tracker_runs = dict(tracker_runs)
        self.paused_groups, self.lag_queue = paused_groups, lag_queue


@dataclass
class StreamProgress:
    """Asynchronous training's bookkeeping between rollout steps. Not checkpointed: a resumed
    run pushes its version to the engines and admits again from its step (what was in flight
    when it stopped is generated anew), so every prompt trains once or is dropped."""

    next_item: int
    """The next rollout item to admit (items below it were sent to the engines)."""
    pushed_version: int
    """The newest policy version sent to the engines."""
    sent_bytes: int = 0
    """Weight bytes this rank had broadcast when the last step's metrics were taken."""


IDENTITY_FIELDS = (
    "train.seed",
    "actor.seed",
    "train.model_path",
    "train.load_checkpoint",
    "data.train_file",
    "data.prompt_key",
    "data.answer_key",
    "data.synthetic_task",
    "data.synthetic_size",
    "data.shuffle",
    "data.system_prompt",
    "rollout.prompts_per_step",
    "rollout.samples_per_prompt",
)
"""The settings that make a checkpoint this run's: its seeds, where its weights started and
what it learns from. A resume with another value of any of them would continue another run's
history (the model, layout and schedule are checked by the checkpoint itself)."""

IDENTITY_DEFAULTS = {"data.prompt_key": "prompt", "data.answer_key": "answer"}
"""Identifying settings added after checkpoints were first written, and the value a checkpoint
that does not record one was saved with."""


def run_identity(cfg: Any) -> dict[str, Any]:
    """The values of :data:`IDENTITY_FIELDS` in ``cfg`` (a
    :class:`~bapo_megatron.config.Config`)."""
    identity = {}
    for dotted in IDENTITY_FIELDS:
        value = cfg
        for name in dotted.split("."):
            value = getattr(value, name)
        identity[dotted] = value
    return identity
