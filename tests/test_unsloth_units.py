"""Unsloth without Unsloth: its CPU LM head in the memory model (against rows measured under Unsloth), the trainer
patch following a class bound to ``trl.GRPOTrainer``, the loader's knobs, the values a stack resolves after the
script set them, the notebook's own loader and LoRA read where it passes them (a stand-in ``FastLanguageModel``), and
a loader error under oomguard's override taken back. (The end-to-end runs in Unsloth's own environment are
tests/test_unsloth.py.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.child import load, patches, trainer
from oomguard.child.runtime import Runtime
from oomguard.child.stacks import unsloth
from oomguard.decide.climb import Climb
from oomguard.decide.ladder import load_ladder
from oomguard.memory.estimate import SIMULATED_HEAD_ERROR, Coefficients, ModelSpec, estimate
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.events import parse_event
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.protocol import Plan
from oomguard.vocab.stacks.unsloth import LOADER

ROOT = Path(__file__).resolve().parent.parent
ROWS = json.loads((ROOT / "tests" / "fixtures" / "stacks" / "cpu-rows-unsloth.json").read_text())
QWEN = ModelSpec(16384, 256, 4, 8, 2, 32, 1024, True, qkv_bias=True, model_type="qwen2")
LORA = TRL_DEFAULTS.replace(lora_r=8, bf16=False, per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=64)


def _predict(row: dict):
    sys.path.insert(0, str(ROOT / "bench"))
    from cpu_calibrate import Config, predict

    return predict(Config(**row["config"]), Coefficients.for_simulated(), row["trl_head"])


@pytest.mark.parametrize("row", ROWS, ids=[r["config"]["name"] for r in ROWS])
def test_unsloth_s_cpu_backend_is_predicted_within_its_measured_error(row):
    """``python bench/cpu_calibrate.py --stack unsloth --python .venv-unsloth/bin/python --json ...``: real GRPO steps
    as an Unsloth notebook builds them (its loader, its LoRA and checkpointing, its CPU LM head), on the simulated
    device. The largest error over these rows is the pre-flight's margin for that head."""
    assert row["trl_head"] == "rowchunk" and row["bf16"] is False
    err = (_predict(row).peak_alloc_bytes - row["peak"]) / row["peak"]
    over, under = SIMULATED_HEAD_ERROR["rowchunk"]
    assert -under <= err <= over, (row["config"]["name"], err)


def test_the_rowchunk_error_is_the_rows_figure():
    errs = [(_predict(r).peak_alloc_bytes - r["peak"]) / r["peak"] for r in ROWS]
    over, under = max(0.0, *errs), max(0.0, *(-e for e in errs))
    assert SIMULATED_HEAD_ERROR["rowchunk"] == (math.ceil(1000 * over) / 1000, math.ceil(1000 * under) / 1000)


def test_unsloth_s_head_holds_a_row_chunk_not_trl_s_fallback_buffers():
    """The issue's 4.5x: TRL's CPU fallback head counted for a run whose head Unsloth replaced."""
    ours = estimate(QWEN, LORA, prompt_tokens=72, simulated=True, head="rowchunk")
    trl = estimate(QWEN, LORA, prompt_tokens=72, simulated=True, head="fused")
    assert ours.peak_alloc_bytes * 4 < trl.peak_alloc_bytes
    assert ours.dominant_phase == "forward_backward"


@settings(max_examples=60, deadline=None)
@given(c=st.integers(8, 512), b=st.sampled_from([1, 2, 4, 8]), v=st.sampled_from([2048, 16384, 40000, 151936]))
def test_rowchunk_grows_with_the_completion_and_never_with_less(c, b, v):
    spec = ModelSpec(v, 256, 4, 8, 2, 32, 1024, True)
    k = LORA.replace(per_device_train_batch_size=b, num_generations=b, max_completion_length=c)
    small = estimate(spec, k, prompt_tokens=32, simulated=True, head="rowchunk").peak_alloc_bytes
    large = estimate(spec, k.replace(max_completion_length=c + 16), prompt_tokens=32, simulated=True,
                     head="rowchunk").peak_alloc_bytes
    assert large >= small


def test_the_pre_flight_uses_the_rowchunk_margin_and_the_untested_one_for_unsloth_s_trainer():
    """The training process's verdict (child/preflight.judged) stops a config by the error of the head its facts name,
    and Unsloth's generated trainer (``stack_untested``) only beyond the untested factor."""
    from oomguard.decide.judge import Judge
    from oomguard.memory.estimate import doubts_of, measured_error, verdict
    from oomguard.vocab.knobs import RunFacts

    js = Judge(256 * 2**20, simulated=True).judge_spec()
    est = estimate(ModelSpec(724, 256, 4, 8, 2, 32, 1024, True), LORA, prompt_tokens=32, simulated=True,
                   head="rowchunk")

    def margin(**facts):
        f = RunFacts(trl_version="1.15.0", stack="unsloth", **facts)
        return verdict(est, js, head=f.trl_head, doubts=doubts_of(None, f, simulated=True)).stop_margin

    assert margin(trl_head="rowchunk") == pytest.approx(measured_error(simulated=True, head="rowchunk").over + 0.02)
    assert margin(trl_head="fused", stack_untested="x") == pytest.approx(2.02)


# ---------------------------------------------------------------------------------------------------------------
# The trainer patch follows the name


def test_a_class_bound_to_trl_s_grpotrainer_later_is_patched_when_it_is_bound():
    """Unsloth binds a generated copy of TRL's trainer (not a subclass) to ``trl.GRPOTrainer``, ``trl.trainer`` and
    ``trl.trainer.grpo_trainer``; the script builds whatever the name holds."""
    import trl
    import trl.trainer.grpo_trainer as grpo_trainer

    pristine = grpo_trainer.GRPOTrainer
    rt = Runtime(Plan())
    try:
        patches.patch_grpo_trainer(rt, grpo_trainer)

        class UnslothGRPOTrainer:  # not a subclass, like the generated one
            def __init__(self, model, reward_funcs=None, args=None):
                self.model = model

        trl.GRPOTrainer = UnslothGRPOTrainer
        assert getattr(UnslothGRPOTrainer.__init__, "_oomguard", False)
        grpo_trainer.GRPOTrainer = UnslothGRPOTrainer  # bound again under another name: patched once
        assert UnslothGRPOTrainer.__init__.__wrapped__.__qualname__.endswith("UnslothGRPOTrainer.__init__")
    finally:
        patches.remove()
        trl.GRPOTrainer = grpo_trainer.GRPOTrainer = pristine
    assert not getattr(type(trl), "_oomguard_watch", False)  # the modules' own classes back
    assert not getattr(pristine.__init__, "_oomguard", False)


def test_unsloth_s_generated_trainer_is_judged_as_unmeasured_and_its_cpu_head_as_rowchunk(monkeypatch):
    class UnslothGRPOTrainer:
        model = None

    class Dispatch:
        _unsloth_cpu_dispatch = True

    monkeypatch.setitem(sys.modules, "trl.trainer.utils", SimpleNamespace(_ChunkedLogProbFunction=Dispatch))
    assert unsloth.facts(UnslothGRPOTrainer())["stack_untested"]
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    assert unsloth.facts(trainer)["trl_head"] == "rowchunk" and "stack_untested" not in unsloth.facts(trainer)
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", SimpleNamespace(_ChunkedLogProbFunction=object))
    assert "trl_head" not in unsloth.facts(trainer)  # no routing: TRL's own head


# ---------------------------------------------------------------------------------------------------------------
# The loader's knobs


def test_fast_inference_is_a_colocated_vllm_and_its_knobs_are_set_where_unsloth_reads_them():
    rt = Runtime(Plan(overrides={"vllm_gpu_memory_utilization": 0.45, "vllm_max_model_length": 512, "lora_r": 32}))
    kwargs = {"fast_inference": True, "gpu_memory_utilization": 0.6, "max_seq_length": 1024, "max_lora_rank": 16}
    assert unsloth.observed_loader(kwargs)["vllm_gpu_memory_utilization"] == 0.6
    unsloth.apply_loader(rt, kwargs)
    assert kwargs == {"fast_inference": True, "gpu_memory_utilization": 0.45, "max_seq_length": 512,
                      "max_lora_rank": 32}


def test_a_4bit_rung_is_unsloth_s_own_load_in_4bit_and_never_a_full_fine_tune():
    rt = Runtime(Plan(overrides={"load_in_4bit": True}))
    kwargs = {"full_finetuning": True, "load_in_4bit": False}
    unsloth.apply_loader(rt, kwargs)
    assert kwargs["load_in_4bit"] is True and kwargs["full_finetuning"] is False


def test_the_4bit_rung_reaches_a_script_whose_loader_quantises_before_its_own_lora():
    rung = make_remedy("load_4bit")
    facts = RunFacts(model_source="from_pretrained", user_peft=True)
    knobs = TRL_DEFAULTS.replace(lora_r=8)
    assert rung.blocked(Context(knobs=knobs, facts=facts)) is not None
    assert rung.blocked(Context(knobs=knobs, facts=facts.replace(load_takes_4bit=True))) is None


# ---------------------------------------------------------------------------------------------------------------
# What the stack resolves


def test_a_value_the_stack_resolved_replaces_the_observed_one_unless_oomguard_set_it():
    rt = Runtime(Plan(overrides={"fp16": True}))
    rt.observe({"bf16": None, "fp16": False})
    assert rt.resolve({"bf16": False, "fp16": False}) == {"bf16": False}
    assert rt.knobs().bf16 is False and rt.knobs().fp16 is True

    ev = parse_event({"event": "facts", "facts": {}, "resolved": {"bf16": False}})
    c = Climb(load_ladder("default"))
    c.observe({"bf16": True, "lora_r": 8})
    c.resolve(ev.resolved)
    assert c.original().bf16 is False and c.original().lora_r == 8


def test_a_model_with_checkpointing_on_already_trains_with_it_whatever_the_config_says():
    rt = Runtime(Plan())
    rt.observe({"gradient_checkpointing": False})
    model = SimpleNamespace(is_gradient_checkpointing=True, dtype=None, peft_config={"default": SimpleNamespace(
        r=8, lora_alpha=16, target_modules={"q_proj", "v_proj"})})
    args = SimpleNamespace(model_init_kwargs=None)
    module = SimpleNamespace(GRPOConfig=None)
    trainer.prepare_trainer_args(rt, {"model": model, "args": args}, module)
    assert rt.knobs().gradient_checkpointing is True and rt.resolved == {"gradient_checkpointing": True}
    assert (rt.knobs().lora_r, rt.knobs().lora_target_modules) == (8, ("q_proj", "v_proj"))


# ---------------------------------------------------------------------------------------------------------------
# The simulated device and a 4-bit load


def test_a_4bit_weight_s_quantisation_state_is_on_the_device():
    import torch

    absmax, nested = torch.zeros(100), torch.zeros(10)
    qs = SimpleNamespace(absmax=absmax, code=None, state2=SimpleNamespace(absmax=nested, code=None, state2=None))
    layer = torch.nn.Linear(2, 2)
    layer.weight.quant_state = qs
    got = load.device_tensors(layer)
    assert any(t is absmax for t in got) and any(t is nested for t in got)


def test_a_4bit_notebook_on_a_gpu_is_predicted_with_the_dtype_unsloth_loaded_it_in():
    """On a GPU Unsloth loads a 4-bit model's other modules in bfloat16 (dtype=None): read from the model, so the
    model does not count them in float32 because Unsloth's loader keeps the dtype it is given."""
    import torch

    seen = unsloth.observed_model(SimpleNamespace(is_loaded_in_4bit=True, dtype=torch.bfloat16))
    knobs = LORA.replace(**seen)
    gpu = estimate(QWEN, knobs, prompt_tokens=32, keeps_dtype_4bit=True)
    as_fp32 = estimate(QWEN, knobs.replace(dtype="float32"), prompt_tokens=32, keeps_dtype_4bit=True)
    assert seen == {"load_in_4bit": True, "dtype": "bfloat16"}
    assert gpu.breakdown["weights"] < as_fp32.breakdown["weights"]


# ---------------------------------------------------------------------------------------------------------------
# The notebook's own config, observed where Unsloth takes it (issue 49)


def _notebook_loader(rt: Runtime, *, fail: BaseException | None = None):
    """A stand-in for Unsloth's ``FastLanguageModel``, with its signature's defaults, patched as ``import unsloth``
    patches it. Its loader stands in for the load ``from_pretrained`` does inside it: the load patch observes the
    dtype Unsloth passes on (its default for the device), then ``fail`` is raised where given (a pre-flight stop, an
    error of the loader's own)."""

    class FastLanguageModel:
        given: ClassVar[dict] = {}

        @staticmethod
        def from_pretrained(model_name="unsloth/Llama-3.2-1B-Instruct", max_seq_length=2048, dtype=None,
                            load_in_4bit=True, load_in_8bit=False, load_in_16bit=False, full_finetuning=False,
                            fast_inference=False, gpu_memory_utilization=0.5, max_lora_rank=64, **kwargs):
            FastLanguageModel.given = dict(locals())
            if rt.loader is None or rt.overrides.dtype is None:
                rt.observe({"dtype": "bfloat16"})  # what child/load.py observes, as Unsloth resolved dtype=None
            if fail is not None:
                if isinstance(fail, SystemExit):  # the pre-flight's stop: the process ends itself
                    rt.end("predicted")
                raise fail
            return SimpleNamespace(is_loaded_in_4bit=bool(load_in_4bit), dtype=None), "tokenizer"

        @staticmethod
        def get_peft_model(model, r=16, target_modules=("q_proj", "v_proj"), lora_alpha=16, lora_dropout=0.0,
                           use_gradient_checkpointing="unsloth", random_state=3407, **kwargs):
            FastLanguageModel.given = dict(locals())
            return model

    unsloth.patch_unsloth(rt, SimpleNamespace(FastLanguageModel=FastLanguageModel))
    return FastLanguageModel


def _events_runtime(tmp_path: Path, **overrides) -> Runtime:
    return Runtime(Plan(attempt=1, overrides=overrides, events=str(tmp_path / "events.jsonl"),
                        crash_dir=str(tmp_path)))


def test_a_load_stopped_inside_unsloth_s_loader_keeps_what_the_notebook_set_and_claims_nothing_else(tmp_path):
    """Issue 49: the pre-flight stopped the notebook's load, and the report's ``original`` said TRL's defaults for
    what the notebook sets later (LoRA r=0, 8 generations, 512 tokens, 8 rows). The loader's own arguments are read
    before it loads, and what the notebook never reached is reported as not seen, not as TRL's defaults."""
    from oomguard.decide.conductor import Conductor, Policy
    from oomguard.run.learning import take_events
    from oomguard.vocab.events import read_events

    rt = _events_runtime(tmp_path)
    loader = _notebook_loader(rt, fail=SystemExit(75))
    try:
        with pytest.raises(SystemExit):
            loader.from_pretrained("model", max_seq_length=256, load_in_4bit=False, fast_inference=False)
    finally:
        patches.remove()
    con = Conductor(Climb(load_ladder("default")), None, Policy(), launched=True)
    take_events(con, read_events(tmp_path / "events.jsonl"), sized_by_nvml=False, say=print, warn=print)
    report = con.climb.report("exhausted", "", 1)
    assert (report.original["load_in_4bit"], report.original["dtype"]) == (False, "bfloat16")
    unseen = {"lora_r", "num_generations", "max_completion_length", "per_device_train_batch_size"}
    assert {k: report.original[k] for k in unseen} == dict.fromkeys(unseen) and unseen <= set(report.unseen)
    assert "load_in_4bit" not in report.unseen and "dtype" not in report.unseen
    # a later attempt that gets further fills them in, and the report no longer calls them unknown
    con.climb.observe({"num_generations": 4, "max_completion_length": 32, "per_device_train_batch_size": 4},
                      point="config")
    con.climb.observe({"lora_r": 8}, point="trainer")
    report = con.climb.report("stable", "", 0)
    assert (report.original["num_generations"], report.original["lora_r"]) == (4, 8) and not report.unseen


def test_the_notebook_s_lora_is_observed_at_get_peft_model_and_never_replaced(tmp_path):
    """A rung chose LoRA r=16 while the notebook's LoRA was not known yet (its load was stopped before get_peft_model):
    the notebook's r=8 is what get_peft_model gets, what the process reports it runs, and what the supervisor hears."""
    from oomguard.vocab.events import CodeSeen, read_events

    rt = _events_runtime(tmp_path, lora_r=16, lora_alpha=32, lora_target_modules="all-linear")
    loader = _notebook_loader(rt)
    try:
        model, _tok = loader.from_pretrained("model", load_in_4bit=False)
        loader.get_peft_model(model, r=8, lora_alpha=8, target_modules=["v_proj", "q_proj"], lora_dropout=0.05)
    finally:
        patches.remove()
    assert (loader.given["r"], loader.given["lora_alpha"]) == (8, 8)  # untouched
    mine = {"lora_r": 8, "lora_alpha": 8, "lora_target_modules": ("q_proj", "v_proj")}
    assert {k: rt.observed[k] for k in mine} == mine and rt.observed["gradient_checkpointing"] is True
    ran = rt.ran()  # what the process says it runs (child/ran.py)
    assert (ran.lora_r, ran.lora_alpha, ran.lora_target_modules) == (8, 8, ("q_proj", "v_proj"))
    said = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, CodeSeen) and "lora_r" in e.observed]
    assert said and said[0].observed["lora_r"] == 8
    assert said[0].facts["lora_dropout"] == 0.05  # its dropout, for the memory model (Unsloth's default is 0)


def test_a_4bit_rung_adds_no_lora_before_the_notebook_s_own_could_be_seen():
    """A LoRA rung applies only to a full fine-tune: before the notebook reached its trainer, Unsloth's loader is
    preparing the model for the LoRA the notebook adds after it, so the 4-bit rung adds none; once the trainer shows
    a full fine-tune it does, and the notebook's own rank is never replaced."""
    rung = make_remedy("load_4bit")
    before = RunFacts(load_takes_4bit=True)
    after = before.replace(model_source="from_pretrained")
    assert rung.apply(Context(knobs=TRL_DEFAULTS, facts=before)).lora_r == 0
    assert rung.apply(Context(knobs=TRL_DEFAULTS, facts=after)).lora_r == 16
    assert rung.apply(Context(knobs=TRL_DEFAULTS.replace(lora_r=8), facts=after)).lora_r == 8
    assert rung.describe_change(TRL_DEFAULTS, TRL_DEFAULTS.replace(load_in_4bit=True)) == "a 4-bit base model"


# ---------------------------------------------------------------------------------------------------------------
# A rung that breaks the loader is taken back (issue 49)


def test_an_error_of_unsloth_s_loader_under_oomguard_s_4bit_load_is_oomguard_s(tmp_path):
    """The 4-bit load oomguard asked of Unsloth's loader failed inside it: reported as an error of oomguard's
    override (named by the knob the loader took), so the supervisor takes the rung back instead of passing the
    failure through as the notebook's. An override the loader does not take is not blamed."""
    from oomguard.vocab.events import OverrideFailed, read_events

    err = ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
    for overrides, blamed in (({"load_in_4bit": True, "per_device_train_batch_size": 1}, ("load_in_4bit",)),
                              ({"per_device_train_batch_size": 1}, None)):
        events = tmp_path / f"{bool(blamed)}"
        events.mkdir()
        rt = _events_runtime(events, **overrides)
        loader = _notebook_loader(rt, fail=err)
        try:
            with pytest.raises(ValueError):
                loader.from_pretrained("model", load_in_4bit=False)
        finally:
            patches.remove()
        failed = [e for e in read_events(events / "events.jsonl") if isinstance(e, OverrideFailed)]
        if blamed is None:
            assert failed == []
        else:
            assert [(e.where, e.overrides) for e in failed] == [(f"Unsloth's {LOADER}", blamed)]
            assert loader.given["load_in_4bit"] is True and loader.given["full_finetuning"] is False
        assert rt.loader is None


def test_where_unsloth_cannot_load_4bit_weights_the_rung_is_not_offered(monkeypatch):
    """On a machine without CUDA, Unsloth's CPU backend loads 16-bit weights where bitsandbytes' CPU 4-bit does not run
    (its own check): the adapter says so when Unsloth is imported, and the 4-bit rung is not offered there."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    works = SimpleNamespace(cpu_bnb_4bit_supported=lambda: True)
    for name, mod in (("unsloth_zoo", SimpleNamespace()), ("unsloth_zoo.cpu", SimpleNamespace()),
                      ("unsloth_zoo.cpu.runtime", works)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert unsloth.cannot_load_4bit() is None and "cannot_load_4bit" not in unsloth.loader_facts()
    works.cpu_bnb_4bit_supported = lambda: False
    why = unsloth.cannot_load_4bit()
    assert why and unsloth.loader_facts()["cannot_load_4bit"] == why
    facts = RunFacts(load_takes_4bit=True, cannot_load_4bit=why)
    assert make_remedy("load_4bit").blocked(Context(knobs=TRL_DEFAULTS, facts=facts)) == why


def test_on_unsloth_s_cpu_backend_no_8bit_optimizer_and_under_the_simulated_device_no_4bit_load_is_offered(monkeypatch):
    """Unsloth's CPU backend turns adamw_bnb_8bit into torch's AdamW when the config is built, so the 8-bit optimizer
    rung would launch the same run again (issue 49: a second real OOM); its CPU 4-bit load, which runs on this CPU,
    fails on the simulated device inside the loader. Neither is offered there; on a GPU both are."""
    import torch

    from oomguard.child import simulate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, mod in (("unsloth_zoo", SimpleNamespace()), ("unsloth_zoo.cpu", SimpleNamespace()),
                      ("unsloth_zoo.cpu.runtime", SimpleNamespace(cpu_bnb_4bit_supported=lambda: True)),
                      ("unsloth_zoo.cpu.trainer", SimpleNamespace(normalize_cpu_training_arguments=None))):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(simulate, "device", lambda: None)
    said = unsloth.loader_facts()
    assert "cannot_load_4bit" not in said and said["cannot_optim_8bit"] == unsloth.cannot_optim_8bit()
    facts = RunFacts(**said)
    ctx = Context(knobs=TRL_DEFAULTS, facts=facts)
    assert make_remedy("optimizer_8bit").blocked(ctx) == said["cannot_optim_8bit"]
    monkeypatch.setattr(simulate, "device", lambda: object())
    assert unsloth.loader_facts()["cannot_load_4bit"] == unsloth.cannot_load_4bit() != unsloth.CPU_NO_4BIT
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not {"cannot_load_4bit", "cannot_optim_8bit"} & set(unsloth.loader_facts())


def test_only_the_rung_that_set_what_broke_the_loader_is_taken_back_and_a_run_left_with_none_is_exhausted():
    """The loader named the override it could not take (load_in_4bit): the 4-bit rung is taken back, the micro-batch
    split chosen with it stays. Where nothing is left to climb, the run ends exhausted, not as the script's failure
    passed through."""
    from oomguard.decide.choose import Rung
    from oomguard.decide.conductor import Conductor, Policy
    from oomguard.run.verdict import conclude
    from oomguard.vocab.records import Attempt, AttemptKind, Outcome

    climb = Climb(load_ladder("default"))
    climb.climbed = climb.applied = [Rung(make_remedy("micro_batch")), Rung(make_remedy("load_4bit"))]
    con = Conductor(climb, None, Policy(), launched=True)
    con.newly = ["micro_batch", "load_4bit"]
    broke = Attempt(index=2, knobs=climb.effective()[0].to_dict(), remedies=[], outcome=Outcome.FAILED, exit_code=1,
                    seconds=1.0, kind=AttemptKind.PROBE,
                    override_error={"where": f"Unsloth's {LOADER}", "error": "ValueError: no",
                                    "overrides": ["load_in_4bit"]})
    con.record(broke, None)
    con.after(broke, None)
    assert "load_4bit" in climb.refused and "micro_batch" not in climb.refused
    assert "micro_batch" in climb.remedies_in_force() and "load_4bit" not in climb.remedies_in_force()
    climb.give_up("ladder", "no rung left that can help")
    status, _code, message = conclude(broke, climb)
    assert status == "exhausted" and "took back load_4bit" in message and "passed through" not in message
