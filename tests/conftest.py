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
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models are local: a test never waits on the network
# an event, a field or a fact the supervisor does not know is an error here (for users, a warning said once)
os.environ.setdefault("OOMGUARD_STRICT_EVENTS", "1")

# Hypothesis: enough examples to matter, few enough for CI.
try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, deadline=None)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass

STALE_AFTER_S = 86400.0  # cached builds of other keys older than this are removed
MAX_WORKERS = 4  # an end-to-end test is one single-threaded training process at a time (two with torchrun)


# ----------------------------------------------------------------------------------------------------------------
# What a run runs, and where: `python -m pytest -q` runs the whole suite but the `slow` tests, on up to MAX_WORKERS
# cores (pyproject's addopts say `-n auto`); a narrower run (paths, node ids, -k) stays in one process.


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for `-n auto`: one per core for a run of the whole suite (or of a marker: `-m slow`), none otherwise.

    A run of one file or test pays no worker start-up; the whole suite, mostly subprocesses each on one thread,
    takes half the time on two cores. OOMGUARD_TEST_WORKERS=N decides instead (0: in this process).
    """
    chosen = os.environ.get("OOMGUARD_TEST_WORKERS") or os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        try:
            return max(0, int(chosen))
        except ValueError:
            raise pytest.UsageError(f"OOMGUARD_TEST_WORKERS={chosen!r} is not a number: use e.g. 2, or 0 for no "
                                    "workers") from None
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(cores, MAX_WORKERS) if whole else 0
    return workers if workers > 1 else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the `slow` tests unless chosen (`-m slow`, any -m, or a node id); on workers, end-to-end tests first.

    A `slow` test repeats, at full cost, what faster tests of the default run prove in parts (its docstring names
    them), or completes a matrix; the default run stays within 5 minutes on 2 cores, and CI runs them too
    (`python -m pytest -q -m slow`). The longest tests first keep both workers busy to the end.
    """
    named = any("::" in str(a) for a in config.args)
    if not config.option.markexpr and not named:
        slow = [i for i in items if i.get_closest_marker("slow")]
        if slow:
            items[:] = [i for i in items if not i.get_closest_marker("slow")]
            config.hook.pytest_deselected(items=slow)
    if hasattr(config, "workerinput"):
        items.sort(key=lambda i: i.get_closest_marker("e2e") is None)  # stable: the same order on every worker


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


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    """The processes the tests start put their temporary files under this session's pytest directory (which pytest
    prunes), not in the machine's: torchrun leaves a ``torchelastic_*`` log directory per launch, and the suite
    starts dozens. A test that checks what a run leaves in the temporary directory sets its own ``TMPDIR``."""
    import tempfile

    scratch = tmp_path_factory.getbasetemp() / "tmp"
    scratch.mkdir(exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(scratch))
    mp.setattr(tempfile, "tempdir", str(scratch))
    yield scratch
    mp.undo()


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
    from helpers import model_from_env

    return model_from_env(os.environ.get("OOMGUARD_TEST_MODEL"), lambda: build_model("tiny"))


@pytest.fixture(scope="session")
def wide_model(build_model) -> str:
    """The weights-heavy variant (1 layer, hidden 1024, ~16M parameters): optimizer and LoRA rungs matter most."""
    return build_model("wide")


@pytest.fixture(scope="session")
def family_model(tmp_path_factory) -> Callable[[str], str]:
    """``family_model("moe")``: a tiny random model of that family (bench/family_calibrate.py's ARCHS), built once a
    session."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from family_calibrate import ARCHS, build_model

    root = tmp_path_factory.mktemp("families")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            build_model(root / arch, ARCHS[arch])
            built[arch] = str(root / arch)
        return built[arch]

    return get
