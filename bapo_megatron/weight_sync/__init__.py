"""The policy's weights into the rollout engines; ``README.md`` beside this file draws every
path (which transport for which placement and engine, what crosses the wire, what is checked
before any byte moves).

- :mod:`.interface`: :class:`~.interface.WeightSync`, what the loop opens, pushes and closes,
  and :func:`~.interface.open_weight_sync`, which picks the transport.
- :mod:`.colocated_stream`: into each replica's own engine (in process, or a server's client).
- :mod:`.stage_broadcast`: into engines on ranks of their own, a broadcast per pipeline stage
  (both ends of the wire).
- :mod:`.shard_to_shard`: every engine worker its own shard, straight from the trainer ranks
  that hold it; over :mod:`.shard_plan_cache` (maps and plan, once per layout) and
  :mod:`.transfer_group`.
"""
