"""Run the staleness sweep on the CPU and write its markdown report.

Same as the console script ``bapo-sweep``; the command line is
:mod:`bapo_megatron.repro.sweep_cli`.
"""

from bapo_megatron.repro.sweep_cli import main
from bapo_megatron.train.process_exit import skip_final_collection

if __name__ == "__main__":
    main()
    skip_final_collection()
