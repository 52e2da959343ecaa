"""Typed run configuration: every field is documented once, here, where it is defined.

Dataclasses are keyword-only and validate themselves in ``__post_init__``; a user error raises
``ValueError`` naming the dotted field. YAML files and ``a.b.c=value`` overrides are turned into
these classes by :mod:`bapo_megatron.config.loading`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Schedule = Literal["paper", "reference"]
Semantics = Literal["gradient", "surrogate"]
TargetUnit = Literal["share", "ratio"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
Granularity = Literal["step", "microbatch"]

AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Preset values come from docs/bapo-spec.md: `paper` is Algorithm 1 of arXiv 2510.18927, `reference`
# the authors' verl recipe (yaml + policy_loss.py), `grpo` and `clip-higher` the fixed-clip
# baselines the paper compares with (a fixed clip is a search with empty ranges).
CLIP_PRESETS: dict[str, dict[str, object]] = {
    "paper": dict(
        schedule="paper", semantics="gradient", target_unit="share", target=0.4,
        c_low_start=0.6, c_low_max=0.9, c_low_step=0.02,
        c_high_start=1.2, c_high_max=3.0, c_high_step=0.05, dual_clip=None,
        granularity="step",
    ),
    "reference": dict(
        schedule="reference", semantics="surrogate", target_unit="ratio", target=1.0,
        c_low_start=0.6, c_low_max=0.8, c_low_step=0.05,
        c_high_start=1.2, c_high_max=2.0, c_high_step=0.05, dual_clip=3.0,
        granularity="microbatch",
    ),
    "grpo": dict(
        schedule="paper", semantics="gradient", target_unit="share", target=0.4,
        c_low_start=0.8, c_low_max=0.8, c_low_step=0.02,
        c_high_start=1.2, c_high_max=1.2, c_high_step=0.05, dual_clip=None,
    ),
    "clip-higher": dict(
        schedule="paper", semantics="gradient", target_unit="share", target=0.4,
        c_low_start=0.8, c_low_max=0.8, c_low_step=0.02,
        c_high_start=1.28, c_high_max=1.28, c_high_step=0.05, dual_clip=None,
    ),
}


@dataclass(kw_only=True)
class ClipSearchConfig:
    """The clip bounds and the adaptive search that moves them (spec sections 2-4).

    Built from a preset with :meth:`from_preset`; a YAML section with ``preset: <name>`` starts
    from that preset and overrides the fields it names. Bounds are explicit ratio bounds
    (0.6, 1.2), not epsilons.
    """

    preset: str = "paper"
    """Name of the preset the values started from (informational once fields are overridden)."""
    schedule: Schedule = "paper"
    """`paper`: Algorithm 1, c_high moves first, only whole steps inside the range.
    `reference`: the authors' code, c_low moves first, the last step clamped to the max."""
    semantics: Semantics = "gradient"
    """`gradient`: only tokens that carry gradient count, by |A|*r. `surrogate`: every token counts
    at its clipped surrogate value (Eq. 8 as printed and the authors' code)."""
    target_unit: TargetUnit = "share"
    """`share`: rho = P/(P+N) >= target. `ratio`: q = P/N >= target."""
    target: float = 0.4
    """rho0 (share) or q0 (ratio) the search tries to reach."""
    c_low_start: float = 0.6
    """Lower ratio bound every update starts from (a-)."""
    c_low_max: float = 0.9
    """Largest value the search may raise c_low to (b-)."""
    c_low_step: float = 0.02
    """Step of c_low (delta2)."""
    c_high_start: float = 1.2
    """Upper ratio bound every update starts from (a+)."""
    c_high_max: float = 3.0
    """Largest value the search may raise c_high to (b+)."""
    c_high_step: float = 0.05
    """Step of c_high (delta1)."""
    dual_clip: float | None = None
    """Dual-clip constant C > 1 for negative advantages (loss capped at |A|*C); None disables."""
    granularity: Granularity = "step"
    """Where the bounds are decided (spec section 5). `step`: once per optimizer step from all of
    its micro-batches (the paper; costs one no-grad forward pass). `microbatch`: per micro-batch,
    on that micro-batch index over the data-parallel ranks (the authors' code). Fixed clips need
    no decision and behave the same either way."""

    def __post_init__(self) -> None:
        prefix = "loss.clip"
        if self.schedule not in ("paper", "reference"):
            raise ValueError(f"{prefix}.schedule must be 'paper' or 'reference', got {self.schedule!r}")
        if self.semantics not in ("gradient", "surrogate"):
            raise ValueError(
                f"{prefix}.semantics must be 'gradient' or 'surrogate', got {self.semantics!r}"
            )
        if self.target_unit not in ("share", "ratio"):
            raise ValueError(
                f"{prefix}.target_unit must be 'share' or 'ratio', got {self.target_unit!r}"
            )
        for name in ("target", "c_low_start", "c_low_max", "c_low_step",
                     "c_high_start", "c_high_max", "c_high_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{prefix}.{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        if self.target_unit == "share" and not 0.0 < self.target < 1.0:
            raise ValueError(f"{prefix}.target is a share P/(P+N) and must lie in (0, 1), got {self.target}")
        if self.target_unit == "ratio" and not self.target > 0.0:
            raise ValueError(f"{prefix}.target is a ratio P/N and must be > 0, got {self.target}")
        if not 0.0 < self.c_low_start <= self.c_low_max <= 1.0:
            raise ValueError(
                f"{prefix}: expected 0 < c_low_start <= c_low_max <= 1, "
                f"got c_low_start={self.c_low_start}, c_low_max={self.c_low_max}"
            )
        if not 1.0 <= self.c_high_start <= self.c_high_max:
            raise ValueError(
                f"{prefix}: expected 1 <= c_high_start <= c_high_max, "
                f"got c_high_start={self.c_high_start}, c_high_max={self.c_high_max}"
            )
        if self.c_low_step <= 0.0:
            raise ValueError(f"{prefix}.c_low_step must be > 0, got {self.c_low_step}")
        if self.c_high_step <= 0.0:
            raise ValueError(f"{prefix}.c_high_step must be > 0, got {self.c_high_step}")
        if self.granularity not in ("step", "microbatch"):
            raise ValueError(
                f"{prefix}.granularity must be 'step' or 'microbatch', got {self.granularity!r}"
            )
        if self.dual_clip is not None:
            if isinstance(self.dual_clip, bool) or not isinstance(self.dual_clip, (int, float)):
                raise ValueError(f"{prefix}.dual_clip must be a number > 1 or null, got {self.dual_clip!r}")
            self.dual_clip = float(self.dual_clip)
            if not (self.dual_clip > 1.0 and math.isfinite(self.dual_clip)):
                raise ValueError(f"{prefix}.dual_clip must be > 1 (or null to disable), got {self.dual_clip}")

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> "ClipSearchConfig":
        """The named preset (`paper`, `reference`, `grpo`, `clip-higher`) with ``overrides`` applied."""
        if name not in CLIP_PRESETS:
            raise ValueError(f"loss.clip.preset must be one of {sorted(CLIP_PRESETS)}, got {name!r}")
        return cls(preset=name, **{**CLIP_PRESETS[name], **overrides})


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss: clipped surrogate, its aggregation and the clip-bound search."""

    clip: ClipSearchConfig = field(default_factory=ClipSearchConfig)
    """Clip bounds and their adaptive search."""
    aggregation: Aggregation = "token-mean"
    """`token-mean`: sum over the optimizer step's response tokens / their global count;
    `seq-mean-token-mean`: mean over sequences of each sequence's token mean;
    `seq-mean-token-sum`: mean over sequences of each sequence's token sum."""
    truncated_is_cap: float | None = None
    """Cap of the truncated importance weight exp(recomputed - behaviour) multiplied into the loss
    when the ratio is taken against recomputed log-probs; None: no weight."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.truncated_is_cap is not None and not (
            isinstance(self.truncated_is_cap, (int, float)) and self.truncated_is_cap > 0
        ):
            raise ValueError(f"loss.truncated_is_cap must be > 0 or null, got {self.truncated_is_cap!r}")


ModelType = Literal["llama", "qwen2"]
ParamsDtype = Literal["float32", "bfloat16"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8", "blockwise"]
Fp8AmaxAlgo = Literal["most_recent", "max"]

MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's architecture: the decoder-only families the paper trains (Qwen2/Qwen2.5 and
    Llama). Both are pre-norm RMSNorm transformers with rotary embeddings, grouped-query attention,
    a SwiGLU MLP (implied, not configurable) and no bias except, for Qwen2, on q/k/v.

    Usually read from a Hugging Face ``config.json`` with :meth:`from_hf_config`.
    """

    model_type: ModelType
    """Hugging Face ``model_type``: `llama` or `qwen2` (Qwen2 and Qwen2.5 share it)."""
    num_layers: int
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream (HF ``hidden_size``)."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP, per gate/up projection (HF ``intermediate_size``)."""
    num_attention_heads: int
    """Query heads (HF ``num_attention_heads``); hidden_size must be a multiple."""
    num_query_groups: int
    """Key/value heads for grouped-query attention (HF ``num_key_value_heads``); equal to
    num_attention_heads for plain multi-head attention, and must divide it."""
    vocab_size: int
    """Rows of the embedding and output matrices (HF ``vocab_size``, already padded by the
    checkpoint; not padded again here)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies (HF ``rope_theta``; Qwen2 uses 1e6)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    qkv_bias: bool | None = None
    """Bias on the q/k/v projections only; None takes the family's: True for Qwen2, False for
    Llama."""
    tie_word_embeddings: bool = False
    """The output layer reuses the input embedding matrix (HF ``tie_word_embeddings``; small
    Qwen2.5 models tie, Llama and larger Qwen2.5 do not)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is run on (HF ``max_position_embeddings``)."""
    params_dtype: ParamsDtype = "float32"
    """Dtype of the parameters Megatron allocates: `float32`, or `bfloat16` (Megatron's bf16 mode:
    bf16 parameters and activations, fp32 main weights in the optimizer)."""

    def __post_init__(self) -> None:
        prefix = "model"
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"{prefix}.model_type must be one of {list(MODEL_TYPES)}, got {self.model_type!r}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{prefix}.{name} must be a finite number > 0, got {value!r}")
            setattr(self, name, float(value))
        if self.qkv_bias is None:
            self.qkv_bias = self.model_type == "qwen2"
        for name in ("qkv_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{prefix}.{name} must be true or false, got {getattr(self, name)!r}")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{prefix}.params_dtype must be 'float32' or 'bfloat16', got {self.params_dtype!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{prefix}.hidden_size ({self.hidden_size}) must be a multiple of "
                f"{prefix}.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{prefix}.num_query_groups ({self.num_query_groups}) must divide "
                f"{prefix}.num_attention_heads ({self.num_attention_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"{prefix}: the head dimension hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head (hidden_size / num_attention_heads)."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, source: str | Path | Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (LlamaConfig or Qwen2Config field names).

        ``source`` is the file, the checkpoint folder holding it, or the already parsed mapping;
        ``overrides`` set fields that are not in the file (``params_dtype``) or replace ones that
        are (``max_position_embeddings``). Anything this model definition cannot represent
        exactly (rope scaling, sliding-window attention, an MLP or output-projection bias, a head
        dimension other than hidden/heads, an activation other than SiLU) raises ``ValueError``
        naming the file and the field, rather than loading a silently different model.
        """
        if isinstance(source, Mapping):
            where, hf = "<config mapping>", dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            if not path.is_file():
                raise ValueError(f"HF config {where} does not exist")
            try:
                hf = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"HF config {where} is not valid JSON: {err}") from None
            if not isinstance(hf, dict):
                raise ValueError(f"HF config {where}: expected a JSON object at the top level")

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ValueError(f"HF config {where}: required field {key!r} is missing")
            return hf[key]

        model_type = need("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"HF config {where}: model_type {model_type!r} is not supported; "
                f"supported: {list(MODEL_TYPES)}"
            )

        def refuse(key: str, why: str) -> None:
            raise ValueError(f"HF config {where}: {key}={hf[key]!r} is not supported ({why})")

        if hf.get("rope_scaling") is not None:
            refuse("rope_scaling", "only plain RoPE with rope_theta is implemented")
        # transformers >= 5 writes the RoPE base (and any scaling) inside rope_parameters.
        rope = hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if isinstance(rope, Mapping):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"HF config {where}: rope_parameters.rope_type={rope_type!r} is not "
                                 "supported (only plain RoPE with rope_theta is implemented)")
            nested = rope.get("rope_theta")
            if nested is not None and rope_theta is not None and nested != rope_theta:
                raise ValueError(f"HF config {where}: rope_theta={rope_theta!r} and "
                                 f"rope_parameters.rope_theta={nested!r} disagree")
            rope_theta = nested if nested is not None else rope_theta
        if hf.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "both families use a SwiGLU MLP with SiLU")
        if hf.get("mlp_bias"):
            refuse("mlp_bias", "the MLP has no bias")
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            refuse("use_sliding_window", "sliding-window attention is not implemented")
        if model_type == "llama" and hf.get("attention_bias"):
            # Llama's attention_bias puts a bias on o_proj as well; Megatron can bias q/k/v only
            # (add_qkv_bias) or every linear layer including the MLP (add_bias_linear).
            refuse("attention_bias", "Llama's flag also biases o_proj, which has no Megatron "
                   "equivalent here")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = hf.get("head_dim")
        if head_dim is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
                and head_dim != hidden // heads:
            refuse("head_dim", f"must equal hidden_size / num_attention_heads = {hidden // heads}")

        values: dict[str, Any] = dict(
            model_type=model_type,
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,  # absent in old MHA configs
            vocab_size=need("vocab_size"),
            rope_theta=10000.0 if rope_theta is None else rope_theta,
            rms_norm_eps=need("rms_norm_eps"),
            qkv_bias=model_type == "qwen2",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=need("max_position_embeddings"),
        )
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"HF config {where}: {err}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` fields of this architecture (the inverse of
        :meth:`from_hf_config`): ``transformers.AutoConfig.for_model(**it)`` builds the
        equivalent ``LlamaConfig`` / ``Qwen2Config``."""
        fields: dict[str, Any] = dict(
            model_type=self.model_type,
            architectures=["LlamaForCausalLM" if self.model_type == "llama" else "Qwen2ForCausalLM"],
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            vocab_size=self.vocab_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            torch_dtype=self.params_dtype,
        )
        if self.model_type == "llama":
            fields.update(attention_bias=False, mlp_bias=False, head_dim=self.head_dim)
        elif not self.qkv_bias:
            raise ValueError("model.qkv_bias=false has no Qwen2 config.json equivalent (Qwen2 always "
                             "biases q/k/v)")
        return fields


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor is split over ranks, and its FP8 mode. Data parallel is what is left: world
    size / (tensor x pipeline x context). Which combinations a given model and world size accept
    is checked by :func:`validate_layout`. The fp8 fields are passed through unchanged to
    Megatron's ``TransformerConfig`` (they need Transformer Engine and an FP8-capable GPU)."""

    tensor_model_parallel_size: int = 1
    """Ranks each layer's matrices are split over (heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; each holds a contiguous block of layers."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage for the interleaved schedule; None: not interleaved."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over (needs Transformer Engine's attention)."""
    sequence_parallel: bool = False
    """Shard norm and dropout activations over the tensor-parallel ranks along the sequence
    (Megatron's sequence parallelism; needs tensor_model_parallel_size > 1)."""
    fp8: Fp8Format | None = None
    """FP8 format for Transformer Engine GEMMs: `e4m3`, or `hybrid` (e4m3 forward, e5m2
    gradients); None: no FP8. Passed through to Megatron."""
    fp8_recipe: Fp8Recipe = "delayed"
    """Transformer Engine scaling recipe: `delayed`, `tensorwise`, `mxfp8` (Blackwell) or
    `blockwise`. Passed through to Megatron."""
    fp8_amax_history_len: int = 1
    """Window of amax values kept for the delayed-scaling factor. Passed through to Megatron."""
    fp8_amax_compute_algo: Fp8AmaxAlgo = "most_recent"
    """Amax from the window used for scaling: `most_recent` or `max`. Passed through to
    Megatron."""

    def __post_init__(self) -> None:
        prefix = "parallel"
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "fp8_amax_history_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 2:
                raise ValueError(
                    f"{prefix}.virtual_pipeline_model_parallel_size must be an integer >= 2 or null, "
                    f"got {vpp!r}"
                )
            if self.pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"{prefix}.virtual_pipeline_model_parallel_size={vpp} needs "
                    f"{prefix}.pipeline_model_parallel_size > 1, got {self.pipeline_model_parallel_size}"
                )
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"{prefix}.sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                f"{prefix}.sequence_parallel=true needs {prefix}.tensor_model_parallel_size > 1 "
                "(it shards activations over the tensor-parallel ranks)"
            )
        if self.fp8 not in (None, "e4m3", "hybrid"):
            raise ValueError(f"{prefix}.fp8 must be 'e4m3', 'hybrid' or null, got {self.fp8!r}")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(
                f"{prefix}.fp8_recipe must be one of ['delayed', 'tensorwise', 'mxfp8', 'blockwise'], "
                f"got {self.fp8_recipe!r}"
            )
        if self.fp8_amax_compute_algo not in ("most_recent", "max"):
            raise ValueError(
                f"{prefix}.fp8_amax_compute_algo must be 'most_recent' or 'max', "
                f"got {self.fp8_amax_compute_algo!r}"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tensor x pipeline x context."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)


LrDecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam with decoupled weight decay, a warmup/decay learning-rate schedule and gradient
    clipping: Megatron's optimizer and ``OptimizerParamScheduler``, configured from here."""

    lr: float = 1e-6
    """Peak learning rate (reached after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (`linear`, `cosine`)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    lr_decay_steps: int | None = None
    """Optimizer steps from the start to the end of the decay; None: no decay (``lr`` after
    warmup, whatever ``lr_decay_style`` says)."""
    lr_decay_style: LrDecayStyle = "constant"
    """`constant`, `linear` or `cosine` decay from ``lr`` to ``min_lr``."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; Megatron exempts biases and norm weights."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still
    computed, logged, and checked for inf/nan)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer).
    Its trainer checkpoints are saved in Megatron's ``dp_reshardable`` format (also on the CPU,
    see :mod:`bapo_megatron.trainer.checkpoint`)."""

    def __post_init__(self) -> None:
        prefix = "optimizer"
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"{prefix}.{name} must be a finite number >= 0, got {value!r}")
            setattr(self, name, float(value))
        if self.min_lr > self.lr:
            raise ValueError(f"{prefix}.min_lr ({self.min_lr}) must not exceed {prefix}.lr ({self.lr})")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{prefix}.{name} must lie in [0, 1), got {value!r}")
            setattr(self, name, float(value))
        if isinstance(self.lr_warmup_steps, bool) or not isinstance(self.lr_warmup_steps, int) \
                or self.lr_warmup_steps < 0:
            raise ValueError(f"{prefix}.lr_warmup_steps must be an integer >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_decay_steps is not None:
            if isinstance(self.lr_decay_steps, bool) or not isinstance(self.lr_decay_steps, int) \
                    or self.lr_decay_steps <= self.lr_warmup_steps:
                raise ValueError(
                    f"{prefix}.lr_decay_steps must be an integer > lr_warmup_steps "
                    f"({self.lr_warmup_steps}) or null, got {self.lr_decay_steps!r}"
                )
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"{prefix}.lr_decay_style must be 'constant', 'linear' or 'cosine', got {self.lr_decay_style!r}"
            )
        if not isinstance(self.use_distributed_optimizer, bool):
            raise ValueError(
                f"{prefix}.use_distributed_optimizer must be true or false, got {self.use_distributed_optimizer!r}"
            )


@dataclass(kw_only=True)
class ActorConfig:
    """How the actor runs its passes over a batch."""

    micro_batch_size: int = 1
    """Sequences per micro-batch (one forward/backward of the pipeline schedule)."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: the actor's log-probs and entropy are those of
    softmax(logits / temperature), the distribution the engine sampled from."""
    seed: int = 1234
    """Seed of the initial weights (when not loaded from a checkpoint)."""

    def __post_init__(self) -> None:
        prefix = "actor"
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                or self.micro_batch_size < 1:
            raise ValueError(f"{prefix}.micro_batch_size must be a positive integer, got {self.micro_batch_size!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{prefix}.temperature must be a finite number > 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{prefix}.seed must be an integer >= 0, got {self.seed!r}")


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """What the machine offers that some layouts need; probed by :meth:`detect`, or given
    explicitly (tests, dry runs on another machine)."""

    transformer_engine: bool
    """Transformer Engine is importable."""
    cuda: bool
    """A CUDA GPU is visible to torch."""
    fp8_gpu: bool
    """The GPU computes in FP8 (compute capability 8.9 or newer: Ada, Hopper, Blackwell)."""

    @classmethod
    def detect(cls) -> "Accelerator":
        """Probe the current process (does not import Transformer Engine)."""
        import importlib.util

        import torch

        te = importlib.util.find_spec("transformer_engine") is not None
        cuda = torch.cuda.is_available()
        fp8 = cuda and torch.cuda.get_device_capability() >= (8, 9)
        return cls(transformer_engine=te, cuda=cuda, fp8_gpu=fp8)


def validate_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int,
                    accelerator: Accelerator | None = None) -> int:
    """Check that ``parallel`` can split ``model`` over ``world_size`` ranks on this machine
    (``accelerator``: probed when None) and return the data-parallel size. Raises ``ValueError``
    naming the fields on the first problem."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp, vpp = parallel.context_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if world_size % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel = "
            f"{tp} x {pp} x {cp} = {parallel.model_parallel_size} "
            "(parallel.tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size)"
        )
    tp_divided = (
        ("num_attention_heads", ""),
        ("num_query_groups", "; every rank needs whole key/value heads"),
        ("ffn_hidden_size", ""),
        ("vocab_size", "; vocabulary padding is not implemented"),
    )
    for name, why in tp_divided:
        value = getattr(model, name)
        if value % tp:
            raise ValueError(
                f"model.{name} ({value}) is not divisible by "
                f"parallel.tensor_model_parallel_size ({tp}){why}"
            )
    chunks = pp * (vpp or 1)
    if model.num_layers % chunks:
        what = f"pipeline x virtual pipeline = {pp} x {vpp}" if vpp else f"pipeline = {pp}"
        raise ValueError(
            f"model.num_layers ({model.num_layers}) is not divisible by {what} "
            "(parallel.pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)"
        )
    if accelerator is None:
        accelerator = Accelerator.detect()
    if cp > 1 and not (accelerator.transformer_engine and accelerator.cuda):
        raise ValueError(
            f"parallel.context_parallel_size={cp} needs Transformer Engine on a CUDA GPU "
            f"(found transformer_engine={accelerator.transformer_engine}, cuda={accelerator.cuda}); "
            "set it to 1"
        )
    if parallel.fp8 is not None:
        if not accelerator.transformer_engine:
            raise ValueError(
                f"parallel.fp8={parallel.fp8!r} needs Transformer Engine, which is not installed; "
                "set parallel.fp8=null"
            )
        if not accelerator.fp8_gpu:
            raise ValueError(
                f"parallel.fp8={parallel.fp8!r} needs a GPU with FP8 support (compute capability "
                f">= 8.9), found {'a GPU without it' if accelerator.cuda else 'no GPU'}; "
                "set parallel.fp8=null"
            )
    return world_size // parallel.model_parallel_size


def _positive_int(value: object, where: str, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an integer >= {low}, got {value!r}")


EngineKind = Literal["embedded", "vllm", "vllm-server", "sglang", "sglang-server"]
ENGINE_KINDS: tuple[str, ...] = ("embedded", "vllm", "vllm-server", "sglang", "sglang-server")


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are generated. Temperature is ``actor.temperature`` (the actor's log-probs
    must be those of the distribution the engine sampled from)."""

    engine: EngineKind = "embedded"
    """`embedded`: transformers on the trainer's processes (CPU, the default); `vllm` / `sglang`:
    the engine in-process on the first rank of each model replica, colocated with the actor;
    `vllm-server` / `sglang-server`: a separately started server at ``server_urls``."""
    prompts_per_step: int = 16
    """Prompts drawn per rollout step, over all data-parallel ranks (must divide evenly)."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group size n)."""
    max_new_tokens: int = 256
    """Response length cap; a response cut there ends with finish reason `length`."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 keeps the full distribution (the actor's ratio is then exact)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    partial_tokens_per_round: int | None = None
    """Partial rollout: each rollout step generates at most this many tokens per response;
    unfinished responses are paused, carried to the next step and continued under the weights
    of that step (their tokens keep the version they were sampled with). None: off."""
    server_urls: tuple[str, ...] = ()
    """Base URLs of the rollout servers (`vllm-server`, `sglang-server`), one per data-parallel
    rank, or one shared by all."""
    engine_tensor_parallel_size: int = 1
    """Tensor parallelism inside an in-process vLLM/SGLang engine (GPUs it spans)."""
    gpu_memory_utilization: float = 0.5
    """Memory share of an in-process engine, passed on as each engine defines it: vLLM's
    ``gpu_memory_utilization`` (its own budget, which must fit in what the actor leaves free) or
    SGLang's ``mem_fraction_static`` (a share of the whole GPU, the actor's memory included), so
    the same number means more KV cache under SGLang."""
    release_memory_during_training: bool = False
    """Have the engine free its weights and KV cache while the actor trains and reload them for
    the weight sync (colocated GPU runs; a logged no-op where the engine cannot)."""
    weight_bucket_mib: int = 512
    """Size bound of a bucket of the live weight export to the engine."""
    timeout_s: float | None = None
    """Seconds one generation call may take: past it the engine is aborted and the run stops
    with an error naming the engine (None: no limit). Server clients also give up on a request
    that gets no answer for this long (one hour when None)."""

    def __post_init__(self) -> None:
        prefix = "rollout"
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool)
                                           or not isinstance(self.timeout_s, (int, float))
                                           or not self.timeout_s > 0):
            raise ValueError(f"{prefix}.timeout_s must be a positive number of seconds or null, "
                             f"got {self.timeout_s!r}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"{prefix}.engine must be one of {list(ENGINE_KINDS)}, got {self.engine!r}")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens",
                     "engine_tensor_parallel_size", "weight_bucket_mib"):
            _positive_int(getattr(self, name), f"{prefix}.{name}")
        _positive_int(self.top_k, f"{prefix}.top_k", allow_zero=True)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}.top_p must lie in (0, 1], got {self.top_p!r}")
        if self.partial_tokens_per_round is not None:
            _positive_int(self.partial_tokens_per_round, f"{prefix}.partial_tokens_per_round")
        if not isinstance(self.release_memory_during_training, bool):
            raise ValueError(f"{prefix}.release_memory_during_training must be true or false, "
                             f"got {self.release_memory_during_training!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{prefix}.gpu_memory_utilization must lie in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        self.server_urls = tuple(self.server_urls)
        if self.engine.endswith("-server") and not self.server_urls:
            raise ValueError(f"{prefix}.engine={self.engine!r} needs {prefix}.server_urls")


SyntheticTask = Literal["walk", "seek"]


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from: a prompt file, or the built-in synthetic task."""

    train_file: str | None = None
    """JSONL or parquet prompt set (fields ``prompt``, ``answer``, optional ``id``)."""
    synthetic_task: SyntheticTask | None = None
    """Generate the prompts instead (:mod:`bapo_megatron.data.synthetic_task`): `walk` ("7>12" ->
    "8 9 10 11 12") or `seek` (count up a ring to the first number ending in a digit; a miss that
    keeps counting runs to the length cap). Both bring their own character tokenizer; the model
    must then be given in the ``model`` section with ``vocab_size`` at least the tokenizer's."""
    synthetic_size: int = 2000
    """Prompts generated for the synthetic task."""
    skip_bad_rows: bool = False
    """Skip (and count) malformed rows of ``train_file`` instead of stopping at the first."""
    system_prompt: str | None = None
    """System turn put before every prompt in the chat template; None: none."""
    shuffle: bool = True
    """Visit the prompts in a seeded random order, reshuffled every epoch."""

    def __post_init__(self) -> None:
        prefix = "data"
        if (self.train_file is None) == (self.synthetic_task is None):
            raise ValueError(f"{prefix}: give exactly one of {prefix}.train_file and "
                             f"{prefix}.synthetic_task")
        if self.synthetic_task not in (None, "walk", "seek"):
            raise ValueError(f"{prefix}.synthetic_task must be 'walk', 'seek' or null, "
                             f"got {self.synthetic_task!r}")
        _positive_int(self.synthetic_size, f"{prefix}.synthetic_size")


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are scored: a reward from :mod:`bapo_megatron.rewards.registry`."""

    name: str = "math"
    """Registered reward (`math`, `math_lenient`, `exact_match`) or ``package.module:function``."""
    workers: int = 2
    """Processes scoring responses."""
    timeout_s: float = 10.0
    """Time limit of one check; an overrun scores 0 and is counted."""

    def __post_init__(self) -> None:
        _positive_int(self.workers, "reward.workers")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be a number > 0, got {self.timeout_s!r}")


OldLogprobs = Literal["engine", "recompute"]


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and the off-policy data schedule (spec section 6)."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); false: Dr. GRPO."""
    filter_equal_groups: bool = False
    """Drop groups whose rewards are all equal (no signal under group normalisation)."""
    old_logprobs: OldLogprobs = "engine"
    """Denominator of the ratio: `engine` (behaviour log-probs the engine reported) or
    `recompute` (the actor's log-probs at the start of the rollout step; with
    ``loss.truncated_is_cap`` the capped exp(recomputed - behaviour) weights the loss)."""
    optimizer_steps_per_rollout: int = 1
    """Mini-batches each rollout batch is split into, one optimizer step each: the last one is
    trained with data that many - 1 policy versions stale."""
    epochs: int = 1
    """Passes over the rollout batch's mini-batches (PPO epochs)."""
    rollout_lag: int = 0
    """Train on the rollout batch generated this many rollout steps earlier (a queue; the
    first steps only generate): staleness by lag, as in asynchronous RL."""
    replay_fraction: float = 0.0
    """Share of each training batch's groups drawn from the replay buffer of earlier rollout
    batches (0: no replay)."""
    replay_capacity: int = 256
    """Groups the replay buffer keeps (oldest evicted first)."""
    replay_max_staleness: int = 8
    """Groups older than this many policy versions are evicted and never replayed. Counted when
    the training batch is put together: its later mini-batches and epochs train the replayed
    groups up to ``optimizer_steps_per_rollout * epochs - 1`` versions later still (the
    ``staleness/*`` metrics report what was trained)."""

    def __post_init__(self) -> None:
        prefix = "algorithm"
        for name in ("normalize_std", "filter_equal_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{prefix}.{name} must be true or false, got {getattr(self, name)!r}")
        if self.old_logprobs not in ("engine", "recompute"):
            raise ValueError(f"{prefix}.old_logprobs must be 'engine' or 'recompute', got {self.old_logprobs!r}")
        for name in ("optimizer_steps_per_rollout", "epochs", "replay_capacity", "replay_max_staleness"):
            _positive_int(getattr(self, name), f"{prefix}.{name}")
        _positive_int(self.rollout_lag, f"{prefix}.rollout_lag", allow_zero=True)
        if isinstance(self.replay_fraction, bool) or not isinstance(self.replay_fraction, (int, float)) \
                or not 0 <= self.replay_fraction < 1:
            raise ValueError(f"{prefix}.replay_fraction must lie in [0, 1), got {self.replay_fraction!r}")
        self.replay_fraction = float(self.replay_fraction)


@dataclass(kw_only=True)
class WarmupConfig:
    """A supervised warm-up on the synthetic task's reference responses before RL, for runs that
    start from random weights (nothing can be downloaded for the tiny run). Cross-entropy on the
    response tokens, with its own Adam and learning rate."""

    steps: int = 0
    """Optimizer steps of the warm-up; 0: none."""
    lr: float = 1e-3
    """Constant learning rate of the warm-up."""
    batch_size: int = 32
    """Sequences per warm-up step, over all data-parallel ranks."""

    def __post_init__(self) -> None:
        _positive_int(self.steps, "warmup.steps", allow_zero=True)
        _positive_int(self.batch_size, "warmup.batch_size")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"warmup.lr must be a number > 0, got {self.lr!r}")
        self.lr = float(self.lr)


@dataclass(kw_only=True)
class TrainConfig:
    """The run: how long, from which weights, and where its outputs go."""

    steps: int = 100
    """Rollout steps (each: generate, score, one or more optimizer steps, weight sync)."""
    model_path: str | None = None
    """HF folder (config.json, safetensors, tokenizer) the policy starts from; None: the
    ``model`` section's architecture with random weights (and ``warmup``)."""
    params_dtype: ParamsDtype | None = None
    """Parameter dtype for a model read from ``model_path`` (`float32`, `bfloat16`); None: float32."""
    max_position_embeddings: int | None = None
    """Longest prompt + response the run uses, for a model read from ``model_path`` (caps the
    engines' context too); None: the checkpoint's ``max_position_embeddings``."""
    load_checkpoint: str | None = None
    """Megatron weights checkpoint the policy starts from, saved at any layout: one written by
    ``tools/convert_checkpoint.py`` or a trainer checkpoint folder (``step_*``). Its model must
    equal the ``model`` section. Only the weights are taken (a fresh optimizer, step 0); to
    continue a run, use ``checkpoint.resume``."""
    output_dir: str = "runs/bapo"
    """Run folder: ``tensorboard/``, ``metrics.jsonl`` and ``checkpoints/``."""
    seed: int = 0
    """Seed of the prompt order and the rollout sampling (each step and rank derive theirs)."""

    def __post_init__(self) -> None:
        _positive_int(self.steps, "train.steps")
        _positive_int(self.seed, "train.seed", allow_zero=True)
        if self.max_position_embeddings is not None:
            _positive_int(self.max_position_embeddings, "train.max_position_embeddings")
        if self.params_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"train.params_dtype must be 'float32', 'bfloat16' or null, got {self.params_dtype!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Trainer checkpoints (model, optimizer, schedule, RNG, data position, replay buffer,
    step, policy version), written aside and renamed into place."""

    interval: int = 0
    """Save every this many rollout steps (and after the last); 0: only after the last."""
    keep_last: int | None = 2
    """Complete checkpoints kept (older ones deleted); None keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in ``<output_dir>/checkpoints`` if one
    exists (a run killed at any point resumes from its last complete checkpoint)."""

    def __post_init__(self) -> None:
        _positive_int(self.interval, "checkpoint.interval", allow_zero=True)
        if self.keep_last is not None:
            _positive_int(self.keep_last, "checkpoint.keep_last")
        if not isinstance(self.resume, bool):
            raise ValueError(f"checkpoint.resume must be true or false, got {self.resume!r}")


@dataclass(kw_only=True)
class LoggingConfig:
    """Monitoring output (written by rank 0)."""

    tensorboard: bool = True
    """Write TensorBoard event files to ``<output_dir>/tensorboard``."""
    console: bool = True
    """Print one progress line per rollout step."""
    logprob_diff_interval: int = 10
    """Every this many rollout steps, recompute the actor's log-probs of the training batch to
    log the engine/actor gap over its tokens sampled with the current weights (free, and every
    step, with ``algorithm.old_logprobs=recompute``); 0: never."""

    def __post_init__(self) -> None:
        for name in ("tensorboard", "console"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"logging.{name} must be true or false, got {getattr(self, name)!r}")
        _positive_int(self.logprob_diff_interval, "logging.logprob_diff_interval", allow_zero=True)


@dataclass(kw_only=True)
class Config:
    """Root of a run's configuration (``python -m bapo_megatron.train --config FILE.yaml``)."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    model: ModelConfig | None = None
    """The policy's architecture, for runs from random weights; None when it is read from
    ``train.model_path`` (or for runs without a model, the loss demo)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the actor is split over ranks."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The actor's optimizer and learning-rate schedule (in optimizer steps)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """How the actor runs its passes (micro-batch size, temperature, seed)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    data: DataConfig | None = None
    """Prompts; required for training."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the off-policy schedule."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up before RL (synthetic task only)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length, initial weights, outputs."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard and console output."""

    def check_training(self) -> None:
        """Raise ``ValueError`` naming the fields when this config cannot drive a training run
        (the checks that span sections; each section checks itself when built)."""
        if self.data is None:
            raise ValueError("data: a training run needs a data section (data.train_file or "
                             "data.synthetic_task)")
        if (self.model is None) == (self.train.model_path is None):
            raise ValueError("give exactly one of the model section (random initial weights) and "
                             "train.model_path (an HF folder)")
        if self.data.synthetic_task is not None and self.model is None:
            raise ValueError("data.synthetic_task brings its own tokenizer, so the model must be "
                             "given in the model section, not train.model_path")
        if self.train.load_checkpoint is not None and self.model is None:
            raise ValueError("train.load_checkpoint needs the model section (the architecture the "
                             "checkpoint's weights must match)")
        if self.warmup.steps and self.train.load_checkpoint is not None:
            raise ValueError("warmup.steps > 0 trains random initial weights; with "
                             "train.load_checkpoint set warmup.steps=0")
        if self.warmup.steps and self.data.synthetic_task is None:
            raise ValueError("warmup.steps > 0 needs data.synthetic_task (the warm-up trains on "
                             "its reference responses)")
        for name in ("params_dtype", "max_position_embeddings"):
            if getattr(self.train, name) is not None and self.train.model_path is None:
                raise ValueError(f"train.{name} applies to train.model_path; with a model "
                                 f"section set model.{name}")
        if self.rollout.engine == "vllm" and self.rollout.engine_tensor_parallel_size > 1:
            raise ValueError("rollout.engine=vllm runs vLLM's single-process executor (one GPU); "
                             "for rollout.engine_tensor_parallel_size > 1 start a vLLM server and "
                             "use rollout.engine=vllm-server")
        if self.loss.truncated_is_cap is not None and self.algorithm.old_logprobs != "recompute":
            raise ValueError("loss.truncated_is_cap needs algorithm.old_logprobs=recompute (the "
                             "weight is exp(recomputed - behaviour))")
        steps = self.algorithm.optimizer_steps_per_rollout
        if self.rollout.prompts_per_step % steps:
            raise ValueError(f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) must be a "
                             f"multiple of algorithm.optimizer_steps_per_rollout ({steps}): each "
                             "mini-batch takes whole groups")
        if self.rollout.partial_tokens_per_round is not None and (
                self.algorithm.rollout_lag or self.algorithm.replay_fraction):
            raise ValueError("rollout.partial_tokens_per_round cannot be combined with "
                             "algorithm.rollout_lag or algorithm.replay_fraction in one run")
