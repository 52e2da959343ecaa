"""The console scripts (``[project.scripts]`` in ``pyproject.toml``), ``python -m
bapo_megatron.train`` and the wrappers in ``tools/``: each prepares the process
(:func:`~bapo_megatron.process.start.prepare_process`), then imports and runs its
command line, then lets the process skip its final collection
(:func:`~bapo_megatron.process.end.skip_final_collection`). The command lines are
imported inside the functions so that the deferred imports are in place before Megatron-Core's
import, and so that a ``spawn`` child re-importing a console script's main module imports only
this module.
"""

from __future__ import annotations

from bapo_megatron.process import end, start


def train() -> None:
    """``bapo-train`` and ``python -m bapo_megatron.train``
    (:func:`bapo_megatron.trainer.main.main`)."""
    start.prepare_process()
    from bapo_megatron.trainer.main import main

    main()
    end.skip_final_collection()


def convert_checkpoint() -> None:
    """``bapo-convert-checkpoint`` (:func:`bapo_megatron.weights.convert_cli.main`)."""
    start.prepare_process()
    from bapo_megatron.weights.convert_cli import main

    main()
    end.skip_final_collection()


def evaluate() -> None:
    """``bapo-evaluate`` (:func:`bapo_megatron.evaluation.cli.main`)."""
    start.prepare_process()
    from bapo_megatron.evaluation.cli import main

    main()
    end.skip_final_collection()


def gguf_to_hf() -> None:
    """``bapo-gguf-to-hf`` (:func:`bapo_megatron.weights.gguf_to_hf.main`)."""
    start.prepare_process()
    from bapo_megatron.weights.gguf_to_hf import main

    main()
    end.skip_final_collection()


def make_arithmetic() -> None:
    """``bapo-make-arithmetic`` (:func:`bapo_megatron.data.arithmetic_task.main`)."""
    start.prepare_process()
    from bapo_megatron.data.arithmetic_task import main

    main()
    end.skip_final_collection()


def plot_runs() -> None:
    """``bapo-plot-runs`` (:func:`bapo_megatron.repro.plots_cli.main`)."""
    start.prepare_process()
    from bapo_megatron.repro.plots_cli import main

    main()
    end.skip_final_collection()


def sweep() -> None:
    """``bapo-sweep`` (:func:`bapo_megatron.repro.sweep_cli.main`)."""
    start.prepare_process()
    from bapo_megatron.repro.sweep_cli import main

    main()
    end.skip_final_collection()


def plan_layout() -> int:
    """``bapo-plan-layout`` (:func:`bapo_megatron.planning.cli.main`); its exit status."""
    start.prepare_process()
    from bapo_megatron.planning.cli import main

    status = main()
    end.skip_final_collection()
    return status


def gpu_check() -> int:
    """``bapo-gpu-check`` (:func:`bapo_megatron.device_check.run.main`); its exit status."""
    start.prepare_process()
    from bapo_megatron.device_check.run import main

    status = main()
    end.skip_final_collection()
    return status


def gpu_bench() -> int:
    """``bapo-gpu-bench`` (:func:`bapo_megatron.device_bench.run.main`); its exit status."""
    start.prepare_process()
    from bapo_megatron.device_bench.run import main

    status = main()
    end.skip_final_collection()
    return status
