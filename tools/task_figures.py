"""Measure BAPO's premise on a run (failures longer than successes, rho below rho0, bounds
moving): the command line is :mod:`bapo_megatron.repro.task_figures`."""

from bapo_megatron.repro.task_figures import main

if __name__ == "__main__":
    main()
