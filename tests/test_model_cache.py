"""The end-to-end tests' model cache: a build is reused only when it matches the builder exactly, and a directory the
builder did not make is never reused nor overwritten (the e2e budgets are byte-exact for one model)."""

from __future__ import annotations

import json

import pytest
from build_tiny_model import STAMP, ForeignModelDir, build, key_of

from helpers import model_from_env

SMALL = {"hidden": 32, "layers": 1, "intermediate": 64, "heads": 2, "kv_heads": 1, "vocab": 300}


def test_a_build_is_reused_only_while_its_stamp_matches_the_builder(tmp_path):
    d = build(tmp_path / "m", **SMALL)
    assert json.loads((d / STAMP).read_text())["key"] == key_of(**SMALL)
    weights = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert build(d, **SMALL) == d and {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == weights  # reused
    build(d, **{**SMALL, "hidden": 64})  # another shape asked of the same directory: rebuilt, not reused
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 64
    assert json.loads((d / STAMP).read_text())["key"] == key_of(**{**SMALL, "hidden": 64})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the outdated build is gone, no temp dirs left


def test_a_model_the_builder_did_not_make_is_neither_used_nor_touched(tmp_path):
    foreign = tmp_path / "someones-model"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"hidden_size": 4096}')
    with pytest.raises(ForeignModelDir, match="did not build"):
        build(foreign, **SMALL)
    with pytest.warns(UserWarning, match="OOMGUARD_TEST_MODEL ignored"):
        assert model_from_env(str(foreign), lambda: "the cached build") == "the cached build"
    assert [p.name for p in foreign.iterdir()] == ["config.json"]
    assert (foreign / "config.json").read_text() == '{"hidden_size": 4096}'


def test_the_session_model_is_the_builders(tiny_model):
    from pathlib import Path

    assert json.loads((Path(tiny_model) / STAMP).read_text())["key"] == key_of()


def test_doctests():
    import doctest

    import build_tiny_model

    assert doctest.testmod(build_tiny_model).failed == 0
