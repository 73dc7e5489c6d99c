"""The guard's modules: one concern each, with running examples, and the name `oomguard.guard` always the function.

There is no submodule `oomguard.guard` any more. Python binds a submodule to its package's attribute when it is first
imported, so a module of that name turned `oomguard.guard` into a module (not callable) as soon as anything imported
it, unless a module-class hack made the module callable. Now no import can shadow the function."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys

import pytest

MODULES = ["oomguard.inprocess.guarded", "oomguard.inprocess.attempt", "oomguard.inprocess.tracked",
           "oomguard.inprocess.release", "oomguard.inprocess.allocapply", "oomguard.inprocess.isolate"]


@pytest.mark.parametrize("name", MODULES)
def test_each_module_shows_a_running_example(name):
    """Each has examples; tests/test_doctests.py runs them (with every module's)."""
    module = importlib.import_module(name)
    assert sum(len(t.examples) for t in doctest.DocTestFinder().find(module)) > 0


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_every_documented_spelling_works_whatever_was_imported_first():
    """Import each of the guard's modules (and every other oomguard module) after `import oomguard`, then use every
    spelling the README and examples use: the bare decorator, with options, as a call, and the names imported."""
    code = """
import importlib, pkgutil
import oomguard
from oomguard.inprocess.guarded import OOMGuardExhausted as Exhausted
skip = {"oomguard.__main__", "oomguard.child._boot.sitecustomize"}
for m in pkgutil.walk_packages(oomguard.__path__, "oomguard."):
    if m.name not in skip:
        importlib.import_module(m.name)
from oomguard import OOMGuardExhausted, guard

@oomguard.guard
def bare(knobs):
    return knobs.max_completion_length

@oomguard.guard(max_attempts=4)
def with_options(knobs):
    return 1

assert bare() == 512 and with_options() == 1
assert oomguard.guard(lambda knobs: 2, simulate_gpu="300MiB")() == 2
assert guard is oomguard.guard and OOMGuardExhausted is Exhausted is oomguard.OOMGuardExhausted
import types
assert not [n for n in oomguard.__all__ if isinstance(getattr(oomguard, n), types.ModuleType)]  # estimate, diagnose
print("ok")
"""
    out = _run(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_guard_name_does_not_import_torch():
    """`import oomguard` stays cheap, and so does reaching `oomguard.guard`: torch comes with the user's code."""
    out = _run("import sys, oomguard\noomguard.guard, oomguard.OOMGuardExhausted\nprint('torch' in sys.modules)")
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
