"""Weights between Hugging Face checkpoints, Megatron-Core checkpoints and the live actor.

- :mod:`.name_maps`: one name map per model family (HF ``model_type``), the only place that knows
  how HF tensors become Megatron parameters: names, q/k/v and gate/up merging, and along which
  dimension tensor parallelism splits each tensor.
- :mod:`.hf_checkpoint`: read an HF folder lazily and validate it; write safetensors shards.
- :mod:`.staging`: outputs are built in a hidden sibling folder and renamed into place.
- :mod:`.megatron_checkpoint`: torch_dist save/load of the actor's chunks at any layout.
- :mod:`.export`: the live export of the actor's sharded parameters as HF-named buckets.
- :mod:`.convert`: HF -> Megatron and Megatron -> HF, over the modules above.
"""
