"""Megatron-Core's eager ``import wandb``, made lazy.

Megatron-Core 0.16 imports wandb at module level wherever it is installed (``timers``, the
dynamic inference context and engine, all reached by ``import megatron.core``) only to test that
it exists; it calls it only with a W&B writer the caller passes in, which bapo-megatron never
does. wandb's own import (its SDK, protobuf, pydantic, botocore...) costs 2-5 s of CPU, so every
rank, converter and worker process paid for it whether ``logging.wandb`` was on or not: about a
third of ``import megatron.core`` on a CPU machine.

:func:`defer_wandb_import` registers the package the way the import system would, without running
it: ``sys.modules["wandb"]`` is the module object, with its ``__spec__``, ``__file__`` and
``__path__``, so ``import wandb`` succeeds at once and introspection sees a module (torch's
``inspect.getmodule`` reads ``__file__`` of every module in ``sys.modules`` whenever it registers
a custom operator). wandb's ``__init__`` runs in that same object the first time anyone looks up a
name it defines (``wandb.init``), or imports one of its submodules: from then on it is the real
package, the object Megatron and our W&B sink (``trainer/sinks/wandb_run.py``) hold included. The
standard library's ``LazyLoader`` does the same but runs the package at any attribute lookup,
``__file__`` included, so under torch it saves nothing. It is called by the command lines
(:mod:`bapo_megatron.process.start`), before any module imports megatron.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types

_running = threading.RLock()


class DeferredPackage(types.ModuleType):
    """The package's module before its code ran: the first lookup of a name it does not hold
    yet runs the code, in this object."""

    def __getattr__(self, name: str):  # only called for names the module does not hold
        return getattr(run_deferred_package(self.__name__), name)


def run_deferred_package(package: str) -> types.ModuleType:
    """Run the package's code now if it has not run; returns the package."""
    with _running:
        module = sys.modules[package]
        if isinstance(module, DeferredPackage):
            module.__class__ = types.ModuleType  # lookups during its own import behave as usual
            try:
                module.__spec__.loader.exec_module(module)
            except BaseException:
                del sys.modules[package]  # as a failed import leaves it: the next import retries
                raise
        return module


class SubmoduleFirst(importlib.abc.MetaPathFinder):
    """``import wandb.sdk`` as the first use: the package's code runs first, as the import system
    would have run it before any submodule. If that imported the submodule already, the import
    gets that module (the usual finders would run it a second time)."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self.package + ".") or not isinstance(
            sys.modules.get(self.package), DeferredPackage
        ):
            return None
        run_deferred_package(self.package)
        module = sys.modules.pop(fullname, None)
        if module is None:
            return None  # not imported by the package: the usual finders load it
        return importlib.machinery.ModuleSpec(fullname, AlreadyImported(module))


class AlreadyImported(importlib.abc.Loader):
    """Hands a module the package's own code imported back to the import system unchanged."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system set it to the spec that carried us


def defer_wandb_import() -> bool:
    """:func:`defer_import` of wandb."""
    return defer_import("wandb")


def defer_import(package: str) -> bool:
    """Register a top-level package without running it. Returns whether it did: not when it is
    not installed (``import`` keeps raising ``ImportError``) or is already imported (or blocked
    with ``sys.modules[package] = None``)."""
    if package in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(package)  # a top-level name: reads the path, runs nothing
    except ImportError:  # a finder that answers "not installed" by raising
        return False
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)  # __spec__, __file__, __path__, __loader__
    module.__class__ = DeferredPackage
    sys.modules[package] = module
    sys.meta_path.insert(0, SubmoduleFirst(package))
    return True
