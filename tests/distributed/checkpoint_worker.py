"""The resume scenario of tests/distributed/test_checkpoint.py, and its multi-process worker.

:func:`resume_run` is the scenario: train an actor 2 steps, save, train 2 more (the uninterrupted
run); build a second actor from another seed, load, train the same 2 steps (the resumed run). The
test runs it in one process; :func:`main` runs it in each of 2 gloo workers started by
tests/helpers/gloo_launch.py at every layout of :data:`LAYOUTS`, and saves what the parent compares.

This module is light at import time (everything heavy is imported inside the functions), so
that a process started with the ``spawn`` method, which re-imports ``__main__``, does not pay
for torch and Megatron again.
"""

from __future__ import annotations

import sys

STEPS_BEFORE = 2
"""Steps trained before the checkpoint."""
STEPS_AFTER = 2
"""Steps trained after it, by the uninterrupted and by the resumed run."""
# name -> (tensor parallel, pipeline parallel, distributed optimizer); data parallel fills 2 ranks.
LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, False), "dp2-distributed-optimizer": (1, 1, True)}


def model_config():
    """A tiny Llama-style model (2 layers: one per stage at PP2)."""
    from bapo_megatron.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        max_position_embeddings=32,
    )


def optimizer_config(distributed: bool = False, **changes):
    """Warmup then cosine decay, so the resumed learning rate depends on the restored schedule;
    clipping on, so the step depends on the gradient norm."""
    from bapo_megatron.config import OptimizerConfig

    settings = {
        "lr": 2e-3,
        "min_lr": 1e-4,
        "lr_warmup_steps": 1,
        "lr_decay_steps": 8,
        "lr_decay_style": "cosine",
        "weight_decay": 0.01,
        "clip_grad": 0.5,
        "use_distributed_optimizer": distributed,
    }
    return OptimizerConfig(**{**settings, **changes})


def build(context, seed: int, optimizer=None, model=None):
    """An actor of the tiny model with initial weights from ``seed``."""
    from bapo_megatron.actor.actor import build_actor
    from bapo_megatron.config import ActorConfig

    actor = ActorConfig(micro_batch_size=2, temperature=0.9, seed=seed)
    return build_actor(model or model_config(), actor, optimizer or optimizer_config(), context)


def policy_batch(step: int, dp_rank: int):
    """4 sequences of 12 tokens for this step and data-parallel rank: responses after a 3-5
    token prompt, old log-probs spread around the uniform policy's, one advantage per sequence."""
    import math

    import torch

    from bapo_megatron.actor.batch import PolicyBatch

    vocab = model_config().vocab_size
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    n, length = 4, 12
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        start = int(torch.randint(3, 6, (), generator=g))
        mask[i, start : int(torch.randint(start + 2, length + 1, (), generator=g))] = True
    old = torch.where(mask, -math.log(vocab) + 0.5 * torch.randn(n, length, generator=g), 0.0)
    return PolicyBatch(
        tokens=tokens, response_mask=mask, old_logprobs=old, advantages=torch.randn(n, generator=g)
    )


def train(actor, steps) -> list[dict[str, float]]:
    """Train one step per entry of ``steps`` (the step index picks the batch); the metrics."""
    from bapo_megatron.actor.train_step import train_step
    from bapo_megatron.algo.search_plan import SearchPlan
    from bapo_megatron.config import ClipSearchConfig, LossConfig

    clip = ClipSearchConfig.from_preset("paper")
    plan = SearchPlan.from_config(clip)
    loss = LossConfig(clip=clip)
    return [
        train_step(actor, policy_batch(step, actor.context.dp_rank), loss, plan) for step in steps
    ]


def random_draws() -> tuple:
    """One draw from every generator a checkpoint restores."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():  # Megatron's model-parallel generator
        tracker = torch.rand(2)
    return torch.rand(3), random.random(), tuple(np.random.rand(2)), tracker


def parameters(actor) -> dict:
    """This rank's parameter shards, copied."""
    return {name: param.detach().clone() for name, param in actor.named_parameters().items()}


def resume_run(context, root, trainer_state: dict, optimizer=None, model=None) -> dict:
    """The scenario (see the module docstring); what it observed, for the caller to compare."""
    import random

    import numpy as np
    import torch

    from bapo_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    actor = build(context, seed=5, optimizer=optimizer, model=model)
    train(actor, range(STEPS_BEFORE))
    actor.skipped_steps = 1  # as if a step had been dropped for a non-finite gradient norm
    folder = save_checkpoint(root, STEPS_BEFORE, actor, trainer_state, keep_last=None)
    draws_after_save = random_draws()
    continued = train(actor, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    continued_params = parameters(actor)

    resumed_actor = build(context, seed=6, optimizer=optimizer, model=model)
    initial = parameters(resumed_actor)
    torch.manual_seed(123)  # the generators are elsewhere before the load
    random.seed(123)
    np.random.seed(123)
    step, loaded_state = load_checkpoint(latest_checkpoint(root), resumed_actor)
    draws_after_load = random_draws()
    resumed = train(resumed_actor, range(step, step + STEPS_AFTER))
    resumed_params = parameters(resumed_actor)
    return {
        "folder": folder,
        "step": step,
        "trainer_state": loaded_state,
        "draws_after_save": draws_after_save,
        "draws_after_load": draws_after_load,
        "continued": continued,
        "resumed": resumed,
        "initial_differs": any(not torch.equal(initial[k], continued_params[k]) for k in initial),
        "unequal_params": sorted(
            k for k in continued_params if not torch.equal(continued_params[k], resumed_params[k])
        ),
        "files": sorted(path.name for path in folder.iterdir()),
    }


def main(argv: list[str]) -> None:
    # (gloo_launch.launch starts it with one thread per pool and the checkout on PYTHONPATH)
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from tests.helpers import gloo_launch

    args = gloo_launch.worker_arguments(argv, workdir=str)
    gloo_launch.join_group(args, timeout_s=120)
    results = {}
    start = time.monotonic()
    for name, (tp, pp, distributed) in LAYOUTS.items():
        context = ParallelContext.initialize(
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        )
        # Each rank keeps its own state (a replay buffer on some ranks only).
        trainer_state = (
            {"rank": args.rank, "buffer": torch.arange(3.0) + args.rank}
            if args.rank == 0
            else {"rank": args.rank}
        )
        result = resume_run(
            context,
            Path(args.workdir) / name,
            trainer_state,
            optimizer=optimizer_config(distributed),
        )
        results[name] = dict(
            result,
            sent_state=trainer_state,
            ranks=(context.tp_rank, context.pp_rank, context.dp_rank),
        )
        context.teardown()
        print(f"{time.monotonic() - start:6.1f} s  {name} done", flush=True)  # in the rank's log
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
