"""Supervised warm-up before RL, for runs that start from random weights: the tiny CPU run
cannot download a model, so it first teaches its model the synthetic task's format on the
reference responses, to a success rate well between 0 and 1, where RL has signal. (The
`count_up_and_stop` task's references often run on past the target without stopping, so that
its failures run long: :func:`~bapo_megatron.data.synthetic_task.warmup_reference`.)

The warm-up trains a separate actor (its own Adam state and constant learning rate) through the
same train step as RL: with the old log-probs recomputed just before each step, the ratio is 1,
nothing is clipped, and a token-mean policy loss with advantage 1 has exactly the gradient of
the response tokens' mean cross-entropy. The result is copied into the RL actor.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from bapo_megatron.actor.actor import Actor, build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import ClipSearchConfig, Config, LossConfig, OptimizerConfig
from bapo_megatron.data.synthetic_task import warmup_reference
from bapo_megatron.data.task import Task, encode_prompt


def supervised_batch(
    task: Task,
    rows,
    system: str | None,
    max_new_tokens: int,
    references=None,
    prompt_ids: dict[int, list[int]] | None = None,
) -> PolicyBatch:
    """Prompt + reference response + end token per row, the response (and end) as targets.
    ``references``: (response, ends with the end token) per row instead of (answer, True).
    ``prompt_ids``: the rows' encoded prompts by ``id(row)``, filled as rows come (the warm-up
    draws the same rows again and again, and the chat template cost a tenth of its time)."""
    sequences, starts = [], []
    if references is None:
        references = [(row.answer, True) for row in rows]
    for row, (text, ends) in zip(rows, references, strict=True):
        if prompt_ids is None:
            prompt = encode_prompt(task, row, system, max_new_tokens)
        elif id(row) in prompt_ids:
            prompt = prompt_ids[id(row)]
        else:
            prompt = prompt_ids[id(row)] = encode_prompt(task, row, system, max_new_tokens)
        response = task.tokenizer(text, add_special_tokens=False)["input_ids"]
        sequences.append(prompt + list(response) + ([task.eos_token_id] if ends else []))
        starts.append(len(prompt))
    length = max(map(len, sequences))
    tokens = torch.full((len(rows), length), task.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (ids, start) in enumerate(zip(sequences, starts)):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, start : len(ids)] = True
    return PolicyBatch(tokens=tokens, response_mask=mask)


def run_warmup(cfg: Config, task: Task, actor: Actor, log) -> None:
    """``cfg.warmup.steps`` supervised steps; their weights then replace ``actor``'s.
    ``log(step, metrics)`` receives each step's response cross-entropy."""
    warm = cfg.warmup
    context = actor.context
    optimizer = OptimizerConfig(lr=warm.lr, weight_decay=0.0, clip_grad=1.0)
    student = build_actor(task.model, cfg.actor, optimizer, context)
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("grpo"))  # never clips at ratio 1
    loss = LossConfig(aggregation="token-mean")
    per_rank = max(1, warm.batch_size // context.dp_size)
    temperature = cfg.actor.temperature
    prompt_ids: dict[int, list[int]] = {}  # by id(row): the rows are task.rows' own objects
    for step in range(warm.steps):
        rng = random.Random(f"warmup/{cfg.train.seed}/{step}/{context.dp_rank}")
        rows = rng.sample(task.rows, min(per_rank, len(task.rows)))
        cap = cfg.rollout.max_new_tokens
        references = [warmup_reference(cfg.data.synthetic_task, row, rng, cap) for row in rows]
        batch = supervised_batch(task, rows, cfg.data.system_prompt, cap, references, prompt_ids)
        old, _ = compute_logprobs(
            student.chunks,
            batch,
            context,
            batching=Batching.for_logprobs(cfg.actor),
            fp8_multiple=student.fp8_length_multiple,
            temperature=temperature,
            with_entropy=False,
        )
        batch = dataclasses.replace(
            batch, old_logprobs=old, advantages=torch.ones(batch.num_sequences)
        )
        metrics = train_step(student, batch, loss, plan)
        cross_entropy = float(-old[batch.response_mask].mean())
        log(step, {"warmup/cross_entropy": cross_entropy, "warmup/grad_norm": metrics["grad_norm"]})
    copy_weights(student, actor)


@torch.no_grad()
def copy_weights(source: Actor, target: Actor) -> None:
    """``source``'s parameters into ``target`` (same model and layout), and into ``target``'s
    optimizer's main copies (bf16 models keep fp32 main weights there)."""
    pairs = zip(source.named_parameters().items(), target.named_parameters().items())
    for (name, src), (other, dst) in pairs:
        if name != other or src.shape != dst.shape:
            raise RuntimeError(f"warm-up and RL actors differ at {name} / {other}")
        dst.copy_(src)
    target.optimizer.reload_model_params()
