"""bapo-megatron: BAPO (Balanced Policy Optimization with Adaptive Clipping) at Megatron-Core scale.

The core package imports with torch alone; Megatron-Core, Transformer Engine, vLLM and SGLang are
imported lazily by the modules that need them.
"""

from bapo_megatron.megatron_patches.deferred_jit_compile import defer_jit_compile
from bapo_megatron.megatron_patches.deferred_wandb import defer_wandb_import
from bapo_megatron.megatron_patches.import_warnings import quiet_missing_accelerator_warnings

__version__ = "0.1.0"

quiet_missing_accelerator_warnings()  # before any module imports megatron
defer_wandb_import()  # likewise: Megatron-Core imports wandb eagerly, only to see it is there
defer_jit_compile()  # and TorchDynamo, for torch.compile decorators most runs never call
