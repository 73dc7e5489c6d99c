"""One fit verdict (issue 47): `oomguard plan` says what `oomguard run` does, because both ask one function.

For every config of the table, three code paths are asked the same question, with nothing launched:

- `oomguard plan`'s: ``make_plan`` (what the command prints and its exit code follow): how run starts the config, and
  after a pre-flight stop, the config it chooses and how that one starts;
- the supervisor's: a ``Conductor`` built as ``oomguard run`` builds it (its default options), whose ``first`` attempt
  and the plan it carries (``Conductor.judging``) go to
- the training process's: ``child/preflight`` on a ``Runtime`` holding that plan, fed the events a TRL script's
  patches emit (the script's GRPOConfig values, the TRL it runs, its model and prompt lengths): ``decide_probe`` and
  ``check`` decide run, probe or stop. Its events go back through the supervisor's own reading (``take_events``,
  ``classify``), the conductor chooses after a stop, and the training process decides the choice's launch in turn.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from oomguard.child import preflight
from oomguard.child.runtime import Runtime
from oomguard.decide.climb import Climb
from oomguard.decide.conductor import Conductor
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import ModelSpec
from oomguard.run.classify import classify
from oomguard.run.learning import take_events
from oomguard.run.options import RunOptions
from oomguard.run.proc import ProcessResult
from oomguard.vocab.ended import Ended
from oomguard.vocab.events import CodeSeen, DatasetSeen, ModelSeen, read_events
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.protocol import Plan, ProbePlan
from oomguard.vocab.records import AttemptKind, Outcome
from oomguard.vocab.trlrange import head_of

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
MiB, GiB = 2**20, 2**30
TINY = {"model_type": "llama", "vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True, "max_position_embeddings": 2048}
SMALL = {"max_completion_length": 32, "num_generations": 4, "per_device_train_batch_size": 4, "bf16": False}


def model(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


# name: (model config, the script's GRPOConfig values, device (bytes, or a multiple of the plan's own peak on the
#        simulated device), simulated, the TRL the script runs, its longest prompt)
CASES = {
    "far under the device": (TINY, SMALL, 4.0, True, "1.16.0", 24),
    "near its edge": (TINY, SMALL, 1.1, True, "1.16.0", 24),
    "just over, within the error": (TINY, SMALL, 0.95, True, "1.16.0", 24),
    "half its peak": (TINY, {**SMALL, "max_completion_length": 64, "num_generations": 8,
                             "per_device_train_batch_size": 8}, 0.5, True, "1.16.0", 24),
    "an untested TRL far under": (TINY, SMALL, 4.0, True, "1.99.0", 24),
    "TRL 1.10's logits head": (TINY, SMALL, 1.2, True, "1.10.0", 24),
    "vLLM's share cannot hold it": (TINY, {**SMALL, "use_vllm": True, "vllm_gpu_memory_utilization": 0.2,
                                           "vllm_max_model_length": 2048}, 150 * MiB, True, "1.16.0", 20),
    "vLLM at 0.9 beside training": (TINY, {**SMALL, "use_vllm": True, "vllm_gpu_memory_utilization": 0.9,
                                           "vllm_max_model_length": 256}, 150 * MiB, True, "1.16.0", 20),
    "Llama-3.2-1B on 80 GB": (model("llama-3.2-1b"), {"dtype": "bfloat16", "lora_r": 16}, 80 * GiB, False, "1.16.0",
                              256),
    "Llama-3.2-1B full on 15.73 GiB": (model("llama-3.2-1b"), {"max_completion_length": 786}, int(15.73 * GiB),
                                       False, "1.16.0", 256),
    "Qwen2.5-3B near a 24 GiB card": (model("qwen2.5-3b"), {"dtype": "bfloat16", "lora_r": 32,
                                                            "per_device_train_batch_size": 16,
                                                            "max_completion_length": 1024}, 24 * GiB, False,
                                      "1.16.0", 256),
    "a MoE on a card": (model("qwen3-30b-a3b"), {"dtype": "bfloat16", "lora_r": 16, "max_completion_length": 64},
                        1024 * GiB, False, "1.16.0", 256),
    "Qwen2.5-3B with vLLM's window on 47.54 GiB": (model("qwen2.5-3b"), {"dtype": "bfloat16", "lora_r": 16,
                                                                         "use_vllm": True,
                                                                         "vllm_gpu_memory_utilization": 0.1},
                                                   int(47.54 * GiB), False, "1.16.0", 256),
}


def planned(case: tuple) -> tuple[object, int]:
    config, values, device, simulated, trl, prompt = case
    spec = ModelSpec.from_config(config)
    knobs = TRL_DEFAULTS.merged(values)
    facts = RunFacts(trl_version=trl, trl_head=head_of(trl))
    cap = device if isinstance(device, int) else int(make_plan(spec, knobs, 2**40, facts=facts, prompt_tokens=prompt,
                                                               simulated=simulated).estimate.peak_bytes * device)
    return make_plan(spec, knobs, cap, facts=facts, prompt_tokens=prompt, simulated=simulated), cap


def launch(tmp: Path, index: int, con: Conductor, nxt, case: tuple) -> tuple[str, list]:
    """One attempt as `oomguard run` launches it, up to the point where the training process decides: the plan the
    supervisor writes, the events the script's patches emit, the pre-flight's decision."""
    config, values, _device, _simulated, trl, prompt = case
    adir = tmp / f"attempt-{index}"
    adir.mkdir(parents=True)
    c = con.climb
    parts = con.judging()
    probe = ProbePlan(output_dir=str(adir / "scratch"), unless_sure=nxt.deferred) if nxt.kind != AttemptKind.RUN else None
    rt = Runtime(Plan(attempt=index, overrides=c.overrides(c.effective()[0]), events=str(adir / "events.jsonl"),
                      probe=probe, **parts))
    rt.observe(values)
    rt.emit(CodeSeen(point="config", facts={"trl_version": trl, "trl_head": head_of(trl)}, observed=dict(values)))
    rt.emit(CodeSeen(point="trainer", facts={"model_source": "string", "world_size": 1}))
    rt.model_config = config  # as the trainer patch records a model TRL loads by name
    rt.emit(ModelSeen(config=config, params=None, dtype=None))
    rt.emit(DatasetSeen(rows=64, prompt_tokens_max=prompt, prompt_tokens_p95=prompt))
    preflight.decide_probe(rt, config)
    try:
        preflight.check(rt)
        decided = rt.probe_as
    except SystemExit:
        decided = "stop"
    return str(decided), read_events(adir / "events.jsonl")


def run_side(tmp: Path, case: tuple, cap: int, probe_oom: bool) -> dict:
    """How `oomguard run` starts the config, and after a pre-flight stop (or, ``probe_oom``, after its probe ran out
    of memory, the OOM's own figures unknown as they are to plan) the config it chooses and how that starts."""
    _config, _values, _device, simulated, trl, _prompt = case
    opts = RunOptions(ladder=load_ladder("default"), simulate_gpu=cap if simulated else None)
    con = Conductor(Climb(opts.ladder), Judge(cap, simulated=simulated), opts.policy_for(device=True), capacity=cap,
                    launched=True)
    con.take_trl(trl, None)  # the command's TRL, read before launching
    nxt = con.first()
    first, events = launch(tmp, 1, con, nxt, case)
    out = {"first": first, "then": None, "suggest": {}}
    if first == "run" or (first == "probe" and not probe_oom):
        return out
    take_events(con, events, sized_by_nvml=False, say=lambda _s: None, warn=lambda _s: None)
    knobs = con.climb.effective()[0]
    if first == "stop":
        res = ProcessResult(returncode=87, stdout_tail="", stderr_tail="", interrupted=None, seconds=1.0)
        ended = replace(classify(1, res, tmp / "attempt-1", events, knobs, [], lambda _s: None), kind=nxt.kind)
        assert ended.outcome == "predicted"
    else:
        ended = Ended(kind=nxt.kind, knobs=knobs.to_dict(), remedies=[], outcome=Outcome.OOM, exit_code=86,
                      seconds=1.0)
    attempt, diag = con.take(ended), ended.diagnosis
    nxt = con.after(attempt, diag)
    if nxt.kind is None:
        return out
    chosen = con.climb.effective()[0]
    out["suggest"] = {r.knob: (list(r.after) if isinstance(r.after, tuple) else r.after)
                      for r in con.climb.original().diff(chosen)}
    out["then"] = launch(tmp, 2, con, nxt, case)[0]
    return out


@pytest.mark.parametrize("name", CASES)
def test_plan_and_run_agree(tmp_path, name):
    case = CASES[name]
    p, cap = planned(case)
    run = run_side(tmp_path, case, cap, probe_oom=p.climb is not None)
    assert {"first": p.first, "then": p.then} == {"first": run["first"], "then": run["then"]}, p.verdict.line()
    assert p.suggest == run["suggest"]
    assert (p.verdict.decision == "stop") == (p.first == "stop")  # the verdict plan prints is the one run stops on


def test_the_table_covers_every_verdict_and_both_devices():
    firsts = {name: planned(case)[0].first for name, case in CASES.items()}
    assert set(firsts.values()) == {"run", "probe", "stop"}, firsts
    assert {c[3] for c in CASES.values()} == {True, False}
    assert firsts["far under the device"] == "run" and firsts["an untested TRL far under"] == "probe"
    assert firsts["a MoE on a card"] == "probe" and firsts["vLLM's share cannot hold it"] == "stop"


def test_the_plan_carries_one_judge_and_no_copy_of_it(tmp_path):
    """The training process decides with the one judge the supervisor holds (``JudgeSpec``): one plan part for
    "will it fit", the same for the pre-flight and the probe's decision."""
    con = Conductor(Climb(load_ladder("default")), Judge(GiB, simulated=True),
                    RunOptions(ladder=load_ladder("default")).policy_for(device=True), capacity=GiB, launched=True)
    parts = con.judging()
    assert parts["judge"] == con.judge.judge_spec() and parts["preflight"] and con.first().deferred
    plan = Plan(probe=ProbePlan(unless_sure=True), **parts)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    again = Plan.load(str(path))  # as the training process reads it
    assert again.judge == con.judge.judge_spec() and again.preflight and again.probe.unless_sure is True
