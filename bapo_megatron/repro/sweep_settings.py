"""What a staleness sweep runs (:mod:`bapo_megatron.repro.sweep`): the clipping methods, the
staleness settings and :class:`SweepSettings`, fixed before the first run. Shared by the
orchestrator and its report (:mod:`bapo_megatron.repro.sweep_report`)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS: dict[str, tuple[str, ...]] = {
    "grpo": ("loss.clip.preset=grpo",),  # fixed [0.8, 1.2]
    "clip-higher": ("loss.clip.preset=clip-higher",),  # fixed [0.8, 1.28] (DAPO)
    # BAPO's start bounds without the adaptation: does the looser lower bound alone do the work?
    "fixed-0.6": ("loss.clip.preset=grpo", "loss.clip.c_low_start=0.6", "loss.clip.c_low_max=0.6"),
    "bapo-paper": ("loss.clip.preset=paper",),
    "bapo-reference": ("loss.clip.preset=reference",),
}
"""Clipping method -> its dotted overrides (docs/algorithm.md section 7)."""

REUSE = (1, 4, 8)
LAGS = (8, 16)


@dataclass(kw_only=True)
class SweepSettings:
    """Everything a sweep runs with (fixed before the first run; written into the report)."""

    task: str = "count_up_and_stop"
    """Synthetic task (:data:`bapo_megatron.data.synthetic_task.SYNTHETIC_TASKS`):
    `count_up_and_stop`, the tiny CPU run's, whose failures run long (BAPO's premise)."""
    task_size: int = 4000
    """Prompts generated for the task (seed 0)."""
    warmup_steps: int = 300
    """Supervised warm-up steps of the shared start (the tiny CPU run's)."""
    warmup_lr: float = 3e-3
    warmup_batch_size: int = 64
    methods: tuple[str, ...] = tuple(METHODS)
    staleness: tuple[str, ...] = (
        "reuse1",
        "reuse4",
        "reuse8",
        "lag8",
        "lag16",
        "async1",
        "async2",
        "async4",
    )
    """`reuse<k>`: k optimizer steps (mini-batches) per rollout batch; `lag<k>`: train on the batch
    generated k rollout steps earlier (k extra rollout steps, so every run trains as often);
    `partial<b>`: partial rollout, b tokens per round; `async<k>`: the asynchronous pipeline at
    ``algorithm.max_staleness`` = k, 1 trainer + 1 engine process under torchrun, one optimizer
    step per rollout step (so the engine runs k rollout steps ahead; reuse1 is its synchronous
    twin)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """``train.seed`` of each run (prompt order, sampling); the start is shared."""
    steps: int = 60
    """Rollout steps that train (lag runs add their lag)."""
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 32
    lr: float = 1e-4
    """Learning rate of the RL runs (the tiny CPU run's)."""
    temperature: float = 1.0
    micro_batch_size: int = 64
    extra_overrides: tuple[str, ...] = ()
    """Further dotted overrides given to every run."""
    jobs: int = 2
    """Training processes at a time (an `async<k>` run starts two)."""

    @classmethod
    def minimal(cls, **changes) -> SweepSettings:
        """A tiny sweep for CI: 2 methods x 2 staleness settings (one of them asynchronous) x
        1 seed x a few steps."""
        base = {
            "task_size": 200,
            "warmup_steps": 20,
            "warmup_batch_size": 16,
            "methods": ("grpo", "bapo-paper"),
            "staleness": ("reuse4", "async1"),
            "seeds": (0,),
            "steps": 4,
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "max_new_tokens": 16,
            "micro_batch_size": 16,
        }
        return cls(**{**base, **changes})

    def __post_init__(self) -> None:
        self.methods, self.staleness, self.seeds = (
            tuple(self.methods),
            tuple(self.staleness),
            tuple(self.seeds),
        )
        self.extra_overrides = tuple(self.extra_overrides)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"sweep: unknown methods {unknown}; known: {list(METHODS)}")
        for name in self.staleness:
            staleness_overrides(name, self)  # raises for an unknown setting
        if self.jobs < 1:
            raise ValueError(f"sweep: jobs must be >= 1, got {self.jobs}")


STALENESS_KINDS = ("reuse", "lag", "partial", "async")


def _parse(name: str) -> tuple[str, int]:
    """(kind, value) of staleness setting ``name``; ValueError for anything else."""
    for kind in STALENESS_KINDS:
        digits = name[len(kind) :]
        if name.startswith(kind) and digits.isdigit() and int(digits) > 0:
            return kind, int(digits)
    raise ValueError(
        f"sweep: staleness setting {name!r} is not reuse<k>, lag<k>, partial<b> or async<k>"
    )


def processes(name: str) -> int:
    """Processes a run of staleness setting ``name`` starts (async: a trainer and an engine)."""
    return 2 if _parse(name)[0] == "async" else 1


def staleness_overrides(name: str, settings: SweepSettings) -> list[str]:
    """Dotted overrides of staleness setting ``name`` (see :attr:`SweepSettings.staleness`)."""
    kind, value = _parse(name)
    if kind == "reuse":
        if settings.prompts_per_step % value:
            raise ValueError(
                f"sweep: {name} needs prompts_per_step ({settings.prompts_per_step}) "
                f"to be a multiple of {value}"
            )
        return [f"algorithm.optimizer_steps_per_rollout={value}", f"train.steps={settings.steps}"]
    if kind == "lag":
        return [f"algorithm.rollout_lag={value}", f"train.steps={settings.steps + value}"]
    if kind == "async":
        # m = 1: eta counts versions and the engines run floor(eta / m) rollout steps ahead
        # (bapo_megatron/trainer/admission.py), so eta = 1 really generates ahead
        return [
            "rollout.placement=disaggregated",
            "rollout.engine_ranks=1",
            f"algorithm.max_staleness={value}",
            "algorithm.optimizer_steps_per_rollout=1",
            f"train.steps={settings.steps}",
        ]
    return [f"rollout.partial_tokens_per_round={value}", f"train.steps={settings.steps}"]
