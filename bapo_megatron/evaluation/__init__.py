"""Evaluation of a checkpoint on a benchmark (``bapo-evaluate``): avg@k and pass@k of sampled
answers checked by a reward (:mod:`.evaluate`), from an HF folder or a Megatron checkpoint
(:mod:`.checkpoint_source`), and its command line (:mod:`.cli`)."""
