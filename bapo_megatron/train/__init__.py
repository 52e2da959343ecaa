"""``python -m bapo_megatron.train``: the trainer's command line under its short name
(:func:`bapo_megatron.commands.console.train`, the same as ``bapo-train``)."""
