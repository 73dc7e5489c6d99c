"""Shared fixtures: the small local Llamas the end-to-end tests train, built once and cached by their builder's key.

The end-to-end tests' budgets are byte-exact for one model, so a cached build is reused only when the stamp written
next to it matches the builder (its content, the shape, the torch/transformers/tokenizers versions) exactly; any
other directory is rebuilt (our own outdated build) or left alone (anything else).

Every process the tests start gets one intra-op thread: the models are tiny, and on a shared 2-core machine torch's
default of one thread per core spends most of a training step waiting for the other thread (measured 4x slower
under load). Thread counts do not change which tensors are created, so the simulated device's figures are the same.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models are local: a test never waits on the network

# Hypothesis: enough examples to matter, few enough for CI.
try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, deadline=None)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass

STALE_AFTER_S = 86400.0  # cached builds of other keys older than this are removed


def _cache_root(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest's cache directory (kept between runs, ignored by git), or this run's temp dir without the cache plugin."""
    cache = getattr(config, "cache", None)
    return Path(cache.mkdir("oomguard-models")) if cache is not None else tmp_path_factory.mktemp("models")


def _prune(root: Path, keep: Path) -> None:
    """Drop our own builds of other keys (an older builder's) once they are a day old; never anything unstamped."""
    from build_tiny_model import stamp_of

    for other in root.iterdir():
        if other == keep or not other.is_dir() or stamp_of(other) is None:
            continue
        try:
            if time.time() - other.stat().st_mtime > STALE_AFTER_S:
                import shutil

                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


@pytest.fixture(scope="session")
def build_model(request, tmp_path_factory) -> Callable[[str], str]:
    """``build_model("tiny")`` / ``build_model("wide")``: the path of that variant of tests/scripts/build_tiny_model.py,
    built at most once per key (between runs too) and shared by every test of the session."""
    from build_tiny_model import VARIANTS, build, key_of

    root = _cache_root(request.config, tmp_path_factory)
    built: dict[str, str] = {}

    def get(variant: str = "tiny") -> str:
        if variant not in built:
            path = root / f"{variant}-{key_of(**VARIANTS[variant])[:16]}"
            built[variant] = str(build(path, **VARIANTS[variant]))
            _prune(root, keep=path)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def tiny_model(build_model) -> str:
    """The end-to-end tests' model: hidden 256, 4 layers, ~4M parameters.

    OOMGUARD_TEST_MODEL=DIR keeps it in DIR instead: reused only if its stamp matches the builder, rebuilt if it is
    an outdated build of ours; a directory the builder did not make is left alone and the cached build used."""
    from build_tiny_model import ForeignModelDir, build

    chosen = os.environ.get("OOMGUARD_TEST_MODEL")
    if chosen:
        try:
            return str(build(Path(chosen)))
        except ForeignModelDir as e:
            warnings.warn(f"OOMGUARD_TEST_MODEL ignored: {e}", stacklevel=1)
    return build_model("tiny")


@pytest.fixture(scope="session")
def wide_model(build_model) -> str:
    """The weights-heavy variant (1 layer, hidden 1024, ~16M parameters): optimizer and LoRA rungs matter most."""
    return build_model("wide")
