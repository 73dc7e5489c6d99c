"""One launch when the memory model is sure: an attempt launched as a probe unless the model is sure of its config is
decided in the training process, where the config, the model's shape and the prompt lengths are known; `oomguard
plan` says what `run` would do by the same rule.

The end-to-end proof (a config at a quarter of its device runs once, the same config 10% above its peak is probed
first) is tests/test_one_launch_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.child import preflight
from oomguard.child.config import apply_config
from oomguard.child.probe import apply_probe
from oomguard.child.runtime import Runtime
from oomguard.decide.climb import Climb
from oomguard.decide.judge import Judge
from oomguard.decide.ladder import load_ladder
from oomguard.decide.plan import make_plan
from oomguard.memory.estimate import RUN, ModelSpec, estimate, judge_spec, load_model_spec, verdict
from oomguard.vocab.events import CodeSeen, DatasetSeen, ProbeDecided, parse_event, read_events
from oomguard.vocab.facts import RunFacts
from oomguard.vocab.knobs import TRL_DEFAULTS
from oomguard.vocab.protocol import Plan, ProbePlan
from oomguard.vocab.records import Attempt

MIB = 2**20
MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
TINY = {"model_type": "llama", "vocab_size": 724, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 1024, "tie_word_embeddings": True}


def runtime(tmp: Path, capacity: int, probe: bool = True, sure: bool = True) -> Runtime:
    tmp.mkdir(parents=True, exist_ok=True)
    judge = Judge(capacity, simulated=True)
    plan = Plan(events=str(tmp / "events.jsonl"), judge=judge.judge_spec(),
                probe={"steps": 2, "rows": 64, "output_dir": str(tmp / "scratch"), "unless_sure": sure} if probe else None)
    rt = Runtime(plan)
    rt.observe({"max_completion_length": 32, "num_generations": 4, "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 1, "bf16": False})
    rt.emit(CodeSeen(point="config", facts={"trl_version": "1.16.0", "trl_head": "fused"}))
    rt.emit(DatasetSeen(rows=64, prompt_tokens_max=24, prompt_tokens_p95=24))
    return rt


def decisions(tmp: Path) -> list[ProbeDecided]:
    return [e for e in read_events(tmp / "events.jsonl") if isinstance(e, ProbeDecided)]


def test_a_config_far_under_the_device_is_the_real_run(tmp_path):
    rt = runtime(tmp_path, 1024 * MIB)
    preflight.decide_probe(rt, TINY)
    assert rt.probe_as == "run" and not rt.probing()
    (d,) = decisions(tmp_path)
    assert d.decided == "run" and d.predicted_bytes < d.limit < d.capacity == 1024 * MIB
    assert "the memory model is sure it fits" in d.why


def test_a_config_near_the_edge_is_probed(tmp_path):
    est, _ = preflight.judged(runtime(tmp_path / "a", 1024 * MIB), TINY)
    capacity = int(est.peak_bytes * 1.1)  # 10% above the prediction: it may well fit, but only a probe can tell
    rt = runtime(tmp_path, capacity)
    preflight.decide_probe(rt, TINY)
    assert rt.probing()
    (d,) = decisions(tmp_path)
    assert d.decided == "probe" and "within the memory model's error of the edge" in d.why


@pytest.mark.parametrize("why, setup", [
    ("newer than the tested releases", lambda rt: rt.emit(CodeSeen(point="config", facts={"trl_version": "1.99.0"}))),
    ("no measurement covers", lambda rt: rt.emit(CodeSeen(point="facts", facts={"stack_untested": "a trainer no measurement covers"}))),
    ("cannot judge", lambda rt: None),
    # what the model does not count (memory/estimate/unmodelled.py): ms-swift's padding-free batches, a vLLM server
    ("not modelled: packed or padding-free batches",
     lambda rt: rt.emit(CodeSeen(point="trainer", facts={"unmodelled": ["padding_free"]}))),
    ("not modelled: a vLLM server's own GPU", lambda rt: rt.observe({"use_vllm": True, "vllm_mode": "server"})),
    ("not observed: the generation engine", lambda rt: rt.cannot_observe("the generation engine: a rollout_func")),
])
def test_what_the_model_cannot_be_sure_of_is_probed(tmp_path, why, setup):
    rt = runtime(tmp_path, 1024 * MIB)
    setup(rt)
    preflight.decide_probe(rt, None if why == "cannot judge" else TINY)
    assert rt.probing() and why in decisions(tmp_path)[0].why


def test_a_run_with_something_not_observed_is_never_sure(tmp_path):
    """A config far under the device that the model would be sure of, but whose prompts the training process could
    not measure: the model is unsure of the run, in the training process and in the supervisor's judge alike."""
    rt = runtime(tmp_path, 1024 * MIB)
    rt.cannot_observe("the prompts' length: the train_dataset is an IterableDataset")
    rt.cannot_observe("the prompts' length: the train_dataset is an IterableDataset")  # said once
    assert rt.facts()["unobserved"] == ["the prompts' length: the train_dataset is an IterableDataset"]
    preflight.decide_probe(rt, TINY)
    assert rt.probing() and "not observed: the prompts' length" in decisions(tmp_path)[0].why
    judge = Judge(1024 * MIB, simulated=True)
    est = judge.predict(RunFacts(model_config=TINY, prompt_tokens_max=24), TRL_DEFAULTS.replace(
        max_completion_length=32, num_generations=4, per_device_train_batch_size=4))
    assert judge.verdict(est).decision == "run"
    judge.unobserved = ("the prompts' length",)
    assert judge.verdict(est).decision == "probe"


def test_a_plan_without_unless_sure_is_a_probe_from_the_start_and_one_without_a_probe_the_run(tmp_path):
    assert runtime(tmp_path, 1024 * MIB, sure=False).probing()
    rt = runtime(tmp_path / "b", 1024 * MIB, probe=False)
    assert rt.probe_as == "run" and not rt.probe_undecided()
    preflight.decide_probe(rt, TINY)  # nothing to decide
    assert not (tmp_path / "b" / "events.jsonl").read_text().count("probe_decision")


def test_the_config_patch_leaves_an_undecided_probe_to_the_trainer_but_a_stack_that_cannot_wait_probes(tmp_path):
    """GRPOConfig is built before the model is known: TRL's trainer decides later; a construction point after which
    nothing could make it a probe (ms-swift's arguments) decides it a probe at once."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_steps=100, save_strategy="no", output_dir="mine", generation_kwargs=None,
                          max_completion_length=32, eval_strategy="no", deepspeed=None, fsdp="")
    rt = runtime(tmp_path, 1024 * MIB)
    apply_config(rt, cfg)
    assert (cfg.max_steps, cfg.output_dir) == (100, "mine") and rt.probe_undecided()
    apply_config(rt, cfg, can_defer=False)
    assert rt.probing() and cfg.max_steps == 2 and cfg.output_dir == str(tmp_path / "scratch")
    assert decisions(tmp_path)[0].decided == "probe"


def test_the_probe_applied_after_grpo_configs_post_init_keeps_transformers_types(tmp_path):
    """Decided at the trainer, the probe rewrites a config whose strategies are enums already: they stay enums, and
    the trainer's checks read them as before."""
    trl = pytest.importorskip("trl")
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    cfg = trl.GRPOConfig(output_dir=str(tmp_path / "mine"), use_cpu=True, bf16=False, report_to=[],
                         save_strategy="steps", save_steps=50, eval_strategy="epoch", num_generations=4,
                         per_device_train_batch_size=4, max_completion_length=32)
    apply_probe(runtime(tmp_path, 1024 * MIB), cfg, ProbePlan(steps=2, output_dir=str(tmp_path / "scratch")))
    assert cfg.save_strategy is SaveStrategy.STEPS and cfg.save_steps == 2
    assert cfg.eval_strategy is IntervalStrategy.STEPS and cfg.eval_steps == 2
    assert cfg.max_steps == 2 and cfg.output_dir == str(tmp_path / "scratch")
    assert cfg.generation_kwargs == {"min_new_tokens": 32} and cfg.report_to == []


def test_the_one_verdict_is_sure_far_under_the_device_probes_near_it_and_stops_beyond_the_margin():
    """The rule of docs/concepts/preflight-and-probes.md on the simulated device (fused head: 12% under-predicted at
    most, 9.7% over): sure while 10% of the device stays free beyond the 12% (up to 80.4% of it), a probe up to
    11.7% over it (9.7% + 2%), stopped beyond."""
    est = estimate(ModelSpec.from_config(TINY), TRL_DEFAULTS.replace(max_completion_length=32), prompt_tokens=24,
                   simulated=True)
    decide = {share: verdict(est, judge_spec(int(est.peak_bytes / share), simulated=True, margin=0.02)).decision
              for share in (0.25, 0.80, 0.81, 1.0, 1.11, 1.12)}
    assert decide == {0.25: "run", 0.80: "run", 0.81: "probe", 1.0: "probe", 1.11: "probe", 1.12: "stop"}
    g = Judge(16 * 2**30, simulated=True)
    g.set_trl("fused", untested=True)
    assert g.verdict(est).decision == "probe"  # a TRL newer than tested: never sure, whatever the size


def test_a_family_measured_on_cpu_only_is_never_sure_on_a_gpu():
    """Review 3.4: a mixture-of-experts model (likewise a vision-language model, DeepSeek's latent attention) far
    under a real card is probed first, saying why; on the simulated device, where it was measured, it may skip its
    probe, and a dense model of the same size skips it on the card."""
    moe = load_model_spec(MODELS / "qwen3-30b-a3b")
    k = TRL_DEFAULTS.replace(dtype="bfloat16", lora_r=16, max_completion_length=64)
    card = make_plan(moe, k, 1024 * 2**30)
    assert card.verdict.decision == "probe" and card.first == "probe"
    assert "not modelled: experts (MoE) on a GPU: their memory is measured on the simulated device only" in \
        card.verdict.line()
    assert make_plan(moe, k, 1024 * 2**30, simulated=True).first == RUN
    assert make_plan(load_model_spec(MODELS / "qwen2.5-7b-instruct"), k, 1024 * 2**30).first == RUN


def test_after_a_real_oom_or_with_a_change_to_the_experiment_every_config_is_probed():
    c = Climb(load_ladder("default"))
    assert c.probe_may_be_skipped()
    c.record(Attempt(index=1, knobs=TRL_DEFAULTS.to_dict(), remedies=[], outcome="predicted", exit_code=87,
                     seconds=1.0, kind="probe"))
    assert c.probe_may_be_skipped()  # a pre-flight stop is no OOM: the model was not wrong
    c.record(Attempt(index=2, knobs=TRL_DEFAULTS.to_dict(), remedies=[], outcome="oom", exit_code=86, seconds=1.0,
                     kind="probe"))
    assert not c.probe_may_be_skipped()


def test_plan_says_what_run_does_first():
    spec = ModelSpec.from_config(TINY)
    assert make_plan(spec, TRL_DEFAULTS.replace(max_completion_length=32), 16 * 2**30).launches()["first"] == "run"
    # 800 MiB of each card is the CUDA context: the step's 470 MiB is stopped, and a smaller micro-batch is probed
    tight = make_plan(spec, TRL_DEFAULTS, 1100 * MIB)
    assert tight.launches() == {"first": "stop", "then": "probe"} and tight.suggest["per_device_train_batch_size"] == 2
    # where no config is predicted within the device, the choice is one the pre-flight lets run (within its stop
    # margin), probed, never a config the pre-flight would stop again (no chain of stops)
    tighter = make_plan(spec, TRL_DEFAULTS, 900 * MIB)
    assert tighter.launches() == {"first": "stop", "then": "probe"}
    assert tighter.after_verdict.predicted > tighter.capacity and tighter.after_verdict.decision == "probe"


def test_the_decision_event_parses():
    ev = parse_event(json.loads('{"event": "probe_decision", "decided": "run", "predicted_bytes": 5, "limit": 9, '
                                '"capacity": 10, "why": "sure"}'))
    assert ev == ProbeDecided("run", 5, 10, 9, "sure")
