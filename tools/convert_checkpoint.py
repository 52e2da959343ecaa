"""Convert between Hugging Face checkpoint folders and Megatron distributed checkpoints.

Same as the console script ``bapo-convert-checkpoint``; the command line is
:mod:`bapo_megatron.weights.convert_cli`.
"""

from bapo_megatron.commands.console import convert_checkpoint

if __name__ == "__main__":
    convert_checkpoint()
