"""The Megatron ``GPTModel`` the project builds for SmolLM2-135M-Instruct (one process, TP1,
float32) and loaded from its HF folder the way the trainer loads ``train.model_path`` gives
transformers' ``LlamaForCausalLM`` logits on real chat text: two conversations put in the
model's chat template by the trainer's own prompt code, right-padded into one batch as the actor
pads its rows.

Tolerance: max |Megatron - transformers| <= 2e-5 x max |logits| over every real (not padding)
position and the whole vocabulary. Here the two agree bitwise (both run torch's fused attention
in float32); transformers' eager attention, another order of the same sums, differs by 8e-5 on
logits of magnitude 39 (2e-6 relative), ten times inside the bound. A wrong tensor, head order,
RoPE base or norm epsilon moves logits by far more.
"""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.model import build_model
from bapo_megatron.data.prompts import PromptRow, prompt_token_ids
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.weights.convert import load_hf_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

RELATIVE_TOLERANCE = 2e-5
CONVERSATIONS = (
    (("user", "What is 7 + 12?"),),
    (
        ("system", "You are a patient tutor. Answer in plain words, briefly."),
        ("user", "Explain why the sky is blue, in two sentences, for a ten-year-old."),
        (
            "assistant",
            "Sunlight holds every colour. The air scatters blue light much more than red, "
            "so blue reaches our eyes from every part of the sky.",
        ),
        ("user", "Then why are sunsets red?"),
    ),
)


@pytest.fixture(scope="module")
def chat_batch(real_model) -> tuple[torch.Tensor, list[int]]:
    """The conversations' prompt tokens right-padded into one batch [2, longest], and their
    lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    prompts = [
        prompt_token_ids(
            tokenizer,
            PromptRow(id=str(k), prompt=tuple(ChatMessage(r, c) for r, c in turns), answer=""),
        )
        for k, turns in enumerate(CONVERSATIONS)
    ]
    lengths = [len(ids) for ids in prompts]
    assert lengths[1] > 2 * lengths[0]  # the padding of the short row is real
    batch = torch.full((len(prompts), max(lengths)), tokenizer.pad_token_id)
    for row, ids in enumerate(prompts):
        batch[row, : len(ids)] = torch.tensor(ids)
    # the template was applied: the assistant turn is open at the end of every prompt
    opened = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert all(ids[-len(opened) :] == opened for ids in prompts)
    return batch, lengths


@torch.no_grad()
def megatron_logits(real_model, context, batch: torch.Tensor) -> torch.Tensor:
    with HFCheckpoint.open(real_model) as hf:
        [chunk] = build_model(hf.model, context.config, context, initialize=False)
        load_hf_weights([chunk], hf, context)
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    return chunk.eval()(batch, positions, None).float()


@torch.no_grad()
def transformers_logits(real_model, batch: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    mask = (torch.arange(batch.shape[1]) < torch.tensor(lengths)[:, None]).long()
    return model(input_ids=batch, attention_mask=mask).logits.float()


def test_megatron_logits_are_transformers_logits_on_chat_text(real_model, context, chat_batch):
    batch, lengths = chat_batch
    ours = megatron_logits(real_model, context, batch)
    theirs = transformers_logits(real_model, batch, lengths)
    assert ours.shape == theirs.shape == (2, max(lengths), 49152)  # TP1: the whole vocabulary
    for row, length in enumerate(lengths):
        a, b = ours[row, :length], theirs[row, :length]
        scale = b.abs().max().item()
        assert scale > 10  # logits of a trained model, not of a model left at zero
        gap = (a - b).abs().max().item()
        assert gap <= RELATIVE_TOLERANCE * scale, (row, gap, scale)
