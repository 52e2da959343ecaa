"""The Megatron-Core actor: configuration conversion, CPU runtime patches, model construction.

Modules here import ``megatron.core``; nothing outside ``actor/`` and ``parallel.py`` does.
"""
