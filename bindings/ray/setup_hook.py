"""Registering ringcore's backends in every Ray worker, before Ray Train or ``ray.util.collective`` needs them.

Ray Train's ``TorchConfig(backend="ringcore")`` makes each training worker
call ``dist.init_process_group("ringcore", ...)`` before the user's training
function runs, and torch knows "ringcore" only once ``ringcore.torch`` has
registered it in that process. Ray runs one user hook in every worker process
it starts, after the process starts and before any task or actor is scheduled
on it: the runtime environment's ``worker_process_setup_hook``. ringcore's
hook is :func:`setup_worker`; pass :data:`RUNTIME_ENV` to ``ray.init``::

    ray.init(runtime_env=ringcore.ray.RUNTIME_ENV)   # {"worker_process_setup_hook": "ringcore.ray.setup_worker"}

Ray reads the hook from the job's runtime environment only (``ray.init`` or
``ray job submit --runtime-env-json``; an actor's or Ray Train's
``worker_runtime_env`` cannot add one), and a job has one hook: a job with a
hook of its own calls ``ringcore.ray.setup_worker()`` from it.

Lazily. Importing torch costs seconds and hundreds of MB per process, and most
of a job's workers (Ray Data tasks, other actors) never use it. So the hook
imports nothing heavy: it asks the import system to register the torch
backend right after ``torch`` finishes importing in that process (Ray Train
imports it before setting up the process group), and the
``ray.util.collective`` backend right after ``ray.util.collective`` does.
Where a module is already imported, its backend is registered at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["RUNTIME_ENV", "after_import", "setup_worker"]

log = logging.getLogger("ringcore")

RUNTIME_ENV: dict[str, Any] = {"worker_process_setup_hook": "ringcore.ray.setup_worker"}


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: ringcore's backends register as their frameworks load."""
    after_import("torch", _register_torch)
    after_import("ray.util.collective", _register_collective)


def _register_torch() -> None:
    import torch.distributed

    if torch.distributed.is_available():
        from ringcore.torch import process_group

        process_group.register()


def _register_collective() -> None:
    from ringcore.ray import collective

    collective.register()


# --------------------------------------------------------------------------- after_import


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once ``module`` has finished importing in this process (now, if it has).

    An exception in ``callback`` is logged, never raised into the import that triggered it.
    """
    loaded = sys.modules.get(module)
    if loaded is not None and not getattr(getattr(loaded, "__spec__", None), "_initializing", False):
        _call(callback, module)
        return
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _finder.callbacks.setdefault(module, []).append(callback)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the next finders return for a watched module."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            callbacks = self.callbacks.pop(fullname, None)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbackLoader(spec.loader, fullname, callbacks)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks; the module keeps its own loader as ``__loader__``."""

    def __init__(self, loader: Any, module: str, callbacks: list[Callable[[], None]]) -> None:
        self.loader, self.module, self.callbacks = loader, module, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in self.callbacks:
            _call(callback, self.module)


def _call(callback: Callable[[], None], module: str) -> None:
    try:
        callback()
    except Exception as err:  # a backend that fails to register must not break the user's import
        log.warning("ringcore.ray: registering ringcore after importing %s failed: %r", module, err)


_lock = threading.Lock()
_finder = _AfterImportFinder()
