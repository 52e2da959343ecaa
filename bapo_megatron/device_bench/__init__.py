"""The device benchmarks (``bapo-gpu-bench``): memory per component against the layout planner,
the loss and packing benchmarks, the embedded engine's tokens/s and the actor's speed against
transformers' model with its model FLOPs utilisation. The pass/fail checks are
:mod:`bapo_megatron.device_check`'s."""
