"""What every command-line process of the package does at its two ends: what it installs before
its modules import Megatron-Core (:mod:`.start`) and how it ends (:mod:`.end`). The console
scripts (:mod:`bapo_megatron.commands.console`), the tools in ``tools/`` and the device check's
processes call them."""
