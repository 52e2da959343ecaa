"""What a training run learns from: the prompt rows, the tokenizer that turns them into token
ids, and the policy's architecture, from the ``data`` / ``model`` / ``train`` sections."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import transformers

from bapo_megatron.config import Config, ModelConfig
from bapo_megatron.data.prompts import PromptRow, load_prompts, prompt_token_ids
from bapo_megatron.data.synthetic_task import counting_tokenizer, synthetic_rows

log = logging.getLogger(__name__)


@dataclass
class Task:
    rows: list[PromptRow]
    """The prompts the run draws from; each fits the model with a full-length response."""
    tokenizer: object
    """A transformers tokenizer with a chat template."""
    model: ModelConfig
    """The policy's architecture; its ``max_position_embeddings`` bounds prompt + response."""
    longest_prompt_tokens: int | None = None
    """Tokens of the longest prompt of :attr:`rows` in the chat template (sizes the engines'
    context and KV cache); None: not counted."""
    skipped_rows: int = 0
    """Rows of ``data.train_file`` left out under ``data.skip_bad_rows``: malformed ones and those
    whose prompt does not fit the model (see :func:`encode_prompt`). Always 0 for a synthetic
    task, and without ``skip_bad_rows`` (the first such row is an error instead)."""

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)


def load_task(cfg: Config) -> Task:
    """Rows, tokenizer and model of the run; ``ValueError`` naming the field or file.

    Every row's prompt is encoded here once, so that one too long for the model is a bad row of
    the file (an error naming its line, or skipped and counted) rather than a failure at the
    rollout step that draws it."""
    data = cfg.data
    max_new_tokens = cfg.rollout.max_new_tokens
    if data.synthetic_task is not None:
        tokenizer = counting_tokenizer()
        if cfg.model.vocab_size < len(tokenizer):
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                f"{data.synthetic_task!r} task's tokenizer ({len(tokenizer)} tokens)"
            )
        rows = synthetic_rows(data.synthetic_task, data.synthetic_size, seed=cfg.train.seed)
        task = Task(rows=rows, tokenizer=tokenizer, model=cfg.model)
        # generated rows are never skipped: one that does not fit is a configuration error
        try:
            task.longest_prompt_tokens = max(
                len(encode_prompt(task, row, data.system_prompt, max_new_tokens)) for row in rows
            )
        except ValueError as err:
            raise ValueError(f"data.synthetic_task {data.synthetic_task!r}: {err}") from None
        return task

    overrides = {"params_dtype": cfg.train.params_dtype or "float32"}
    if cfg.train.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = cfg.train.max_position_embeddings
    model = ModelConfig.from_hf_config(cfg.train.model_path, **overrides)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.train.model_path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"train.model_path {cfg.train.model_path}: cannot load its tokenizer ({err})"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"train.model_path {cfg.train.model_path}: the tokenizer has no eos token")

    longest = 0

    def check_fits(row: PromptRow) -> None:
        nonlocal longest
        ids = prompt_token_ids(tokenizer, row, system=data.system_prompt)
        problem = _fit_problem(len(ids), max_new_tokens, model.max_position_embeddings)
        if problem is not None:
            raise ValueError(problem)
        longest = max(longest, len(ids))

    prompts = load_prompts(
        data.train_file,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        skip_bad_rows=data.skip_bad_rows,
        check_row=check_fits,
    )
    if prompts.skipped:
        log.warning(
            "%s: skipped %d bad rows; first: %s",
            data.train_file,
            len(prompts.skipped),
            prompts.skipped[0],
        )
    return Task(
        rows=prompts.rows,
        tokenizer=tokenizer,
        model=model,
        longest_prompt_tokens=longest or None,
        skipped_rows=len(prompts.skipped),
    )


def _fit_problem(prompt_tokens: int, max_new_tokens: int, max_positions: int) -> str | None:
    """Why a prompt of ``prompt_tokens`` leaves too little room for a response, or None.

    The whole ``max_new_tokens`` must fit, not just one token: any sample may run to the cap,
    and prompt plus response is what the engines' context and the actor's passes must hold."""
    if prompt_tokens + max_new_tokens <= max_positions:
        return None
    return (
        f"the prompt is {prompt_tokens} tokens in the chat template; with rollout.max_new_tokens "
        f"({max_new_tokens}) that is {prompt_tokens + max_new_tokens}, more than the model's "
        f"max_position_embeddings ({max_positions})"
    )


def encode_prompt(task: Task, row: PromptRow, system: str | None, max_new_tokens: int) -> list[int]:
    """The row's prompt ids in the chat template; ``ValueError`` when prompt plus response cap
    would not fit the model's positions (:func:`load_task` has already left such rows out)."""
    ids = prompt_token_ids(task.tokenizer, row, system=system)
    problem = _fit_problem(len(ids), max_new_tokens, task.model.max_position_embeddings)
    if problem is not None:
        raise ValueError(f"prompt {row.id!r}: {problem}")
    return ids
