"""Unsloth without Unsloth: its CPU LM head in the memory model (against rows measured under Unsloth), the trainer
patch following a class bound to ``trl.GRPOTrainer``, the loader's knobs, and the values a stack resolves after the
script set them. (The end-to-end runs in Unsloth's own environment are tests/test_unsloth.py.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

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
