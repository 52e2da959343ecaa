"""Run the staleness sweep on the CPU and write its markdown report.

Same as the console script ``bapo-sweep``; the command line is
:mod:`bapo_megatron.repro.sweep_cli`.
"""

from bapo_megatron.commands.console import sweep

if __name__ == "__main__":
    sweep()
