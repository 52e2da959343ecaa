"""The layout planner: every rank of a recipe's layout built on the meta device under a fake
process group, its shards, export plan and memory per GPU checked without a GPU
(``bapo-plan-layout``, :mod:`bapo_megatron.planning.cli`)."""
