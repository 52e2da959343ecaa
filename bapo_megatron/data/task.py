"""What a training run learns from: the prompt rows, the tokenizer that turns them into token
ids, and the policy's architecture, from the ``data`` / ``model`` / ``train`` sections."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bapo_megatron.config import Config, ModelConfig
from bapo_megatron.data.prompts import PromptRow, load_prompts, prompt_token_ids
from bapo_megatron.data.synthetic_task import synthetic_rows, walk_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Task:
    rows: list[PromptRow]
    tokenizer: object
    """A transformers tokenizer with a chat template."""
    model: ModelConfig
    skipped_rows: int = 0
    """Malformed rows of the prompt file that were skipped (``data.skip_bad_rows``)."""

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)


def load_task(cfg: Config) -> Task:
    """Rows, tokenizer and model of the run; ``ValueError`` naming the field or file."""
    data = cfg.data
    if data.synthetic_task is not None:
        tokenizer = walk_tokenizer()
        if cfg.model.vocab_size < len(tokenizer):
            raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                             f"{data.synthetic_task!r} task's tokenizer ({len(tokenizer)} tokens)")
        rows = synthetic_rows(data.synthetic_task, data.synthetic_size, seed=cfg.train.seed)
        return Task(rows=rows, tokenizer=tokenizer,
                    model=cfg.model)
    import transformers

    prompts = load_prompts(data.train_file, skip_bad_rows=data.skip_bad_rows)
    if prompts.skipped:
        log.warning("%s: skipped %d malformed rows; first: %s", data.train_file,
                    len(prompts.skipped), prompts.skipped[0])
    overrides = {"params_dtype": cfg.train.params_dtype or "float32"}
    if cfg.train.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = cfg.train.max_position_embeddings
    model = ModelConfig.from_hf_config(cfg.train.model_path, **overrides)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.train.model_path)
    except (OSError, ValueError) as err:
        raise ValueError(f"train.model_path {cfg.train.model_path}: cannot load its tokenizer "
                         f"({err})") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"train.model_path {cfg.train.model_path}: the tokenizer has no eos token")
    return Task(rows=prompts.rows, tokenizer=tokenizer, model=model, skipped_rows=len(prompts.skipped))


def encode_prompt(task: Task, row: PromptRow, system: str | None, max_new_tokens: int) -> list[int]:
    """The row's prompt ids in the chat template; ``ValueError`` when prompt plus response cap
    would not fit the model's positions."""
    ids = prompt_token_ids(task.tokenizer, row, system=system)
    if len(ids) + max_new_tokens > task.model.max_position_embeddings:
        raise ValueError(f"prompt {row.id!r}: {len(ids)} prompt tokens + rollout.max_new_tokens "
                         f"({max_new_tokens}) exceed model.max_position_embeddings "
                         f"({task.model.max_position_embeddings})")
    return ids
