"""Python 3.10 is the declared floor: every module imports without tomllib (tomli stands in), and nothing newer
than 3.10's syntax creeps in. There is no 3.10 interpreter here, so 3.10 is imitated where it differs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

IMPORT_ALL_WITHOUT_TOMLLIB = """
import importlib, pkgutil, sys
sys.modules["tomllib"] = None  # as on Python 3.10: `import tomllib` raises ImportError
import oomguard
skip = {"oomguard.__main__", "oomguard.child._boot.sitecustomize"}  # they run things when imported
names = [m.name for m in pkgutil.walk_packages(oomguard.__path__, "oomguard.") if m.name not in skip]
for name in names:
    importlib.import_module(name)
import tomli
from oomguard.decide import ladder
assert ladder.tomllib is tomli, ladder.tomllib
assert [r.name for r in ladder.load_ladder("default").rungs][0] == "expandable_segments"
print(len(names), "modules")
"""


def test_every_module_imports_without_tomllib():
    pytest.importorskip("tomli", reason="tomli is in the test extra: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL_WITHOUT_TOMLLIB], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[0]) > 20


def test_the_floor_is_declared_everywhere():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["requires-python"] == ">=3.10"
    assert data["tool"]["ruff"]["target-version"] == "py310"  # ruff then rejects syntax newer than 3.10
    deps = [d.replace(" ", "") for d in data["project"]["dependencies"]]
    assert 'tomli>=1.1;python_version<"3.11"' in deps


def test_no_syntax_newer_than_python_310():
    pytest.importorskip("ruff")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--target-version",
                          "py310", "--select", "E9", "oomguard", "examples", "bench", "tests"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
