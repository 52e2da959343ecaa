"""The package's shape: no import cycles (between modules, and between subpackages), imports at
the top of modules (but for an allow-list), the core imports without the optional heavy
packages, and every console script names a callable."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bapo_megatron"


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _runs_at_import(node: ast.stmt) -> list[ast.stmt]:
    """The statements of a top-level statement that run when the module is imported: imports
    inside ``if``/``try`` count, except under ``if TYPE_CHECKING``; function and class bodies
    are lazy."""
    if isinstance(node, ast.If):
        if isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(
            node.test
        ):
            return list(node.orelse)
        return [
            s for part in (node.body, node.orelse) for child in part for s in _runs_at_import(child)
        ]
    if isinstance(node, ast.Try):
        parts = [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
        return [s for part in parts for child in part for s in _runs_at_import(child)]
    return [node]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at import time (``from a import b`` counts
    as importing ``a`` and, if it is a module, ``a.b``). A package's parents, imported before it
    by Python, are not edges: an ``__init__`` that re-exports its children is no cycle."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for top in ast.parse(path.read_text(), str(path)).body:
            for node in _runs_at_import(top):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    names = [base] + [f"{base}.{alias.name}" for alias in node.names]
                else:
                    continue
                targets.update(names)
        graph[name] = {t for t in targets & set(modules) if t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert "bapo_megatron.weight_sync.interface" in graph["bapo_megatron.trainer.setup"]  # sanity
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        packages.setdefault(subpackage(module), set()).update(
            subpackage(t)
            for t in targets
            if subpackage(t) != subpackage(module) and t != "bapo_megatron"
        )
    packages.pop("bapo_megatron", None)
    cycle = find_cycle(packages)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


# The optional heavy packages, and the modules that may import them inside functions.
HEAVY_OPTIONAL_ADAPTERS = {
    "vllm": "bapo_megatron.rollout.vllm",
    "sglang": "bapo_megatron.rollout.sglang",
    # the experiment trackers, optional extras imported when their run opens
    "wandb": "bapo_megatron.trainer.sinks.wandb_run",
    "mlflow": "bapo_megatron.trainer.sinks.mlflow_run",
}

# (module, what it imports inside a function, or a package above it) -> why it is not at the top.
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("bapo_megatron.algo.contributions", "bapo_megatron.algo.contributions_cpu"): (
        "the numba backend (LLVM), loaded on CPU runs only"
    ),
    ("bapo_megatron.algo.contributions", "numba"): (
        "asked on CPU runs only; a numba that fails to import falls back to torch"
    ),
    ("bapo_megatron.actor.core_attention", "torch.nn.attention.varlen"): (
        "the CUDA-only varlen kernel; its module imports TorchDynamo (about 3 s of CPU per "
        "process), which runs on the CPU never use"
    ),
    ("bapo_megatron.commands.console", "bapo_megatron"): (
        "each console script prepares its process before its command line imports Megatron-Core"
    ),
    ("bapo_megatron.evaluation.cli", "bapo_megatron.evaluation.evaluate"): (
        "the reward pool's spawn workers re-import the main module; OMP_NUM_THREADS is set first"
    ),
    **{
        ("bapo_megatron.weights.convert_cli", target): (
            "usage errors are answered before torch loads; OMP_NUM_THREADS is set first"
        )
        for target in (
            "bapo_megatron.config",
            "bapo_megatron.distributed.context",
            "bapo_megatron.weights.convert",
        )
    },
}


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module or ``module.name``) of every import inside a function of ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                base = "." * child.level + (f"{child.module}." if child.module else "")
                found.extend((child.lineno, base + alias.name) for alias in child.names)
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _allowed_in_function(module: str, imported: str) -> bool:
    def under(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    adapter = HEAVY_OPTIONAL_ADAPTERS.get(imported.split(".")[0])
    if adapter is not None and under(module, adapter):
        return True
    return any(m == module and under(imported, target) for m, target in FUNCTION_IMPORTS_ALLOWED)


def test_function_level_import_finder_sees_nested_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    class C:\n"
        "        def g(self):\n"
        "            from a.b import c\n"
        "async def h():\n"
        "    from . import d\n"
    )
    assert function_level_imports(source) == [(3, "json"), (6, "a.b.c"), (8, ".d")]


def test_heavy_packages_are_allowed_inside_their_adapters_only():
    assert _allowed_in_function("bapo_megatron.rollout.vllm.engine", "vllm.platforms.x")
    assert not _allowed_in_function("bapo_megatron.rollout.sglang.engine", "vllm")
    assert not _allowed_in_function("bapo_megatron.trainer.loop", "sglang")
    assert _allowed_in_function("bapo_megatron.algo.contributions", "numba")
    assert not _allowed_in_function("bapo_megatron.algo.contributions", "torch")


def test_imports_are_at_the_top_of_modules_but_for_the_allow_list():
    modules = module_files()
    inside = [
        f"{path.relative_to(ROOT)}:{line}: {imported}"
        for module, path in modules.items()
        for line, imported in function_level_imports(path)
        if not _allowed_in_function(module, imported)
    ]
    assert not inside, "imports inside functions (move them to the top):\n" + "\n".join(inside)
    for module, target in FUNCTION_IMPORTS_ALLOWED:  # no stale entries
        assert module in modules, module
        assert any(
            _allowed_in_function(module, imported)
            and (imported == target or imported.startswith(target + "."))
            for _, imported in function_level_imports(modules[module])
        ), f"{module} no longer imports {target} inside a function: drop its allow-list entry"


MAX_MODULE_LINES = 500
# Modules over the limit, each with the reason; an entry whose module fits must be dropped.
LONG_MODULES_ALLOWED: dict[str, str] = {}


def test_no_module_is_longer_than_the_limit():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in module_files().values()
    }
    too_long = {
        name: lines
        for name, lines in lengths.items()
        if lines > MAX_MODULE_LINES and name not in LONG_MODULES_ALLOWED
    }
    assert too_long == {}, f"modules over {MAX_MODULE_LINES} lines: split them by concern"
    stale = [name for name in LONG_MODULES_ALLOWED if lengths.get(name, 0) <= MAX_MODULE_LINES]
    assert stale == [], f"within the limit now: drop them from LONG_MODULES_ALLOWED: {stale}"


# Files of tests/ and tools/ over the limit, each with the reason.
LONG_TEST_AND_TOOL_FILES_ALLOWED: dict[str, str] = {}


def test_no_test_or_tool_file_is_longer_than_the_limit():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("tests", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    assert "tests/unit/test_package_structure.py" in lengths  # sanity: the walk found the tests
    too_long = {
        name: lines
        for name, lines in lengths.items()
        if lines > MAX_MODULE_LINES and name not in LONG_TEST_AND_TOOL_FILES_ALLOWED
    }
    assert too_long == {}, f"test and tool files over {MAX_MODULE_LINES} lines: split them by job"
    stale = [
        name
        for name in LONG_TEST_AND_TOOL_FILES_ALLOWED
        if lengths.get(name, 0) <= MAX_MODULE_LINES
    ]
    assert stale == [], f"within the limit now: drop them from the allowed files: {stale}"


def test_the_root_package_holds_only_its_init_and_subpackages():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]


_BLOCKING_IMPORT = textwrap.dedent("""
    import importlib, importlib.abc, sys

    BLOCKED = {blocked!r}

    class Blocked(importlib.abc.MetaPathFinder):
        # as if not installed (libraries test for ModuleNotFoundError)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"blocked: {{name}}", name=name)

    sys.meta_path.insert(0, Blocked())
    from bapo_megatron.process.start import prepare_process

    prepare_process()  # as a command line does
    for name in {modules!r}:
        importlib.import_module(name)
    print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
""")


def _import_blocking(modules: list[str], blocked: list[str]) -> str:
    """Import ``modules`` in a new interpreter where ``blocked`` are not installed; its stderr."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKING_IMPORT.format(blocked=blocked, modules=modules)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    return done.stderr


def test_every_module_imports_without_the_optional_packages():
    # The adapters (rollout/vllm, rollout/sglang, Megatron's TE spec, the trackers' sinks) import
    # them inside the functions that need them, so even their modules import without them.
    modules = [name for name in module_files() if not name.endswith(".__main__")]
    assert "bapo_megatron.rollout.vllm.engine" in modules
    stderr = _import_blocking(modules, ["vllm", "sglang", "transformer_engine", "wandb", "mlflow"])
    # Megatron-Core's fallback warnings are silenced by the command lines' process start
    assert "not installed" not in stderr, stderr[-3000:]


def test_algorithm_and_config_import_with_torch_alone():
    _import_blocking(
        ["bapo_megatron.algo", "bapo_megatron.config", "bapo_megatron.config.loading"],
        ["megatron", "transformer_engine", "vllm", "sglang", "apex", "transformers"],
    )


def _console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(_console_scripts()))
def test_console_script_names_a_callable(script):
    module, _, function = _console_scripts()[script].partition(":")
    assert function, f"[project.scripts] {script}: expected module:function"
    assert callable(getattr(importlib.import_module(module), function))


def test_tool_wrappers_run_the_package_command_lines_without_path_edits():
    tools = ["convert_checkpoint", "evaluate", "plot_runs", "sweep"]
    for path in (ROOT / "tools").glob("*.py"):
        assert "sys.path" not in path.read_text(), path
    code = textwrap.dedent(f"""
        import contextlib, io, runpy, sys
        for tool in {tools!r}:
            sys.argv = [tool, "--help"]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    runpy.run_path("tools/" + tool + ".py", run_name="__main__")
                except SystemExit as done:
                    assert done.code == 0, (tool, done.code)
            assert out.getvalue().startswith("usage: " + tool), (tool, out.getvalue()[:200])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
