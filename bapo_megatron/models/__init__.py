"""Model-family knowledge, below the configuration, the weights and the rollout engines.

- :mod:`.hf_config`: the families (HF ``model_type``) and what each has; an HF ``config.json``
  read into the fields of ``config.ModelConfig`` and written back.
- :mod:`.rope`: the RoPE variants and their two HF spellings; :mod:`.rope_frequencies`: their
  inverse frequencies as transformers computes them, installed into Megatron's rotary embedding.
- :mod:`.experts`: the mixture-of-experts families' fields, the experts' placement over
  expert-parallel ranks and in transformers' fused expert tensors.
- :mod:`.name_maps`: one name map per family, keyed by ``model_type``: which HF tensors make each
  Megatron parameter, and along which dimension tensor parallelism splits it.
- :mod:`.shard_map`: which HF elements a rank holds and where, one format for both sides of a
  weight transfer; :mod:`.trainer_shards` (Megatron ranks) and :mod:`.vllm_shards` (vLLM's
  tensor-parallel workers) derive it.

Nothing is imported here: ``config`` reads the tables without loading torch.
"""
