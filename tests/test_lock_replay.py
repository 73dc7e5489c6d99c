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


def run_script(tmp, model_dir, overrides, *, trainer=True, script=None, pinned=None, after_config=None):
    """The GRPO script a user writes (its own from_pretrained, GRPOConfig, GRPOTrainer), run under oomguard's patches
    with ``overrides`` in the plan (and a replayed lock's ``pinned`` values); ``script``: its own GRPOConfig values
    (default SCRIPT), ``after_config(args)``: what it does to its config once built. Returns the training process's
    runtime and what it built."""
    import transformers.modeling_utils
    import trl.trainer.grpo_config as config_module
    import trl.trainer.grpo_trainer as trainer_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oomguard.child import patches
    from oomguard.child.runtime import Runtime
    from oomguard.vocab.protocol import Plan

    rt = Runtime(Plan(overrides=overrides, pinned=pinned or {}, crash_dir=str(tmp), events=str(tmp / "events.jsonl")))
    patches.patch_grpo_config(rt, config_module)
    patches.patch_grpo_trainer(rt, trainer_module)
    patches.patch_from_pretrained(rt, transformers.modeling_utils)
    try:
        args = trl.GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, report_to=[], max_steps=1,
                              **(SCRIPT if script is None else script))
        if after_config is not None:
            after_config(args)
        if not trainer:
            return rt, args, None
        if trainer == "by name":  # GRPOTrainer loads it (the script gives its path)
            return rt, args, trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0],
                                             args=args)
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
    ran = [e for e in ran_events(tmp_path) if e.event_name() == "ran"][-1]  # what it runs is what it says
    assert {k: ran.knobs[k] for k in overrides} == overrides and not ran.later
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


# -- a lock is exact (issue 45, point 1) --------------------------------------------------------------------------------
# The GSM8K demo of the issue: its GRPOConfig sets 16 x 4; oomguard chose 8 x 8 and held; the lock holds both. 8 is
# TRL's default per_device_train_batch_size, which a plan computed against TRL's defaults dropped (the script's 16 ran).
DEMO = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4, "num_generations": 4,
        "max_completion_length": 32}
DEMO_LOCK = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8}


def replayed(lock_overrides: dict) -> Climb:
    """A replay as run/supervisor.py builds it, before its command reported anything."""
    return Climb(load_ladder("default"), pinned=Knobs.from_dict(lock_overrides))


def test_a_replay_sends_every_locked_value_whatever_trls_default_is():
    climb = replayed(DEMO_LOCK)
    assert climb.overrides() == DEMO_LOCK  # the first launch: nothing of the script's known yet
    climb.observe(DEMO)  # once the script's 16 x 4 is known, the lock's 8 x 8 still goes, and the lock keeps both
    assert climb.overrides() == DEMO_LOCK and lock_of(climb)["overrides"] == DEMO_LOCK
    # a locked value equal to the script's own is still the lock's: a replay of its lock pins it too
    same = replayed({"num_generations": 4})
    same.observe(DEMO)
    assert same.overrides() == {"num_generations": 4}


def test_a_value_a_rung_fixed_before_the_command_reported_its_own_is_sent_too():
    """A config chosen before the command reported its values (its first attempt stopped before GRPOConfig, at a
    load) fixes graded values from TRL's defaults: one equal to TRL's default still goes, or the script's would run."""
    from oomguard.decide.choose import Rung
    from oomguard.strategies import make_remedy

    climb = Climb(load_ladder("default"))
    climb.applied = [Rung(make_remedy("micro_batch"), values=(("per_device_train_batch_size", 8),
                                                              ("gradient_accumulation_steps", 1)))]
    assert climb.overrides() == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    climb.observe(DEMO)  # reported: the diff against the script's own values carries them
    assert climb.overrides()["per_device_train_batch_size"] == 8


def test_a_rung_whose_values_hold_more_than_knobs_sends_only_the_knobs():
    """generation_rounds keeps the rows per round among its values (not a knob): the plan carries only knobs."""
    from oomguard.decide.choose import Rung
    from oomguard.strategies import make_remedy

    climb = Climb(load_ladder("default"))
    climb.applied = [Rung(make_remedy("generation_rounds"), values=(
        ("per_device_train_batch_size", 2), ("gradient_accumulation_steps", 8), ("steps_per_generation", 8),
        ("rows_per_round", 4)))]
    assert climb.overrides() == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
                                 "steps_per_generation": 8}


def ran_events(tmp) -> list:
    from oomguard.vocab.events import read_events

    return [e for e in read_events(tmp / "events.jsonl") if e.event_name() in ("ran", "end")]


def test_the_training_process_runs_and_reports_every_locked_value(tmp_path):
    """The demo's own GRPOConfig (16 x 4) under the plan a replay of its lock sends: TRL's real GRPOConfig runs the
    lock's 8 x 8, the script's values are still what it reports as the user's, and what it runs is what it says."""
    climb = replayed(DEMO_LOCK)
    rt, args, _ = run_script(tmp_path, None, climb.overrides(), trainer=False, script=DEMO, pinned=DEMO_LOCK)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 8)
    assert (rt.observed["per_device_train_batch_size"], rt.observed["gradient_accumulation_steps"]) == (16, 4)
    ran = [e for e in ran_events(tmp_path) if e.event_name() == "ran"][-1]
    assert {k: ran.knobs[k] for k in DEMO_LOCK} == DEMO_LOCK and not ran.unmet


def test_a_script_that_sets_a_locked_knob_again_after_building_its_config_stops_before_training(tmp_path, capsys):
    """The script sets per_device_train_batch_size on its config after building it (as some notebooks do): the
    replay stops as GRPOTrainer is built, before anything is loaded (its model, here a path that does not exist, is
    never read), in one line naming both values."""
    import pytest

    def again(args):
        args.per_device_train_batch_size = 16

    climb = replayed(DEMO_LOCK)
    with pytest.raises(SystemExit) as stop:
        run_script(tmp_path, "no-such-model", climb.overrides(), trainer="by name", script=DEMO, pinned=DEMO_LOCK,
                   after_config=again)
    assert stop.value.code == 2 and "Traceback" not in capsys.readouterr().err
    ran, end = ran_events(tmp_path)[-2:]
    assert ran.unmet == {"knob": "per_device_train_batch_size", "locked": 8, "ran": 16,
                         "where": "the script sets it on its config after building it, before GRPOTrainer"}
    assert end.how == "unmet" and end.error.startswith(
        "the lock pins per_device_train_batch_size=8, but the training process runs 16 (the script sets it on its "
        "config after building it, before GRPOTrainer); stopped before training")


def test_a_recipes_accelerator_config_that_sets_the_accumulation_another_way_stops_the_replay(tmp_path, tiny_model):
    """A recipe that gives its accumulation steps through ``accelerator_config`` (transformers then sets
    ``gradient_accumulation_steps`` while the trainer is built): the locked 1 is not what runs, and the replay
    stops before training, naming who changed it."""
    import pytest

    script = {**SCRIPT, "accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}}
    with pytest.raises(SystemExit):
        run_script(tmp_path, tiny_model, {"gradient_accumulation_steps": 1}, script=script,
                   pinned={"gradient_accumulation_steps": 1})
    ran = [e for e in ran_events(tmp_path) if e.event_name() == "ran"][-1]
    assert (ran.unmet["locked"], ran.unmet["ran"]) == (1, 4) and "while GRPOTrainer was built" in ran.unmet["where"]


def test_a_value_of_oomguards_the_script_sets_again_is_what_the_report_says_ran(tmp_path, tiny_model):
    """Not a replay: a rung's value the script sets again after building its config. The training process runs the
    script's, reports it, and the supervisor records that (and says once that the rung cannot change it)."""
    from oomguard.run.learning import knobs_ran
    from oomguard.vocab.events import read_events

    def again(args):
        args.max_completion_length = 32

    run_script(tmp_path, tiny_model, {"max_completion_length": 16}, after_config=again)
    events = read_events(tmp_path / "events.jsonl")
    ran = [e for e in events if e.event_name() == "ran"][-1]
    assert ran.knobs["max_completion_length"] == 32 and "after building it" in ran.later["max_completion_length"]
    climb = Climb(load_ladder("default"))
    climb.observe(SCRIPT)
    assert knobs_ran(climb.effective()[0].replace(max_completion_length=16), events).max_completion_length == 32


# -- the supervisor's side of the stop --------------------------------------------------------------------------------
def test_a_replay_stopped_for_a_locked_value_fails_with_its_line_and_the_usage_code_and_is_not_retried(tmp_path):
    from oomguard.decide.conductor import Conductor, Policy
    from oomguard.run.classify import classify
    from oomguard.run.proc import ProcessResult
    from oomguard.run.verdict import conclude
    from oomguard.vocab.events import CodeSeen, ProcessEnded, Ran
    from oomguard.vocab.lock import Unmet
    from oomguard.vocab.records import Outcome

    unmet = Unmet("per_device_train_batch_size", 8, 16, "the script sets it on its config after building it")
    events = [CodeSeen("config", pid=11, rank=0), CodeSeen("config", pid=12, rank=1),
              Ran(knobs={"per_device_train_batch_size": 16}, unmet=unmet.to_dict(), pid=11, rank=0),
              ProcessEnded("unmet", pid=11, rank=0, error=unmet.line()),
              ProcessEnded("unmet", pid=12, rank=1, error=unmet.line())]
    for launcher_code in (1, 2):  # torchrun's own code, or the process's where nothing sits between
        result = ProcessResult(launcher_code, "", "", None, 1.0)
        ended = classify(1, result, tmp_path, events, TRL_DEFAULTS, [], warn=print)
        assert (ended.outcome, ended.exit_code, ended.diagnosis) == (Outcome.FAILED, 2, None)
        assert ended.note == unmet.line() and ended.unmet["knob"] == "per_device_train_batch_size"
    lock = Lock(overrides=DEMO_LOCK)
    climb = replayed(DEMO_LOCK)
    conductor = Conductor(climb, None, Policy(replay=True, probe_steps=0), launched=True)
    attempt = conductor.take(ended)
    assert conductor.after(attempt, None).kind is None  # not retried
    assert conclude(attempt, climb, replay=lock) == ("failed", 2, unmet.line())


def test_oomguard_run_ends_a_replay_whose_command_runs_another_value_in_one_line(tmp_path):
    """The stop through `oomguard run`, in seconds: the command stands in for a training process whose script sets a
    locked value again (it reports what it runs through oomguard's bootstrap, as one does, without TRL; the same
    with TRL's GRPOConfig and GRPOTrainer is the test above). One line, the usage code, no lock, no traceback."""
    import json
    import sys

    from helpers import run_oomguard

    lock = tmp_path / "in.lock.json"
    lock.write_text(json.dumps({"schema": "oomguard.lock/1", "overrides": DEMO_LOCK}))
    stand_in = ("from oomguard.child.runtime import runtime\nfrom oomguard.child import ran\nrt = runtime()\n"
                "rt.reached.add('config')\nrt.runs_instead({'per_device_train_batch_size': 16}, ran.BEFORE_TRAINER)\n"
                "ran.report(rt)\nprint('trained')\n")
    out, rep = run_oomguard(tmp_path, "--config", str(lock), "--", sys.executable, "-c", stand_in)
    assert out.returncode == 2 and rep["status"] == "failed", out.stderr[-3000:]
    assert rep["message"].startswith("the lock pins per_device_train_batch_size=8, but the training process runs 16 "
                                     "(the script sets it on its config after building it, before GRPOTrainer)")
    assert [(a["outcome"], a["exit_code"]) for a in rep["attempts"]] == [("failed", 2)]
    assert rep["attempts"][0]["unmet"]["ran"] == 16 and rep["stable"] is None
    assert out.stderr.count("the lock pins") == 1 and "Traceback" not in out.stderr and "trained" not in out.stdout
    assert "stopped before training" in out.stderr and not (tmp_path / "lock.json").exists()
