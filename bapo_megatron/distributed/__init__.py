"""Parallel setup: the :class:`~bapo_megatron.distributed.context.ParallelContext` every
distributed function takes, layout validation, and the collectives the trainer uses."""
