"""The converter command that writes a recipe's model as a Megatron checkpoint at the recipe's
own layout (``bapo-plan-layout`` prints it; a recipe's header quotes it).

The trainer reads an HF folder itself (``train.model_path``), so the conversion is optional: it
reads every tensor once and refuses, naming the tensor, what it cannot map, and its checkpoint
can start runs (``train.load_checkpoint``). A Megatron checkpoint loads at any layout; converting
at the recipe's own (tensor, pipeline, expert and expert tensor parallel sizes) gives every rank
of the conversion the shard it will train, and needs the fewest processes that hold that layout:
``PP x lcm(TP, EP x ETP)`` (Megatron carves the expert ranks of a pipeline stage out of its
tensor x data-parallel ranks). Context parallelism and sequence parallelism change no weight
and are not the converter's to set.
"""

from __future__ import annotations

import math

from bapo_megatron.config import Config

HF_PLACEHOLDER = "HF_FOLDER"
"""The HF folder of the command when the recipe has no ``train.model_path``."""


def conversion_processes(config: Config) -> int:
    """The fewest processes the converter needs at the recipe's layout."""
    p = config.parallel
    experts = p.expert_model_parallel_size * p.expert_tensor_parallel_size
    return p.pipeline_model_parallel_size * math.lcm(p.tensor_model_parallel_size, experts)


def conversion_command(config: Config, gpus_per_node: int) -> str:
    """The ``torchrun ... tools/convert_checkpoint.py hf-to-megatron`` command line that
    converts the recipe's ``train.model_path`` to ``<model_path>-megatron`` at the recipe's
    layout, in the recipe's ``train.params_dtype``: one process per GPU on one node, or a
    torchrun on each of several nodes of ``gpus_per_node`` GPUs; processes that do not fill
    whole nodes run on one machine's CPU (``BAPO_DEVICE=cpu``)."""
    p = config.parallel
    processes = conversion_processes(config)
    if processes <= gpus_per_node:
        launch = f"torchrun --nproc-per-node {processes}"
    elif processes % gpus_per_node == 0:
        nodes = processes // gpus_per_node
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} "
            f"--node-rank <0..{nodes - 1}> --master-addr <node 0 address>"
        )
    else:
        launch = f"BAPO_DEVICE=cpu torchrun --nproc-per-node {processes}"
    hf = (config.train.model_path or HF_PLACEHOLDER).rstrip("/")
    words = [launch, "tools/convert_checkpoint.py hf-to-megatron", hf, f"{hf}-megatron"]
    for flag, size in (
        ("--tp", p.tensor_model_parallel_size),
        ("--pp", p.pipeline_model_parallel_size),
        ("--ep", p.expert_model_parallel_size),
        ("--etp", p.expert_tensor_parallel_size),
    ):
        if size > 1:
            words.append(f"{flag} {size}")
    if config.train.params_dtype is not None:
        words.append(f"--params-dtype {config.train.params_dtype}")
    return " ".join(words)
