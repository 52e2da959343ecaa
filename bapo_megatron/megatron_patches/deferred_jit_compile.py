"""Megatron-Core's ``torch.compile`` decorators, applied at the first call instead of at import.

Megatron-Core 0.16 decorates about 40 fused element-wise functions (bias-GeLU, SwiGLU, dropout-add,
router helpers...) with ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2.
``torch.compile(fn)`` compiles nothing until ``fn`` is called, but it imports TorchDynamo and
Inductor at once, so ``import megatron.core`` paid seconds of CPU for them in every rank and
worker process (about a quarter of the import), runs that never call a fused function (every
CPU run: the local spec's fusions are off there) included.

:func:`defer_jit_compile` installs an import hook that, right after ``megatron.core.jit`` runs,
replaces ``jit_fuser`` by :func:`compile_on_first_call` of ``torch.compile``: a decorator that calls
``torch.compile(fn)`` when the decorated function is first called and uses what it returns from
then on: the same compiled function, compiled at the same moment, only TorchDynamo's import moves
to that first call. Megatron's ``disable_jit_fuser()`` / ``enable_jit_fuser()`` keep their
meaning for what is decorated after them. Installed by the command lines
(:mod:`bapo_megatron.process.start`), before any module imports megatron; where
megatron is already imported it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading

JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(compile_function):
    """A decorator that makes ``compile_function(fn)`` (``torch.compile``) when the decorated
    function is first called, and calls what it made from then on. (``torch`` is handed in, not
    imported here: the module that installs the hook stays free of torch.)"""

    def decorate(fn):
        compiled = None
        lock = threading.Lock()

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                with lock:
                    if compiled is None:
                        compiled = compile_function(fn)
            return compiled(*args, **kwargs)

        return call

    decorate.compiles_with = compile_function
    return decorate


class JitModuleLoader(importlib.abc.Loader):
    """Runs ``megatron.core.jit`` with its own loader, then swaps its decorator."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        compile_function = module.torch.compile  # the module's own `import torch`
        if module.jit_fuser is compile_function:  # what enable_jit_fuser() chose at its import
            module.jit_fuser = compile_on_first_call(compile_function)


class JitModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the usual finders do, with :class:`JitModuleLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = JitModuleLoader(spec.loader)
        return spec


def defer_jit_compile() -> bool:
    """Install the hook. Returns whether it did: not where ``megatron.core.jit`` is imported
    already, or the hook is in place."""
    if JIT_MODULE in sys.modules or any(isinstance(f, JitModuleFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, JitModuleFinder())
    return True
