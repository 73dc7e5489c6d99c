"""Shared fixtures: a small local Llama (random weights, a tokenizer trained on the spot) built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

# Hypothesis: enough examples to matter, few enough for CI.
try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, deadline=None)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The end-to-end tests' model: hidden 256, 4 layers, ~4M parameters; cached in OOMGUARD_TEST_MODEL if set."""
    from build_tiny_model import build

    cached = os.environ.get("OOMGUARD_TEST_MODEL")
    path = Path(cached) if cached else tmp_path_factory.mktemp("model") / "tiny-llama"
    return str(build(path))
