"""What an engine family's builder is handed to start the engine of one data-parallel replica
(:func:`bapo_megatron.rollout.registry.build_engine` makes it from the run's configuration)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.config import ModelConfig, RolloutConfig


@dataclass(frozen=True, kw_only=True)
class EngineSetup:
    """Everything a builder may need to start the engine of one data-parallel replica."""

    rollout: RolloutConfig
    model: ModelConfig
    model_path: str | None
    """The HF folder the run started from (in-process vLLM/SGLang load their first weights and
    their config from it)."""
    url: str | None
    """The replica's server (server clients only)."""
    dp_rank: int
    work_dir: Path
    """Where engines that take weights from disk (the vLLM server) get them."""
    pad_token_id: int
    device: str = "cpu"
    """Where an embedded engine computes: its rank's device (``cuda`` uses the rank's current
    GPU); in-process SGLang starts its workers at the rank's GPU, vLLM takes the rank's current
    one."""
    longest_prompt_tokens: int | None = None
    """Tokens of the run's longest prompt in the chat template (in-process vLLM sizes its context
    and CPU KV cache for the batch from it); None: unknown."""
    record_routes: bool = False
    """Whether vLLM and SGLang ask for the experts of every token (a mixture-of-experts model
    under ``algorithm.routing_replay=rollout``); the embedded engine records them for every
    mixture-of-experts model, as it costs it nothing."""

    @property
    def http_timeout(self) -> float:
        """Seconds a server client waits for an answer: ``rollout.timeout_s``, else an hour."""
        return self.rollout.timeout_s or 3600.0

    @property
    def engine_dtype(self) -> str:
        """The dtype name an in-process vLLM/SGLang engine runs in."""
        return "bfloat16" if self.model.params_dtype == "bfloat16" else "float32"

    def quantization_options(self) -> dict[str, str]:
        """``{"quantization": ...}`` for an in-process vLLM/SGLang engine when
        ``rollout.quantization`` is set, else ``{}``. Where the engine cannot quantize, it
        refuses when it starts (vLLM: its CPU build, :meth:`VLLMEngine.from_pretrained
        <bapo_megatron.rollout.vllm.engine.VLLMEngine.from_pretrained>`); ``parallel.device:
        cpu`` is refused with the configuration (:mod:`bapo_megatron.config.checks`)."""
        quantization = self.rollout.quantization
        return {} if quantization is None else {"quantization": quantization}

    @property
    def starts_without_weights(self) -> bool:
        """Whether the run's model comes from the model section (random initial weights): an
        in-process vLLM/SGLang then starts on dummy weights from :meth:`hf_folder`'s
        ``config.json`` alone, and the trainer's first weight sync, before any rollout, gives it
        the actor's."""
        return self.model_path is None

    def hf_folder(self) -> str:
        """The HF folder an in-process vLLM/SGLang starts from: ``model_path``, else a folder
        under ``work_dir`` holding the model section's ``config.json`` only
        (:attr:`starts_without_weights`)."""
        if self.model_path is not None:
            return self.model_path
        folder = self.work_dir / f"engine_start_dp{self.dp_rank}"
        folder.mkdir(parents=True, exist_ok=True)
        written = folder / "config.json.partial"
        written.write_text(json.dumps(self.model.to_hf_config(), indent=1))
        written.replace(folder / "config.json")  # never a half-written config
        return str(folder)
