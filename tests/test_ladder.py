"""Ladders: TOML loading, cumulative climbing with reasons for skips, graded passes, GRPO-valid knobs."""

from pathlib import Path

import pytest

from oomguard.decide.ladder import Exhausted, LadderError, Step, available_ladders, load_ladder
from oomguard.oom.diagnose import diagnose
from oomguard.strategies import Context
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.oomreport import OOMReport
from oomguard.vocab.sizes import GiB, MiB

FRAG = diagnose(OOMReport("cuda", "allocator", "x", requested=1 * GiB, capacity=16 * GiB, free=100 * MiB,
                          reserved_unallocated=2 * GiB))
SHORT = diagnose(OOMReport("cuda", "allocator", "x", requested=4 * GiB, capacity=16 * GiB, free=1 * GiB,
                           reserved_unallocated=0), phase="forward")
HOST = diagnose(OOMReport("host", "oom-killer", "killed"))


def climb_all(ladder, diag, knobs=TRL_DEFAULTS, facts=None, max_steps=40):
    """Every step the ladder takes for a run that keeps failing with the same diagnosis."""
    facts = facts or RunFacts()
    steps = []
    used: dict[str, int] = {}
    for _ in range(max_steps):
        step = ladder.next(Context(knobs=knobs, facts=facts, diagnosis=diag, used=dict(used)))
        if isinstance(step, Exhausted):
            return steps, step
        steps.append(step)
        used[step.remedy.name] = used.get(step.remedy.name, 0) + 1
        knobs = step.knobs
    raise AssertionError("the ladder never ends")


def test_shipped_ladders_and_default_order():
    assert {"default", "quality-first", "fastest", "multi-gpu"} <= set(available_ladders())
    default = load_ladder("default")
    names = [r.name for r in default.rungs]
    # every rung of the design card, plus the micro-batch split and bf16 weights, in the order of their cost classes
    assert set(names) >= {"expandable_segments", "empty_cache", "shorter_sequences", "fewer_generations",
                          "checkpointing", "optimizer_8bit", "lora", "load_4bit", "micro_batch", "bf16_load"}
    ranks = [("none", "speed", "precision", "capacity", "signal").index(r.cost) for r in default.rungs]
    assert ranks == sorted(ranks) and default.choose_by == "cost"
    # the earlier default order is one --ladder away, chosen by its order
    fastest = load_ladder("fastest")
    assert [r.name for r in fastest.rungs
            if r.name not in ("deepspeed_buffers", "eval_batch", "liger_kernel", "smaller_images", "paged_cache")][:8] == [
                                                   "expandable_segments", "empty_cache", "shorter_sequences",
                                                   "fewer_generations", "checkpointing", "optimizer_8bit", "lora",
                                                   "load_4bit"]
    assert fastest.choose_by == "order" and load_ladder("quality-first").choose_by == "order"
    qf = [r.name for r in load_ladder("quality-first").rungs]
    # DeepSpeed's default buckets are sized on every ladder before anything that changes the experiment
    for names in ([r.name for r in fastest.rungs], qf):
        assert names.index("deepspeed_buffers") == names.index("empty_cache") + 1
    assert qf.index("micro_batch") < qf.index("fewer_generations") < qf.index("shorter_sequences")
    assert qf.index("bf16_load") < qf.index("micro_batch")


def test_fragmentation_climbs_allocator_rungs_first():
    steps, _ = climb_all(load_ladder("default"), FRAG)
    assert [s.remedy.name for s in steps[:2]] == ["expandable_segments", "empty_cache"]
    assert steps[0].knobs.expandable_segments is True


def test_shortfall_skips_allocator_rungs_and_says_why():
    steps, _ = climb_all(load_ladder("default"), SHORT)
    first = steps[0]
    assert first.remedy.name == "micro_batch"  # the cheapest rung that can help: the same gradients, more steps
    reasons = dict(first.skipped)
    assert "no fragmentation" in reasons["expandable_segments"]


def test_checkpointing_is_skipped_when_trl_already_does_it():
    steps, _ = climb_all(load_ladder("default"), SHORT)
    assert "checkpointing" not in [s.remedy.name for s in steps]
    skips = {n: why for s in steps for n, why in s.skipped}
    assert "already in force" in skips["checkpointing"]
    off = TRL_DEFAULTS.replace(gradient_checkpointing=False)
    assert "checkpointing" in [s.remedy.name for s in climb_all(load_ladder("default"), SHORT, off)[0]]


def test_the_climb_is_cumulative_graded_and_bounded():
    steps, end = climb_all(load_ladder("default"), SHORT)
    names = [s.remedy.name for s in steps]
    assert names.count("shorter_sequences") >= 2  # a second pass steps again
    final = steps[-1].knobs
    assert final.max_completion_length >= 64  # the floor
    assert final.num_generations >= 2
    assert final.lora_r and final.load_in_4bit and final.optim == "adamw_bnb_8bit"  # earlier rungs stay in force
    assert isinstance(end, Exhausted)


def test_every_step_of_every_ladder_is_valid_for_grpo():
    for name in available_ladders():
        for diag in (FRAG, SHORT):
            for start in (TRL_DEFAULTS, TRL_DEFAULTS.replace(per_device_train_batch_size=4,
                                                             gradient_accumulation_steps=4, num_generations=16),
                          TRL_DEFAULTS.replace(generation_batch_size=24, per_device_train_batch_size=6,
                                               num_generations=6)):
                steps, _ = climb_all(load_ladder(name), diag, start)
                for s in steps:
                    assert s.knobs.validate() == [], (name, s.remedy.name, s.knobs)


def test_expandable_segments_respects_the_user_and_vllm_sleep_mode():
    lad = load_ladder("default")
    locked = RunFacts(alloc_conf_locked="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    step = lad.next(Context(knobs=TRL_DEFAULTS, facts=locked, diagnosis=FRAG))
    assert isinstance(step, Step) and step.remedy.name == "empty_cache"
    assert "oomguard keeps it" in dict(step.skipped)["expandable_segments"]
    sleepy = TRL_DEFAULTS.replace(use_vllm=True, vllm_enable_sleep_mode=True)
    step = lad.next(Context(knobs=sleepy, diagnosis=FRAG))
    assert "sleep mode" in dict(step.skipped)["expandable_segments"]


def test_host_ram_uses_host_rungs_only():
    lad = load_ladder("default")
    step = lad.next(Context(knobs=TRL_DEFAULTS.replace(dataloader_num_workers=4), diagnosis=HOST))
    assert isinstance(step, Step) and step.remedy.name == "fewer_workers"
    assert isinstance(lad.next(Context(knobs=TRL_DEFAULTS, diagnosis=HOST)), Exhausted)


def test_unread_knobs_are_skipped():
    lad = load_ladder("default")
    step = lad.next(Context(knobs=TRL_DEFAULTS, diagnosis=SHORT, read_fields=frozenset({"optim"})))
    assert isinstance(step, Step) and step.remedy.name == "optimizer_8bit"
    assert "never reads per_device_train_batch_size" in dict(step.skipped)["micro_batch"]


def test_load_phase_only_takes_load_remedies():
    load = diagnose(OOMReport("cuda", "allocator", "x", requested=4 * GiB, capacity=16 * GiB, free=1 * GiB),
                    phase="load")
    steps, _ = climb_all(load_ladder("default"), load, knobs=TRL_DEFAULTS.replace(learning_rate=1e-4))
    assert [s.remedy.name for s in steps] == ["bf16_load", "load_4bit"]
    # at TRL's 1e-6 bf16 weights would not learn: only the 4-bit load (with LoRA) is left
    steps, _ = climb_all(load_ladder("default"), load)
    assert [s.remedy.name for s in steps] == ["load_4bit"]


@pytest.mark.parametrize("text, problem", [
    ("name = 'x'", "at least one [[rung]]"),
    ("[[rung]]\nremedy = 'nope'", "unknown remedy 'nope'"),
    ("[[rung]]\nremedy = 'lora'\nbogus = 1", "takes no parameter(s) bogus"),
    ("[[rung]]\nremedy = 'lora'\n[[rung]]\nremedy = 'lora'", "listed twice"),
    ("[[rung]\n", "not valid TOML"),
    ("[[rung]]\nfactor = 2", "needs a `remedy"),
    ("choose_by = 'price'\n[[rung]]\nremedy = 'lora'", "choose_by must be one of 'cost', 'order'"),
    # a ladder built on another (tests/test_ladder_extends.py)
    ("extends = 'default'\n[[rung]]\nremedy = 'lora'\nafter = 'zero3'", "rung #1: after 'zero3': the ladder has no "
                                                                        "rung zero3 here"),
    ("extends = 'default'\n[[rung]]\nremedy = 'lora'\nafter = 'lora'", "after 'lora'"),
    ("extends = 'default'\n[[rung]]\nremedy = 'lora'\nafter = 'micro_batch'\nbefore = 'bf16_load'",
     "rung #1: give one rung name"),
    ("extends = 'default'\nremove = ['zero3']", "remove names zero3, which default does not have"),
    ("remove = ['lora']\n[[rung]]\nremedy = 'bf16_load'", "it extends none"),
    ("extends = 'default'\nremove = ['lora']\n[[rung]]\nremedy = 'lora'", "lora is listed and removed"),
    ("extends = 'slowest'", "extends: no ladder named 'slowest'"),
    ("extends = 3", "extends must be a string"),
    ("extends = 'default'\nremove = 'lora'", "remove must be a list of rung names"),
    ("[[rung]]\nremedy = 'lora'\nbefore = 'bf16_load'", "rung #1: before 'bf16_load'"),
])
def test_bad_ladder_files_get_one_line_errors(tmp_path: Path, text: str, problem: str):
    p = tmp_path / "mine.toml"
    p.write_text(text)
    with pytest.raises(LadderError) as e:
        load_ladder(str(p))
    assert problem in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_unknown_ladder_name_and_directory(tmp_path: Path):
    with pytest.raises(LadderError, match="no ladder named 'slowest'"):
        load_ladder("slowest")
    with pytest.raises(LadderError, match="is a directory"):
        load_ladder(str(tmp_path))


def test_custom_ladder_params(tmp_path: Path):
    p = tmp_path / "short.toml"
    p.write_text("[[rung]]\nremedy = 'shorter_sequences'\nfactor = 0.25\nmin_completion_length = 16\n")
    step = load_ladder(str(p)).next(Context(knobs=TRL_DEFAULTS, diagnosis=SHORT))
    assert step.knobs.max_completion_length == 128


def test_ladders_command_lists_every_ladder_in_order():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "oomguard", "ladders", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    data = {lad["name"]: lad for lad in json.loads(out.stdout)}
    assert {"default", "quality-first", "multi-gpu"} <= set(data)
    assert [r["remedy"] for r in data["default"]["rungs"]][:2] == ["expandable_segments", "empty_cache"]
    assert all({"remedy", "trades", "resume", "graded", "summary"} <= set(r) for r in data["default"]["rungs"])
    text = subprocess.run([sys.executable, "-m", "oomguard", "ladders"], capture_output=True, text=True).stdout
    assert "quality-first" in text and "host RAM: fewer_workers" in text
