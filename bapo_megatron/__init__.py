"""bapo-megatron: BAPO (Balanced Policy Optimization with Adaptive Clipping) at Megatron-Core scale.

The core package imports with torch alone; Megatron-Core, Transformer Engine, vLLM and SGLang are
imported lazily by the modules that need them. Importing the package changes no process-wide
state; the command lines prepare their processes themselves (:mod:`bapo_megatron.commands`).
"""

__version__ = "0.1.0"
