"""Post-import hooks: run a function right after a module is first imported, without importing it ourselves.

The bootstrap must patch ``GRPOConfig`` and friends in every process, but importing TRL in a process that never
uses it (a launcher, a tokenizer worker) would cost seconds. So a finder at the front of ``sys.meta_path`` wraps the
loader of the named modules and calls the hook after the module has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, hooks: list[Hook]) -> None:
        self.inner = inner
        self.hooks = hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        # Give the module its real loader back, so nothing keeps the hooks (and what they hold) alive.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.inner
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.inner
        hooks, self.hooks = self.hooks, []
        for hook in hooks:
            try:
                hook(module)
            except Exception as e:  # a failing patch must never break the user's import
                sys.stderr.write(f"oomguard: could not patch {module.__name__}: {e.__class__.__name__}: {e}\n")

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Hook]] = {}
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hooks = self.hooks.get(fullname)
        if not hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, hooks)
        return spec


_FINDER = _Finder()


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (at once if it already is)."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _FINDER.hooks.setdefault(name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def forget_hooks() -> None:
    """Drop hooks still waiting for their module (the decorator removes its patches after each call)."""
    _FINDER.hooks.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
