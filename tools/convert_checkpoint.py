"""Convert between Hugging Face checkpoint folders and Megatron distributed checkpoints.

Same as the console script ``bapo-convert-checkpoint``; the command line is
:mod:`bapo_megatron.weights.convert_cli`.
"""

from bapo_megatron.train.process_exit import skip_final_collection
from bapo_megatron.weights.convert_cli import main

if __name__ == "__main__":
    main()
    skip_final_collection()
