"""``python -m bapo_megatron.train``: an alias of the trainer's command line
(:mod:`bapo_megatron.trainer.main`), and how command-line processes end
(:mod:`bapo_megatron.train.process_exit`)."""
