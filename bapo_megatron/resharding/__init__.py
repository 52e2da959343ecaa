"""Shard-to-shard weight transfer from the trainer's ranks into an engine's tensor-parallel
workers: :mod:`.plan` turns the two sides' shard maps (:mod:`bapo_megatron.models.shard_map`)
into messages per bucket, a pure function every rank computes and compares by digest;
:mod:`.execute` runs a plan over a process group, one batched point-to-point call per bucket
(:mod:`.transport`)."""
