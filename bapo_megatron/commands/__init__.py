"""The package's command lines as processes: the console scripts (:mod:`.console`), each
started and ended as :mod:`bapo_megatron.process` says."""
