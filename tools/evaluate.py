"""Evaluate a checkpoint on a benchmark: avg@k and pass@k, written to a JSON report.

Same as the console script ``bapo-evaluate``; the command line is
:mod:`bapo_megatron.evaluation.cli`.
"""

from bapo_megatron.commands.console import evaluate

if __name__ == "__main__":
    evaluate()
