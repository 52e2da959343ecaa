"""bapo-megatron: BAPO (Balanced Policy Optimization with Adaptive Clipping) at Megatron-Core scale.

The core package imports with torch alone; Megatron-Core, Transformer Engine, vLLM and SGLang are
imported lazily by the modules that need them.
"""

__version__ = "0.1.0"

import warnings

# Megatron-Core warns at import, once per module, that it falls back to torch implementations
# when Transformer Engine or NVIDIA Apex is missing: always the case on CPU, where the fallback is
# the intended path (docs/megatron-cpu.md). The project's docs say which paths need either.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
