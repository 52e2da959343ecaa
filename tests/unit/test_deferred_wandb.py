"""The deferred import of wandb (bapo_megatron/megatron_patches/deferred_wandb.py): Megatron-Core's
``import wandb`` runs nothing, the first real use runs the package once, in the same object.

Each case runs in a fresh interpreter: what it checks is the state of ``sys.modules``. The
package cases use a made-up package that logs every module it runs, so a module run twice (or
not at all) shows; one case imports Megatron-Core with the real wandb installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.gloo_launch import REPO_ROOT

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


def test_megatron_core_imports_without_running_wandb(tmp_path):
    run_python(
        """
        import sys
        import bapo_megatron  # the root __init__ defers wandb
        import megatron.core.timers
        assert megatron.core.timers.wandb is sys.modules["wandb"]
        assert "wandb.sdk" not in sys.modules, "Megatron-Core's import ran wandb"
        import wandb
        assert callable(wandb.init) and "wandb.sdk" in sys.modules
        assert megatron.core.timers.wandb.init is wandb.init
        """,
        tmp_path,
        timeout=300,
    )
