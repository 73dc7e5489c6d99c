"""`oomguard plan` as users ask it: a hub id read from the Hugging Face cache with no network, one row per card, and
the largest value of a knob that fits each card (`--fit`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.decide.fit import candidates, largest
from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import load_model_spec
from oomguard.memory.hubconfig import HubConfigError, config_path, looks_like_hub_id
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts

LLAMA = Path(__file__).resolve().parent / "fixtures" / "models" / "llama-3.2-1b"
GiB = 2**30


@pytest.fixture()
def hub_cache(tmp_path):
    """A Hugging Face cache as huggingface_hub writes it, holding one model's config.json and nothing else."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--llama-1b"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / sha).mkdir(parents=True)
    shutil.copy(LLAMA / "config.json", repo / "snapshots" / sha / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return cache


def plan(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "oomguard", "plan", *args], capture_output=True, text=True, env=env)


def test_a_hub_id_is_read_from_the_cache_with_no_network_one_row_per_card(hub_cache):
    out = plan("--model", "acme/llama-1b", "--gpu", "16GiB,24GiB,80GiB", "--fit", "max_completion_length",
               "dtype=bfloat16", "lora_r=16", "--json", cache=hub_cache)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [c["gpu"] for c in d["cards"]] == ["16GiB", "24GiB", "80GiB"]
    longest = [c["fit_value"] for c in d["cards"]]
    assert all(v is not None for v in longest) and longest == sorted(longest) and longest[0] < longest[-1]
    assert d["knobs"] == {"dtype": "bfloat16", "lora_r": 16}
    # the answer is the edge: the value fits and one token more does not (as `oomguard run` judges)
    spec = load_model_spec(LLAMA / "config.json")
    k = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16)
    p = make_plan(spec, k, 16 * GiB, facts=RunFacts())
    judge = p.judge.fits(p.facts)
    assert judge(k.replace(max_completion_length=longest[0]))
    assert not judge(k.replace(max_completion_length=longest[0] + 1))
    text = plan("--model", "acme/llama-1b", "--gpu", "16GiB,24GiB", "--fit", "num_generations", cache=hub_cache)
    # a full fine-tune of the 1.2B model in float32 (22 GiB predicted) holds no 2 generations on 16 GiB: exit 3
    assert text.returncode == 3 and "largest num_generations" in text.stdout and "24.00 GiB" in text.stdout
    rows = json.loads(plan("--model", "acme/llama-1b", "--gpu", "16GiB,24GiB", "--fit", "num_generations", "--json",
                           cache=hub_cache).stdout)["cards"]
    assert rows[0]["verdict"] == "stop" and rows[0]["fit_value"] is None and rows[1]["fit_value"] is not None
    # each card's verdict is the one a plan of that card alone gives, as `oomguard run` acts on it
    assert [r["verdict"] for r in rows] == [make_plan(spec, TRL_DEFAULTS, size * GiB, facts=RunFacts()).first
                                            for size in (16, 24)]


def test_several_cards_without_fit_say_what_run_would_set_where_it_does_not_fit(hub_cache):
    out = plan("--model", "acme/llama-1b", "--gpu", "8GiB,80GiB", "max_completion_length=1024", "--json",
               cache=hub_cache)
    assert out.returncode == 3  # not on every card
    small, big = json.loads(out.stdout)["cards"]
    assert not small["fits"] and small["suggest"] and big["fits"] and big["suggest"] == {}


def test_several_cards_say_what_the_model_does_not_count_and_whose_defaults_fill_the_config():
    """The table of cards says what the one-card answer says beside its verdict: a vLLM server's own GPU is not
    modelled (hence "probe first" on every card), and the TRL lines before the table."""
    from rich.console import Console

    from oomguard.decide.ladder import load_ladder
    from oomguard.decide.plan import card_rows
    from oomguard.display.render import cards_table

    spec = load_model_spec(LLAMA / "config.json")
    k = TRL_DEFAULTS.replace(use_vllm=True, vllm_mode="server")
    rows, worst = card_rows(spec, k, [("24GiB", 24 * GiB), ("80GiB", 80 * GiB)], None, ladder=load_ladder("default"),
                            facts=RunFacts(), prompt_tokens=None)
    out = Console(record=True, width=200)
    cards_table(out, rows, "llama", None, ["TRL 0.29.1 (--trl-version): its defaults fill the config"])
    text = out.export_text()
    assert worst == "probe" and text.startswith("TRL 0.29.1 (--trl-version)")
    assert text.count("not modelled: a vLLM server's own GPU") == 1  # once for every card


def test_no_cached_config_offline_is_one_line_with_the_way_out(tmp_path):
    out = plan("--model", "acme/not-cached", "--gpu", "16GiB", cache=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "HF_HUB_OFFLINE" in out.stderr and "hf download acme/not-cached config.json" in out.stderr
    bad = plan("--model", "acme/llama-1b", "--gpu", "16GiB", "--fit", "optim", cache=tmp_path)
    assert bad.returncode == 2 and "--fit takes one of" in bad.stderr


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert config_path("org/model") == "org/model"
    assert not looks_like_hub_id("./org/model") and not looks_like_hub_id("/abs/path")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(HubConfigError, match="not a local path"):
        config_path("org/other")


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(0, 5000), batch=st.sampled_from([1, 2, 4, 6, 8, 12, 16]))
def test_the_search_finds_the_largest_accepted_value_under_any_monotone_limit(limit, batch):
    base = TRL_DEFAULTS.replace(per_device_train_batch_size=batch, num_generations=2 if batch % 2 == 0 else None)
    for knob in ("max_completion_length", "num_generations", "per_device_train_batch_size"):
        values = candidates(base, knob, upper=512)
        expect = max((v for v in values if v <= limit), default=None)
        assert largest(lambda k, kn=knob: getattr(k, kn) <= limit, base, knob, upper=512) == expect
