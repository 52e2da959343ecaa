"""``python -m bapo_megatron.train``: an alias of the trainer's command line
(:mod:`bapo_megatron.trainer.main`)."""
