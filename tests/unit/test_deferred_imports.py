"""What ``import megatron.core`` no longer runs in a command-line process: wandb
(bapo_megatron/megatron_patches/deferred_wandb.py: Megatron-Core's ``import wandb`` runs nothing,
the first real use runs the package once, in the same object) and TorchDynamo
(deferred_jit_compile.py: ``jit_fuser`` calls ``torch.compile`` at a fused function's first
call); that the command lines install both (bapo_megatron/commands/) and ``import bapo_megatron``
does not.

The import cases run in a fresh interpreter: what they check is the state of ``sys.modules``.
The package cases use a made-up package that logs every module it runs, so a module run twice
(or not at all) shows; one case imports Megatron-Core with the real wandb installed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import tomllib

import pytest
import torch

from bapo_megatron.megatron_patches.deferred_jit_compile import compile_on_first_call
from bapo_megatron.process import end, start
from tests.helpers.gloo_launch import REPO_ROOT

# The command line each console script runs.
CONSOLE_COMMAND_LINES = {
    "bapo-train": "bapo_megatron.trainer.main",
    "bapo-convert-checkpoint": "bapo_megatron.weights.convert_cli",
    "bapo-evaluate": "bapo_megatron.evaluation.cli",
    "bapo-plot-runs": "bapo_megatron.repro.plots_cli",
    "bapo-sweep": "bapo_megatron.repro.sweep_cli",
    "bapo-plan-layout": "bapo_megatron.planning.cli",
    "bapo-gpu-check": "bapo_megatron.device_check.run",
    "bapo-gpu-bench": "bapo_megatron.device_bench.run",
    "bapo-gguf-to-hf": "bapo_megatron.weights.gguf_to_hf",
    "bapo-make-arithmetic": "bapo_megatron.data.arithmetic_task",
}

PACKAGE_FILES = {
    # the package imports a submodule at its own import, as wandb imports wandb.sdk
    "__init__.py": "import os\nopen(os.environ['RUN_LOG'], 'a').write('fakepkg\\n')\n"
    "from fakepkg import sub\nfrom fakepkg.sub import VALUE\n",
    "sub.py": "import os\nopen(os.environ['RUN_LOG'], 'a').write('fakepkg.sub\\n')\nVALUE = 7\n",
    "extra.py": "import os\nopen(os.environ['RUN_LOG'], 'a').write('fakepkg.extra\\n')\nX = 1\n",
}


def run_python(code: str, tmp_path, timeout: float = 120) -> str:
    package = tmp_path / "site" / "fakepkg"
    package.mkdir(parents=True)
    for name, text in PACKAGE_FILES.items():
        (package / name).write_text(text)
    log = tmp_path / "runs.log"
    log.write_text("")
    env = {
        "PYTHONPATH": f"{tmp_path / 'site'}:{REPO_ROOT}",
        "RUN_LOG": str(log),
        "PATH": "/usr/bin:/bin",
        "BAPO_DEVICE": "cpu",
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return log.read_text()


def test_import_runs_nothing_and_the_first_lookup_runs_the_package_once(tmp_path):
    runs = run_python(
        """
        import inspect, sys, types
        from bapo_megatron.megatron_patches.deferred_wandb import defer_import
        assert defer_import("fakepkg")
        import fakepkg
        held = fakepkg
        assert "fakepkg.sub" not in sys.modules
        assert held.__file__.endswith("__init__.py") and held.__spec__.name == "fakepkg"
        inspect.getmodule(inspect)  # reads __file__ of every module, as torch does
        assert "fakepkg.sub" not in sys.modules
        assert held.VALUE == 7  # the first lookup of a name the package defines
        assert type(held) is types.ModuleType and sys.modules["fakepkg"] is held
        import fakepkg as again
        assert again is held and again.sub is sys.modules["fakepkg.sub"]
        """,
        tmp_path,
    )
    assert runs.splitlines() == ["fakepkg", "fakepkg.sub"]


def test_a_submodule_imported_first_runs_under_its_package_once(tmp_path):
    runs = run_python(
        """
        import sys, types
        from bapo_megatron.megatron_patches.deferred_wandb import defer_import
        assert defer_import("fakepkg")
        import fakepkg.sub  # imported by the package itself: must not run a second time
        assert type(sys.modules["fakepkg"]) is types.ModuleType
        assert fakepkg.sub is sys.modules["fakepkg.sub"] and fakepkg.VALUE == 7
        assert type(fakepkg.sub.__spec__.loader).__name__ == "SourceFileLoader"
        from fakepkg.extra import X  # not imported by the package: the usual finders load it
        assert X == 1 and fakepkg.extra is sys.modules["fakepkg.extra"]
        """,
        tmp_path,
    )
    assert runs.splitlines() == ["fakepkg", "fakepkg.sub", "fakepkg.extra"]


def test_missing_imported_or_blocked_packages_are_left_alone(tmp_path):
    run_python(
        """
        import sys
        from bapo_megatron.megatron_patches.deferred_wandb import defer_import
        assert not defer_import("no_such_package_here")
        assert "no_such_package_here" not in sys.modules
        import fakepkg
        assert not defer_import("fakepkg")  # already imported: untouched
        sys.modules["blocked"] = None
        assert not defer_import("blocked")
        try:
            import blocked
        except ImportError:
            pass
        else:
            raise AssertionError("a blocked import succeeded")
        """,
        tmp_path,
    )


def test_importing_the_package_changes_no_process_wide_state(tmp_path):
    run_python(
        """
        import sys, warnings
        import torch
        hooks, filters = list(sys.meta_path), list(warnings.filters)
        import bapo_megatron, bapo_megatron.algo, bapo_megatron.config  # the loss, its settings
        import bapo_megatron.commands.console  # the console scripts prepare when they run
        assert sys.meta_path == hooks, "importing the package installed an import hook"
        assert warnings.filters == filters, "importing the package changed the warnings filters"
        assert "wandb" not in sys.modules and "megatron.core.jit" not in sys.modules
        """,
        tmp_path,
    )


def test_the_trainer_command_imports_megatron_core_without_running_wandb_or_dynamo(tmp_path):
    missing = tmp_path / "missing.yaml"
    run_python(
        f"""
        import runpy, sys
        sys.argv = ["bapo_megatron.train", "--config", {str(missing)!r}]
        try:  # the trainer's whole import (the actor's attention...), then a config error
            runpy.run_module("bapo_megatron.train", run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            assert str(stop.code).startswith("error: ") and "missing.yaml" in str(stop.code)
        else:
            raise AssertionError("the trainer accepted a missing config")
        assert "bapo_megatron.trainer.loop" in sys.modules
        import megatron.core.timers
        from megatron.core import jit
        import torch
        assert jit.jit_fuser.compiles_with is torch.compile
        assert "torch._dynamo" not in sys.modules, "the trainer's import ran TorchDynamo"
        assert megatron.core.timers.wandb is sys.modules["wandb"]
        assert "wandb.sdk" not in sys.modules, "Megatron-Core's import ran wandb"
        import wandb
        assert callable(wandb.init) and "wandb.sdk" in sys.modules
        assert megatron.core.timers.wandb.init is wandb.init
        """,
        tmp_path,
        timeout=300,
    )


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_is_checked_below():
    assert set(CONSOLE_COMMAND_LINES) == set(console_scripts())


@pytest.mark.parametrize("script", sorted(CONSOLE_COMMAND_LINES))
def test_a_console_script_prepares_its_process_first_and_skips_the_final_collection_last(
    script, monkeypatch
):
    calls = []
    monkeypatch.setattr(start, "prepare_process", lambda: calls.append("prepare"))
    monkeypatch.setattr(end, "skip_final_collection", lambda: calls.append("skip"))
    command_line = importlib.import_module(CONSOLE_COMMAND_LINES[script])
    monkeypatch.setattr(command_line, "main", lambda: calls.append("main") or 0)
    module, _, function = console_scripts()[script].partition(":")
    getattr(importlib.import_module(module), function)()
    assert calls == ["prepare", "main", "skip"]


def test_compile_on_first_call_compiles_once_at_the_first_call():
    made = []

    def fake_compile(fn):  # torch.compile's contract: a callable computing what fn computes
        made.append(fn)
        return lambda *args, **kwargs: fn(*args, **kwargs) * 1

    def bias_gelu(bias, y):
        """The fused function's docstring."""
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    decorated = compile_on_first_call(fake_compile)(bias_gelu)
    assert made == [], "compiled at decoration"
    assert decorated.__name__ == "bias_gelu" and decorated.__doc__ == bias_gelu.__doc__
    bias, y = torch.randn(5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(decorated(bias, y), bias_gelu(bias, y))
    assert torch.equal(decorated(bias, y=y), bias_gelu(bias, y))
    assert made == [bias_gelu], "compiled more than once, or another function"


@pytest.mark.parametrize(
    "preset, want",
    [
        ({}, b"10000"),
        ({"GOMP_SPINCOUNT": "300"}, b"300"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    ],
)
def test_openmp_spinning_is_bounded_unless_the_user_chose(tmp_path, preset, want):
    """The spin count reaches the OpenMP runtime torch loads (read back from the process's own
    environment as libgomp sees it); a count or a wait policy set beforehand is left alone."""
    run_python(
        f"""
        import os
        os.environ.update({preset!r})
        from bapo_megatron.process import start
        start.prepare_process()
        import ctypes, torch
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        seen = libc.getenv(b"GOMP_SPINCOUNT")
        assert seen == {want!r}, seen
        """,
        tmp_path,
    )
