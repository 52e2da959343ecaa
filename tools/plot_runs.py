"""Draw PNG panels of training runs from their TensorBoard logs.

Same as the console script ``bapo-plot-runs``; the command line is
:mod:`bapo_megatron.repro.plots_cli`.
"""

from bapo_megatron.commands.console import plot_runs

if __name__ == "__main__":
    plot_runs()
