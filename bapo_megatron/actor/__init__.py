"""The Megatron-Core actor: configuration conversion, CPU runtime patches, model construction.

Modules here import ``megatron.core``; outside ``actor/`` only ``parallel.py`` and the
checkpoint and export code of ``weights/`` do.
"""
