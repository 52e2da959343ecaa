"""Disaggregated placement (``rollout.placement: disaggregated``): the torchrun world split into
trainer ranks and engine ranks, the process groups between them, the trainer-side engine client
and the engine ranks' serving loop. See docs/async-design.md."""
