"""The package's command lines as processes: the console scripts (:mod:`.console`), what each
installs before its modules import Megatron-Core (:mod:`.process_start`) and how it ends
(:mod:`.process_exit`)."""
