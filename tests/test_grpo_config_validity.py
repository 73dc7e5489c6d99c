"""Every knob combination any shipped ladder produces is accepted by TRL 1.16's real GRPOConfig.

A ValueError from GRPOConfig caused by a knob combination would be a bug in oomguard, never the user's fault, so
this builds a real GRPOConfig for every step of every ladder, from several starting geometries, the way a training
process does: the script's own values given to GRPOConfig, oomguard's overrides (the climb's, ``Climb.overrides``)
applied by the patch the bootstrap installs (``patch_grpo_config``: ``apply_config``, the gradient-checkpointing
mirror and the DeepSpeed config included) before TRL's own ``__post_init__`` validates them.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

from oomguard.child.config import CONFIG_KNOBS
from oomguard.decide.ladder import Exhausted, available_ladders, load_ladder
from oomguard.oom.diagnose import diagnose
from oomguard.strategies import Context
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.oomreport import OOMReport

trl = pytest.importorskip("trl")

DIAGNOSES = [
    diagnose(OOMReport("cuda", "allocator", "x", requested=4 << 30, capacity=80 << 30, free=1 << 30), phase="forward"),
    diagnose(OOMReport("cuda", "allocator", "x", requested=1 << 30, capacity=80 << 30, free=0,
                       reserved_unallocated=2 << 30), phase="generation"),
]
STARTS = [
    TRL_DEFAULTS,
    TRL_DEFAULTS.replace(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=16),
    TRL_DEFAULTS.replace(per_device_train_batch_size=6, generation_batch_size=24, num_generations=6),
    TRL_DEFAULTS.replace(per_device_train_batch_size=2, steps_per_generation=4, num_generations=8),
    TRL_DEFAULTS.replace(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=3),
]


NEVER_CREATED = os.path.join(tempfile.gettempdir(), "oomguard-test-never-created")


def script_kwargs(start):
    """What a script passes GRPOConfig for the start config (TRL's defaults for the rest)."""
    kw = {name: getattr(start, name) for name in CONFIG_KNOBS
          if getattr(start, name) is not None and getattr(start, name) != getattr(TRL_DEFAULTS, name)
          and name not in ("use_vllm", "vllm_mode", "bf16", "fp16")}
    kw["activation_checkpointing"] = start.gradient_checkpointing
    return kw


def grpo_config(start, knobs, tmp):
    """A real GRPOConfig built as the script builds ``start``, with the overrides that make it ``knobs`` applied by
    oomguard's patch of GRPOConfig (removed again after)."""
    import trl.trainer.grpo_config as grpo_config_module

    from oomguard.child import patches
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    overrides = {r.knob: r.after for r in start.diff(knobs)}
    rt = Runtime(Plan(overrides=overrides, crash_dir=str(tmp)))
    patches.patch_grpo_config(rt, grpo_config_module)
    try:
        # GRPOConfig never creates its output_dir: a path that does not exist leaves nothing behind
        return trl.GRPOConfig(output_dir=NEVER_CREATED, use_cpu=True, bf16=False, report_to=[],
                              **script_kwargs(start))
    finally:
        patches.remove()


@pytest.mark.parametrize("ladder", sorted(available_ladders()))
def test_every_step_builds_a_real_grpo_config(ladder, monkeypatch, tmp_path):
    lad = load_ladder(ladder)
    for world in (1, 2):
        monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self, w=world: w))
        facts = RunFacts(world_size=world, prompt_tokens_max=900, prompt_tokens_p95=300)
        for diag in DIAGNOSES:
            for start in STARTS:
                if start.validate(world):
                    continue  # a start the user could not have run
                knobs, used, seen = start, {}, 0
                grpo_config(start, knobs, tmp_path)
                while seen < 40:
                    step = lad.next(Context(knobs=knobs, facts=facts, diagnosis=diag, used=dict(used)))
                    if isinstance(step, Exhausted):
                        break
                    knobs = step.knobs
                    used[step.remedy.name] = used.get(step.remedy.name, 0) + 1
                    seen += 1
                    cfg = grpo_config(start, knobs, tmp_path)  # a ValueError: a combination GRPO rejects
                    assert cfg.generation_batch_size % cfg.num_generations == 0
                    assert cfg.num_generations >= 2
                    for name in ("num_generations", "max_completion_length", "per_device_train_batch_size",
                                 "gradient_accumulation_steps", "beta", "torch_empty_cache_steps"):
                        assert getattr(cfg, name) == getattr(knobs, name), name  # the override reached the config
                    assert cfg.gradient_checkpointing == knobs.gradient_checkpointing


def test_the_probe_and_the_overrides_go_through_the_real_post_init(tmp_path):
    """The patch applies overrides before TRL's own validation; the result must still validate."""
    from oomguard.child.config import apply_config
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    rt = Runtime(Plan(overrides={"num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 64},
                      probe={"steps": 2}))
    cfg = SimpleNamespace(**{k: getattr(TRL_DEFAULTS, k) for k in CONFIG_KNOBS}, gradient_checkpointing=True,
                          deepspeed=None, fsdp="", save_strategy="steps", save_steps=500, output_dir="x",
                          generation_kwargs=None)
    apply_config(rt, cfg)
    assert cfg.max_steps == 2 and cfg.generation_kwargs == {"min_new_tokens": 64}
    # a config that saves saves once, at the probe's last step (into the probe's scratch directory); one that does
    # not evaluate is not made to
    assert (cfg.save_strategy, cfg.save_steps, cfg.eval_strategy) == ("steps", 2, "no")
    assert cfg.output_dir != "x"
    kw = {k: getattr(cfg, k) for k in ("num_generations", "per_device_train_batch_size", "max_completion_length")}
    trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)


def test_a_config_that_evaluates_is_probed_with_one_evaluation_pass_and_no_save_when_it_saves_none(tmp_path):
    """The probe's one evaluation comes at its last step (the optimizer state exists by then); evaluation on start is
    left out, and a config that saves nothing saves nothing in the probe either. The result passes TRL's own checks."""
    from oomguard.child.config import apply_config
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    rt = Runtime(Plan(overrides={"per_device_eval_batch_size": 4, "num_generations_eval": 4}, probe={"steps": 3}))
    cfg = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], eval_strategy="epoch",
                         eval_on_start=True, num_generations=8, per_device_eval_batch_size=16, save_strategy="no")
    apply_config(rt, cfg)
    assert (cfg.eval_strategy, cfg.eval_steps, cfg.eval_on_start, cfg.save_strategy) == ("steps", 3, False, "no")
    kw = {k: getattr(cfg, k) for k in ("eval_strategy", "eval_steps", "per_device_eval_batch_size",
                                       "num_generations_eval", "num_generations")}
    trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)


def test_the_batch_rule_is_trls_across_every_rank(monkeypatch):
    """Issue 47: GRPO's batch rules as oomguard checks them (``Knobs.validate``, what `oomguard plan --world-size`
    and every rung ask) accept exactly what TRL's own GRPOConfig accepts on each world size: the generation batch
    across every rank (rows per device x ranks) must divide by num_generations, not the rows of one device. (TRL 0.29.1
    and 1.10.0 have the same rule, GRPOConfig.__post_init__.)"""
    from oomguard.vocab.knobs import check_values

    disagree = []
    # (ranks, rows per device, accumulation, generations): valid only across ranks, invalid on any, valid on one
    for world, bs, ga, gens in ((4, 2, 1, 8), (2, 3, 2, 4), (3, 2, 1, 8), (2, 3, 1, 4), (1, 2, 1, 8), (1, 4, 2, 8),
                                (4, 1, 2, 8), (2, 1, 1, 4)):
        monkeypatch.setattr(trl.GRPOConfig, "world_size", property(lambda self, w=world: w))
        values = {"per_device_train_batch_size": bs, "gradient_accumulation_steps": ga, "num_generations": gens}
        try:
            trl.GRPOConfig(output_dir=NEVER_CREATED, use_cpu=True, bf16=False, report_to=[], **values)
            accepted = True
        except ValueError:
            accepted = False
        if accepted != (not check_values(values, world)):
            disagree.append((world, values, accepted))
    assert not disagree
    assert not check_values({"per_device_train_batch_size": 2, "num_generations": 8}, 4)  # 8 rows on 4 GPUs: one group
