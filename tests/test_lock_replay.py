"""A lock replays as exactly what it recorded, and a replay's report and lock say what ran.

Two halves, each per knob class (batch, generation, precision, LoRA, 4-bit, DeepSpeed, vLLM, a stack's flags):

- the training process: with a lock's overrides applied by oomguard's real patches (TRL's real GRPOConfig and
  GRPOTrainer, transformers' real from_pretrained, the tests' tiny model, in this process), what it reports as the
  user's own config is the script's, never an override of oomguard's, and each override reached what it sets;
- the supervisor: a replay of a lock whose training process reports the script's values writes the same lock
  (overrides, original, stable, and each change's remedy), and a replay of that lock again.

The end to end proof (a script that loads its own model, LoRA, a dtype change in its lock, replayed from its lock and
from the lock of that replay) is tests/test_replay_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oomguard.decide.climb import Climb
from oomguard.decide.ladder import load_ladder
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.lock import Lock

trl = pytest.importorskip("trl")

# The script's own values (what a user's GRPO script sets) and what a lock of each knob class overrides.
SCRIPT = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 4,
          "max_completion_length": 32}
CLASSES = {
    "batch": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4},
    "generation": {"num_generations": 2, "max_completion_length": 16},
    "precision": {"dtype": "bfloat16"},
    "lora": {"lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear"},
    "4-bit": {"load_in_4bit": True, "dtype": "bfloat16", "lora_r": 8},  # a 4-bit base trains only adapters
}


def run_script(tmp, model_dir, overrides, *, trainer=True):
    """The GRPO script a user writes (its own from_pretrained, GRPOConfig, GRPOTrainer), run under oomguard's patches
    with ``overrides`` in the plan; returns the training process's runtime and what it built."""
    import transformers.modeling_utils
    import trl.trainer.grpo_config as config_module
    import trl.trainer.grpo_trainer as trainer_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oomguard.child import patches
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    rt = Runtime(Plan(overrides=overrides, crash_dir=str(tmp), events=str(tmp / "events.jsonl")))
    patches.patch_grpo_config(rt, config_module)
    patches.patch_grpo_trainer(rt, trainer_module)
    patches.patch_from_pretrained(rt, transformers.modeling_utils)
    try:
        args = trl.GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, report_to=[], max_steps=1,
                              **SCRIPT)
        if not trainer:
            return rt, args, None
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        rows = [{"prompt": [{"role": "user", "content": f"{i}: alpha beta"}]} for i in range(16)]
        built = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                args=args, train_dataset=Dataset.from_list(rows),
                                processing_class=AutoTokenizer.from_pretrained(model_dir))
        return rt, args, built
    finally:
        patches.remove()


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_training_process_reports_the_scripts_values_under_a_locks_overrides(tmp_path, tiny_model, name):
    overrides = CLASSES[name]
    rt, args, built = run_script(tmp_path, tiny_model, overrides)
    user = TRL_DEFAULTS.merged(SCRIPT).replace(dtype="float32", lora_r=0, load_in_4bit=False)
    for knob in overrides:
        assert rt.observed.get(knob, getattr(TRL_DEFAULTS, knob)) == getattr(user, knob), knob  # the script's own
    model = built.model
    if name == "batch":
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    elif name == "generation":
        assert (args.num_generations, args.max_completion_length) == (2, 16)
    elif name == "precision":
        assert str(model.dtype) == "torch.bfloat16"
    elif name == "lora":
        assert type(model).__name__.startswith("Peft") and model.peft_config["default"].r == 8
    elif name == "4-bit":
        assert getattr(model, "is_loaded_in_4bit", False) or getattr(model.base_model, "is_loaded_in_4bit", False)


@pytest.mark.parametrize("overrides", [{"zero_stage": 2}, {"vllm_gpu_memory_utilization": 0.2},
                                       {"use_cpu": True}])
def test_config_level_overrides_are_never_taken_for_the_scripts_values(tmp_path, overrides):
    """DeepSpeed, vLLM's reservation and an adaptation reach GRPOConfig; the script's values are what it reports
    (the trainer's DeepSpeed and vLLM need several ranks and a vLLM: tests/test_deepspeed.py, tests/test_vllm.py)."""
    rt, args, _ = run_script(tmp_path, None, overrides, trainer=False)
    script = TRL_DEFAULTS.merged(SCRIPT).replace(use_cpu=True)  # the script sets use_cpu=True itself
    for knob in overrides:
        assert rt.observed.get(knob, getattr(TRL_DEFAULTS, knob)) == getattr(script, knob), knob
    if "zero_stage" in overrides:
        assert args.deepspeed
    if "vllm_gpu_memory_utilization" in overrides:
        assert args.vllm_gpu_memory_utilization == 0.2


def test_a_stacks_flags_are_read_before_oomguard_sets_its_own():
    """ms-swift: the user's model-level flags are observed before the lock's are set (patch_arguments' order)."""
    from oomguard.child.runtime import Runtime
    from oomguard.child.stacks.swift import apply_model_args, observed_model_args
    from oomguard.vocab.protocol import Plan

    args = SimpleNamespace(tuner_type="full", lora_rank=8, lora_alpha=32, quant_method=None, quant_bits=None,
                           torch_dtype=None, target_modules=["all-linear"], deepspeed=None)
    rt = Runtime(Plan(overrides={"lora_r": 16, "zero_stage": 3, "offload_optimizer": True, "offload_params": True}))
    user = observed_model_args(args)
    apply_model_args(rt, args)
    assert user["lora_r"] == 0 and (args.tuner_type, args.lora_rank, args.deepspeed) == ("lora", 16, "zero3_offload")


# -- the supervisor's half ---------------------------------------------------------------------------------------------
LOCKS = {
    "batch": ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, "micro_batch"),
    "generation": ({"num_generations": 2, "max_completion_length": 16}, "fewer_generations"),
    "precision": ({"dtype": "bfloat16"}, "bf16_load"),
    "lora": ({"lora_r": 16, "lora_alpha": 32, "lora_target_modules": "all-linear"}, "lora"),
    "4-bit": ({"load_in_4bit": True, "dtype": "bfloat16"}, "load_4bit"),
    "deepspeed": ({"zero_stage": 3, "offload_optimizer": True}, "zero3"),
    "vllm": ({"vllm_gpu_memory_utilization": 0.2}, "vllm_memory"),
}


def lock_of(climb: Climb) -> dict:
    """What the supervisor writes as a run's lock (run/ending.py: overrides, original, stable, the diff's rows)."""
    final, who = climb.effective()
    original = climb.original()
    return {"overrides": climb.overrides(final), "original": original.to_dict(), "stable": final.to_dict(),
            "diff": [{**r.to_dict(), "remedy": who.get(r.knob)} for r in original.diff(final)]}


def replay(lock: dict, reported: dict, adapted: dict | None = None) -> Climb:
    """A replay of ``lock`` whose training process reports the script's values (``reported``), as run/supervisor.py
    builds it."""
    c = Climb(load_ladder("default"), pinned=Knobs.from_dict(lock["overrides"]), pinned_by=Lock(lock["overrides"], diff=lock["diff"]).pinned_by())
    c.observe(reported)
    for knob, value in (adapted or {}).items():
        c.adapt(knob, value, "a reason")
    c.learn(RunFacts())
    return c


@pytest.mark.parametrize("name", list(LOCKS))
def test_a_lock_written_by_a_replay_is_the_lock_it_replayed(name):
    overrides, remedy = LOCKS[name]
    script = {**SCRIPT, "dtype": "float32", "lora_r": 0, "load_in_4bit": False, "use_vllm": True}
    first = {"overrides": overrides, "diff": [{"knob": k, "remedy": remedy} for k in overrides]}
    again = lock_of(replay(first, script))
    assert again["overrides"] == overrides
    assert {r["knob"]: r["remedy"] for r in again["diff"]} == dict.fromkeys(overrides, remedy)
    third = lock_of(replay(again, script))
    assert third == again


def test_an_adaptation_is_a_change_in_the_diff_and_the_lock_and_a_replay_keeps_it():
    """use_cpu set so that DeepSpeed's CPU ranks run: the first run's lock carries it, a replay applies it from the
    lock (its training process then has nothing to adapt) and writes it again."""
    script = {**SCRIPT, "use_cpu": False}
    first = Climb(load_ladder("default"))
    first.observe(script)
    first.adapt("use_cpu", True, "DeepSpeed runs on the CPU here")
    lock = lock_of(first)
    assert lock["overrides"] == {"use_cpu": True}
    assert lock["diff"] == [{"knob": "use_cpu", "from": False, "to": True, "remedy": "adaptation"}]
    assert [c.what for c in first.experiment().changed] == ["use_cpu=True (DeepSpeed runs on the CPU here)"]
    again = lock_of(replay(lock, script))
    assert again["overrides"] == {"use_cpu": True} and again["diff"][0]["remedy"] == "adaptation"
