"""Every module's doctests run, through the installed package (pytest's own --doctest-modules imports the checkout,
where ``oomguard.strategies`` is not a subfolder of ``oomguard/``, so it is run this way instead)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import oomguard

# Imported only inside a training process: importing them here would install the run's patches into pytest itself.
SKIP = {"oomguard.__main__", "oomguard.child.bootstrap", "oomguard.child._boot.sitecustomize"}
MODULES = sorted(m.name for m in pkgutil.walk_packages(oomguard.__path__, "oomguard.") if m.name not in SKIP)


def test_every_module_is_found():
    assert {"oomguard.decide.choose", "oomguard.decide.climb", "oomguard.memory.estimate",
            "oomguard.strategies.sequences"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests of {name} failed"
