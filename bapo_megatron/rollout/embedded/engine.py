"""The embedded rollout engine: a transformers causal LM in the trainer's process, with a KV
cache and this project's own sampling loop, which records each sampled token's behaviour
log-prob and policy version. The default engine; it runs on the CPU, or on its rank's GPU.

All samples of a call decode together as one batch: prompts (with any tokens already generated,
when continuing) are left-padded, and rows that finish keep decoding padding until every row
is done or the round's budget is spent; their outputs are ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import transformers

from bapo_megatron.config import ModelConfig
from bapo_megatron.models.experts import fused_expert_view
from bapo_megatron.rollout.checksum import Checksum
from bapo_megatron.rollout.embedded.experts import RouteRecorder
from bapo_megatron.rollout.embedded.sampling import next_tokens
from bapo_megatron.rollout.embedded.shard_receiver import EmbeddedShardReceiving
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams, check_prompts, check_ready

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EmbeddedEngine(EmbeddedShardReceiving):
    """A :class:`~bapo_megatron.rollout.protocol.RolloutEngine` on transformers' Llama/Qwen2/Qwen3
    and Qwen3-MoE (per-expert weight names accepted; ``record_routes`` fills each sample's
    ``routes``).

    Built from a :class:`ModelConfig` with random weights (the trainer then pushes its own with
    :meth:`update_weights`), or from an HF folder with :meth:`from_pretrained`.
    """

    def __init__(
        self,
        model: ModelConfig,
        *,
        dtype: torch.dtype | None = None,
        pad_token_id: int = 0,
        device: str | torch.device = "cpu",
        record_routes: bool = False,
    ) -> None:
        hf_config = transformers.AutoConfig.for_model(**model.to_hf_config())
        self.model_config = model
        self.dtype = dtype or _DTYPES[model.params_dtype]
        self.device = torch.device(device)
        """Where the model and its KV cache live (a colocated engine shares its rank's GPU)."""
        self.model = (
            transformers.AutoModelForCausalLM.from_config(hf_config, dtype=self.dtype)
            .to(self.device)
            .eval()
        )
        self.pad_token_id = pad_token_id
        if record_routes and not model.is_moe:
            raise ValueError(
                f"record_routes: model_type {model.model_type!r} has no experts to route to"
            )
        self.routes = RouteRecorder(self.model) if record_routes else None
        """Records each token's experts into ``RolloutSample.routes`` (MoE models)."""
        self.version = -1
        self._abort = threading.Event()
        self._pause = threading.Event()
        self._released = False
        self._kept_buffers: dict[str, torch.Tensor] = {}
        self.token_boundary: Callable[[], None] | None = None
        """Called before each decoding step of a call (in the generating thread): an
        asynchronous engine rank loads new weights there, between two tokens, so the tokens
        after it carry the new version while the KV cache of the earlier ones stays."""

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, version: int = 0, **kwargs) -> EmbeddedEngine:
        """An engine holding the weights of the HF folder ``folder`` (config.json + safetensors)."""
        engine = cls(ModelConfig.from_hf_config(folder), **kwargs)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=engine.dtype)
        engine.update_weights(loaded.state_dict().items(), version=version)
        return engine

    # -------------------------------------------------------------- generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, round_tokens: int | None = None
    ) -> list[RolloutSample]:
        """``params.n`` samples per prompt, prompt-major (see the protocol)."""
        check_prompts(prompts, self.model_config)
        samples = [
            RolloutSample(prompt_index=p, sample_index=i, prompt_token_ids=list(prompt))
            for p, prompt in enumerate(prompts)
            for i in range(params.n)
        ]
        self._decode(samples, params, round_tokens)
        return samples

    def continue_generation(
        self,
        samples: list[RolloutSample],
        params: SamplingParams,
        *,
        round_tokens: int | None = None,
    ) -> list[RolloutSample]:
        """Continue the `paused` samples in place (see the protocol); returns ``samples``."""
        active = [s for s in samples if s.resumable]
        for sample in active:
            sample.finish_reason = None
        self._decode(active, params, round_tokens)
        return samples

    @torch.no_grad()
    def _decode(
        self, samples: list[RolloutSample], params: SamplingParams, round_tokens: int | None
    ) -> None:
        if not samples:
            return
        if round_tokens is not None and round_tokens < 1:
            raise ValueError(
                f"round_tokens must be a positive integer or None, got {round_tokens!r}"
            )
        check_ready(self._released, self.version)
        self._abort.clear()
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        contexts = [s.prompt_token_ids + s.token_ids for s in samples]
        width = max(map(len, contexts))
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros(len(samples), width, dtype=torch.long)
        for row, ids in enumerate(contexts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        if any(len(s.token_ids) >= params.max_new_tokens for s in samples):
            raise ValueError("a sample to continue has already generated max_new_tokens tokens")
        # a response ends (`length`) at max_new_tokens or where the model's context ends
        context_end = self.model_config.max_position_embeddings
        remaining = torch.tensor(
            [
                min(params.max_new_tokens - len(s.token_ids), context_end - len(ids))
                for s, ids in zip(samples, contexts)
            ],
            device=self.device,
        )
        budget = (
            int(remaining.max())
            if round_tokens is None
            else min(round_tokens, int(remaining.max()))
        )
        alive = torch.ones(len(samples), dtype=torch.bool, device=self.device)
        cache = transformers.DynamicCache()
        step_ids = input_ids
        for _ in range(budget):
            if self.token_boundary is not None:
                self.token_boundary()
            if self._abort.is_set() or self._pause.is_set():
                break
            positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            if self.routes is not None:
                self.routes.start()
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # the prefill's other positions predict nothing sampled
            )
            cache = out.past_key_values
            if self.routes is not None:
                self._add_routes(samples, contexts, step_ids, alive, first=step_ids is input_ids)
            tokens, logprobs = next_tokens(
                out.logits[:, -1],
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                generator=generator,
            )
            # one transfer per token step (on a GPU, one synchronization instead of one per row)
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            for row in alive.nonzero().flatten().tolist():
                sample = samples[row]
                sample.token_ids.append(token_list[row])
                sample.logprobs.append(logprob_list[row])
                sample.versions.append(self.version)
            remaining -= alive.long()
            stopped = alive & torch.isin(tokens, stop)
            exhausted = alive & ~stopped & (remaining <= 0)
            for row in stopped.nonzero().flatten().tolist():
                samples[row].finish_reason = "stop"
            for row in exhausted.nonzero().flatten().tolist():
                samples[row].finish_reason = "length"
            alive &= ~(stopped | exhausted)
            if not bool(alive.any()):
                return
            step_ids = torch.where(alive, tokens, self.pad_token_id)[:, None]
            attention = torch.cat([attention, alive.long()[:, None]], dim=1)
        cut = "abort" if self._abort.is_set() else "paused"
        for row in alive.nonzero().flatten().tolist():
            samples[row].finish_reason = cut

    def _add_routes(
        self,
        samples: list[RolloutSample],
        contexts: list[list[int]],
        step_ids: torch.Tensor,
        alive: torch.Tensor,
        *,
        first: bool,
    ) -> None:
        """The routes of the tokens this model call ran: the whole (left-padded) context on the
        first call of a round, which replaces what the samples held (a continued sample is
        re-run under the current weights), then the token each alive row was fed."""
        routes = self.routes.take(*step_ids.shape)  # [batch, tokens, layers, topk]
        for row, sample in enumerate(samples):
            if first:
                width = len(contexts[row])
                sample.routes = routes[row, routes.shape[1] - width :].tolist()
            elif alive[row]:
                sample.routes.append(routes[row, -1].tolist())

    # -------------------------------------------------------------- control

    def abort(self) -> None:
        """Cut in-flight generation: unfinished samples come back `abort`."""
        self._abort.set()

    def pause(self) -> None:
        """Cut in-flight generation (samples come back `paused`); later calls generate nothing
        until :meth:`resume`."""
        self._pause.set()

    def resume(self) -> None:
        self._pause.clear()

    # -------------------------------------------------------------- weights and memory

    @torch.no_grad()
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        checksum: bool = False,
    ) -> str | None:
        """Copy HF-named tensors into the model (converted to its dtype) and set the version.
        Raises ``ValueError`` naming an unknown tensor or a shape mismatch, before anything is
        copied: a refused update leaves weights and version as they were."""
        if self._released:
            raise RuntimeError("update_weights after release_memory(): call resume_memory() first")
        params = dict(self.model.named_parameters())
        total = Checksum() if checksum else None
        # Check every tensor before copying any, so a bad update leaves the weights untouched.
        # (The tensors are the engine-side copies anyway; holding them briefly costs no more.)
        named_tensors = list(named_tensors)
        targets = {}
        for name, tensor in named_tensors:
            fused = fused_expert_view(name, params)
            if fused is not None:  # a per-expert tensor of transformers' fused experts
                targets[name] = fused
            elif name in params:
                targets[name] = params[name]
            if name not in targets:
                if name == "lm_head.weight" and self.model_config.tie_word_embeddings:
                    continue  # tied: the embedding is the output layer
                raise ValueError(
                    f"update_weights: {name!r} is not a parameter of this "
                    f"{self.model_config.model_type} model"
                )
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(targets[name].shape)}"
                )
        for name, tensor in named_tensors:
            if name in targets:
                targets[name].copy_(tensor.to(targets[name].dtype))
            if total is not None:
                total.add(name, tensor)
        self.version = int(version)
        return total.hexdigest() if total is not None else None

    def release_memory(self) -> None:
        """Free the weights (and, between calls, there is no KV cache to free): the model moves
        to the meta device until :meth:`resume_memory`, after which weights must be updated.
        Its small buffers (rotary frequencies) are kept aside and put back."""
        # Buffers (the rotary inv_freq) are not in the weight stream: keep a copy to put back, or
        # resume_memory would leave them uninitialized (garbage logits, now and then NaN).
        self._kept_buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self.model.to("meta")
        self._released = True

    def resume_memory(self) -> None:
        """Allocate uninitialized weights again; :meth:`update_weights` must follow."""
        if self._released:
            self.model.to_empty(device=self.device)
            with torch.no_grad():
                for name, kept in self._kept_buffers.items():
                    self.model.get_buffer(name).copy_(kept)
            self._kept_buffers = {}
            if self.model_config.tie_word_embeddings:
                self.model.tie_weights()
            self._released = False
            self.version = -1

    def health(self) -> bool:
        return not self._released and self.version >= 0
