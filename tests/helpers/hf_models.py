"""Tiny random Hugging Face checkpoints built with transformers, for the conversion tests.

Each variant is a real ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (2
layers, hidden 64, 4 heads in 2 key/value groups, vocab 128), randomly initialised, saved with
``save_pretrained`` in small safetensors shards (so the index file exists), next to a tiny
word-level tokenizer built with the ``tokenizers`` library. Biases of Qwen2's q/k/v and the norm
weights (Qwen3's q/k norms included) are drawn at random too, so that a swapped or dropped tensor
changes the logits.

Qwen3's heads are 32 wide (4 x 32 = 128 query channels on a 64-wide residual stream), so
``head_dim`` is not hidden / heads. The Llama 3.2-style variant scales its rotary frequencies
(``rope_type: llama3``) with factors that are all not Megatron's fixed ones (low 2, high 8,
original context 60), over base 1e4, so that its head-size-16 frequencies fall in all three
bands: kept (wavelength 6.3 < 60 / 8), interpolated (19.9) and divided by the factor (62.8 and
up, > 60 / 2). ``heads`` / ``kv_heads`` change the head counts (vLLM's CPU attention refuses
heads 16 wide: the vLLM tier builds its Llama with 2 heads of 32).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 128, 64, 128, 4, 2, 2
BATCH, SEQ = 2, 12

# name -> (transformers model_type, tie_word_embeddings)
VARIANTS: dict[str, tuple[str, bool]] = {
    "llama-untied": ("llama", False),
    "llama-tied": ("llama", True),
    "qwen2-tied": ("qwen2", True),
    "qwen2-untied": ("qwen2", False),
    "qwen3-tied": ("qwen3", True),
    "qwen3-untied": ("qwen3", False),
    "llama32-tied": ("llama", True),
}
QWEN3_HEAD_DIM = 32
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 1e4,
    "factor": 4.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 60,
}


def build_hf_model(
    variant: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layers: int = LAYERS,
    *,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> torch.nn.Module:
    """A random transformers model of ``variant`` in eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    model_type, tied = VARIANTS[variant]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
    )
    if model_type == "qwen2":
        config, cls = Qwen2Config(**common, rope_theta=1e6), Qwen2ForCausalLM
    elif model_type == "qwen3":
        config = Qwen3Config(**common, rope_theta=1e6, head_dim=QWEN3_HEAD_DIM)
        cls = Qwen3ForCausalLM
    elif variant.startswith("llama32"):
        config, cls = LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE)), LlamaForCausalLM
    else:
        config, cls = LlamaConfig(**common, rope_theta=5e5), LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return model.to(dtype).eval()


# Qwen3-MoE: Qwen3's attention, the first layer dense, the others 4 experts of width 32, top-2.
MOE_EXPERTS, MOE_TOPK, MOE_FFN = 4, 2, 32


def build_hf_moe_model(
    seed: int = 0, layers: int = 4, expert_ffn: int = MOE_FFN, vocab: int = VOCAB
) -> torch.nn.Module:
    """A random transformers ``Qwen3MoeForCausalLM`` (untied, q/k norms, head size 32, layer 0
    dense, experts ``expert_ffn`` wide) in eval mode, float32; norms and routers drawn at random
    so that a swapped tensor or expert changes the logits. ``vocab``: its vocabulary (the
    tokenizer keeps ``VOCAB`` words)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=QWEN3_HEAD_DIM,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOPK,
        moe_intermediate_size=expert_ffn,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        router_aux_loss_coef=0.001,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.2)  # transformers 5 leaves fused experts uninitialised
    return model.eval()


def save_hf_moe_folder(
    folder: Path, seed: int = 0, layers: int = 4, expert_ffn: int = MOE_FFN, vocab: int = VOCAB
) -> torch.nn.Module:
    """:func:`build_hf_moe_model` saved with a tokenizer to ``folder`` (per-expert tensor names
    on disk, as transformers writes them)."""
    model = build_hf_moe_model(seed, layers, expert_ffn, vocab)
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="40KB")
    save_tokenizer(folder)
    return model


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over ``VOCAB`` words, saved as transformers saves a fast one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w0", eos_token="w1"
    ).save_pretrained(str(folder))


def save_hf_folder(
    folder: Path,
    variant: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layers: int = LAYERS,
    **heads: int,
) -> torch.nn.Module:
    """Build ``variant`` (``heads``: :func:`build_hf_model`'s head counts), save it and a
    tokenizer to ``folder``; return the model."""
    model = build_hf_model(variant, seed, dtype, layers, **heads)
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="40KB")
    save_tokenizer(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return model


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of token ids [BATCH, SEQ] and its position ids."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


@torch.no_grad()
def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    """transformers' own logits [BATCH, SEQ, VOCAB] on :func:`tokens`."""
    ids, _ = tokens()
    return model(input_ids=ids).logits.float()


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of ``folder``."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def saved_folders(root: Path) -> dict[str, tuple[Path, torch.Tensor]]:
    """variant -> (an HF folder of it saved under ``root``, transformers' logits on
    :func:`tokens`), for every variant."""
    out = {}
    for seed, variant in enumerate(VARIANTS):
        model = save_hf_folder(root / variant, variant, seed=seed)
        out[variant] = (root / variant, hf_logits(model))
    return out
