"""ms-swift without ms-swift: how its arguments are read and set, the flags the end speaks, and its offload while a
colocated vLLM generates (a rung, and what the memory model counts). The real runs are tests/test_swift.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.child.runtime import Runtime
from oomguard.child.stacks import swift
from oomguard.memory.estimate import ModelSpec, estimate
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.events import ConfigGenerated, OverrideFailed, read_events
from oomguard.vocab.knobs import TRL_DEFAULTS, RunFacts
from oomguard.vocab.protocol import Plan
from oomguard.vocab.stacks import flags

MiB, GiB = 2**20, 2**30
TINY = ModelSpec(724, 256, 1, 8, 2, 32, 1024, True, max_positions=2048)
VLLM = TRL_DEFAULTS.replace(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                            vllm_max_model_length=64, num_generations=4, max_completion_length=32,
                            per_device_train_batch_size=4)
RUNG = make_remedy("vllm_memory")
SWIFT_LACKS = tuple(swift.lacks(["offload_during_generation"]))


def swift_args(**kw):
    base = dict(tuner_type="lora", lora_rank=8, lora_alpha=32.0, target_modules=["all-linear"], quant_method=None,
                quant_bits=None, torch_dtype=None, deepspeed=None, vllm_max_model_len=None, sleep_level=0,
                offload_model=False, offload_optimizer=False, output_dir="out", save_strategy="steps",
                add_version=True, use_cpu=False)
    base.update(kw)
    return SimpleNamespace(**base)


def runtime(**overrides):
    return Runtime(Plan(overrides=overrides))


def test_swift_s_default_lora_is_read_as_the_user_s_own():
    seen = swift.observed_model_args(swift_args())
    assert seen["lora_r"] == 8 and seen["load_in_4bit"] is False and seen["lora_target_modules"] == "all-linear"
    assert swift.observed_model_args(swift_args(tuner_type="full"))["lora_r"] == 0
    assert swift.observed_model_args(swift_args(quant_method="bnb", quant_bits=4))["load_in_4bit"] is True


def test_the_knobs_are_set_as_swift_reads_them():
    args = swift_args(tuner_type="full")
    swift.apply_model_args(runtime(lora_r=16, load_in_4bit=True, zero_stage=3, offload_optimizer=True,
                                   offload_params=True, vllm_max_model_length=512, vllm_enable_sleep_mode=True,
                                   offload_during_generation=True), args)
    assert (args.tuner_type, args.lora_rank, args.quant_method, args.quant_bits) == ("lora", 16, "bnb", 4)
    assert args.deepspeed == "zero3_offload" and args.vllm_max_model_len == 512 and args.sleep_level == 1
    assert args.offload_model is True and args.offload_optimizer is True


# swift's own zero3 preset (swift/config/zero3.json), in part: what the generated config must keep
ZERO3 = {"bf16": {"enabled": "auto"}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
                               "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": False,
                               "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9}}


def test_zero3_with_only_the_optimizer_offloaded_is_swift_s_zero3_preset_with_that_offload(tmp_path, monkeypatch):
    """swift's zero3_offload preset would put the parameters in host RAM too: swift is given a path instead, to its
    zero3 preset with exactly the optimizer offloaded, and the supervisor is told (the report's diff names it)."""
    monkeypatch.setattr(swift, "swift_preset", lambda name: json.loads(json.dumps(ZERO3)) if name == "zero3" else None)
    rt = Runtime(Plan(attempt=2, overrides={"zero_stage": 3, "offload_optimizer": True}, crash_dir=str(tmp_path),
                      events=str(tmp_path / "events.jsonl")))
    args = swift_args(tuner_type="full", deepspeed="zero2")
    swift.apply_model_args(rt, args)
    assert args.deepspeed == str(tmp_path / "deepspeed-attempt2.json")
    cfg = json.loads(Path(args.deepspeed).read_text())
    zero = cfg.pop("zero_optimization")
    assert zero.pop("offload_optimizer") == {"device": "cpu", "pin_memory": True} and "offload_param" not in zero
    assert zero == {k: v for k, v in ZERO3["zero_optimization"].items() if not k.startswith("offload")} | {
        "stage3_gather_16bit_weights_on_model_save": True}
    assert cfg == {k: v for k, v in ZERO3.items() if k != "zero_optimization"}  # the rest as swift's preset
    generated = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, ConfigGenerated)]
    assert [(e.kind, e.path, e.replaces) for e in generated] == [("deepspeed", args.deepspeed, "zero2")]


def test_a_user_s_half_offload_is_not_the_knob_and_nothing_is_turned_off():
    assert swift.observed_offload(swift_args(offload_model=True)) == {"offload_during_generation": False}
    assert swift.observed_offload(swift_args(offload_model=True, offload_optimizer=True)) == {
        "offload_during_generation": True}
    args = swift_args(offload_model=True)
    swift.apply_offload(runtime(), args)
    assert args.offload_model is True and args.offload_optimizer is False


def test_the_diff_speaks_swift_s_flags():
    assert flags("swift", {"offload_during_generation": True, "vllm_enable_sleep_mode": True,
                           "vllm_max_model_length": 512, "zero_stage": 3}) == [
        "--offload_model true --offload_optimizer true", "--sleep_level 1", "--vllm_max_model_len 512",
        "--deepspeed zero3"]


def test_swift_takes_the_offload_that_trl_lacks_and_drops_what_it_cannot_take():
    assert "offload_during_generation" not in SWIFT_LACKS and "max_prompt_tokens" in SWIFT_LACKS


def test_at_the_reservation_s_floor_the_offload_comes_where_the_stack_takes_it():
    facts = dict(prompt_tokens_max=20, vllm_sleep=False, stack="swift")
    at_floor = Context(knobs=VLLM, facts=RunFacts(trl_lacks=SWIFT_LACKS, **facts))
    assert RUNG.apply(at_floor).offload_during_generation is True
    assert RUNG.blocked(at_floor) is None
    # plain TRL lacks it: the rung is at its floor; before the process reported, nothing is assumed
    trl = Context(knobs=VLLM, facts=RunFacts(trl_lacks=("offload_during_generation",), **facts))
    assert RUNG.blocked(trl).startswith("at its floor")
    assert RUNG.apply(Context(knobs=VLLM, facts=RunFacts(**facts))).offload_during_generation is False
    # sleep first where the platform has it
    sleepy = Context(knobs=VLLM, facts=RunFacts(trl_lacks=SWIFT_LACKS, **{**facts, "vllm_sleep": True}))
    assert RUNG.apply(sleepy).vllm_enable_sleep_mode is True and not RUNG.apply(sleepy).offload_during_generation
    done = VLLM.replace(offload_during_generation=True)
    assert RUNG.blocked(Context(knobs=done, facts=RunFacts(trl_lacks=SWIFT_LACKS, **facts))).startswith("at its floor")
    assert "host RAM" in RUNG.describe_change(VLLM, done)


def test_the_offload_takes_the_trainer_s_state_out_of_the_generation_phase_only():
    on, off = (estimate(TINY, VLLM.replace(offload_during_generation=v), prompt_tokens=20, simulated=True,
                        capacity=GiB) for v in (True, False))
    assert on.phases["generation"] < off.phases["generation"]
    assert {k: v for k, v in on.phases.items() if k != "generation"} == {
        k: v for k, v in off.phases.items() if k != "generation"}
    # without a colocated vLLM there is nothing to offload for
    plain = TRL_DEFAULTS.replace(num_generations=4, max_completion_length=32, per_device_train_batch_size=4)
    assert (estimate(TINY, plain.replace(offload_during_generation=True), prompt_tokens=20, simulated=True).phases
            == estimate(TINY, plain, prompt_tokens=20, simulated=True).phases)


# ---------------------------------------------------------------------------------------------------------------
# What swift takes, observed before anything loads; its loader's errors under oomguard's overrides (issue 49)


def test_swift_s_flags_are_known_before_its_load_and_only_what_it_never_reached_is_unknown(tmp_path):
    """``swift rlhf`` reads its LoRA, quantisation and dtype flags into RLHFArguments before it loads the model: a
    pre-flight stop of the load leaves the report with swift's own LoRA (r=8, alpha 32, all-linear), not TRL's
    full fine-tune; what swift never reached is not claimed as TRL's default."""
    from oomguard.child import patches
    from oomguard.decide.climb import Climb
    from oomguard.decide.conductor import Conductor, Policy
    from oomguard.decide.ladder import load_ladder
    from oomguard.run.learning import take_events

    class RLHFArguments(SimpleNamespace):
        def __post_init__(self):
            pass

    rt = Runtime(Plan(attempt=1, events=str(tmp_path / "events.jsonl"), crash_dir=str(tmp_path)))
    swift.patch_arguments(rt, SimpleNamespace(RLHFArguments=RLHFArguments))
    try:
        RLHFArguments(**vars(swift_args(torch_dtype="float32", padding_free=False))).__post_init__()
    finally:
        patches.remove()
    rt.end("predicted")  # the pre-flight stopped the load
    con = Conductor(Climb(load_ladder("default")), None, Policy(), launched=True)
    take_events(con, read_events(tmp_path / "events.jsonl"), sized_by_nvml=False, say=print, warn=print)
    report = con.climb.report("exhausted", "", 1)
    lora = {"lora_r": 8, "lora_alpha": 32, "lora_target_modules": "all-linear", "load_in_4bit": False,
            "dtype": "float32"}
    assert {k: report.original[k] for k in lora} == lora and not set(lora) & set(report.unseen)
    assert report.original["num_generations"] is None and "num_generations" in report.unseen


def test_an_error_of_the_load_under_oomguard_s_dtype_is_oomguard_s(tmp_path):
    """swift (and a script's own ``from_pretrained``) loads through transformers' ``from_pretrained``, where oomguard
    sets the dtype and 4-bit load: an error raised there while one of them is in force is reported as oomguard's
    override (so the rung is taken back), and one raised without them is the script's."""
    from oomguard.child import patches
    from oomguard.child.load import patch_from_pretrained

    class PreTrainedModel:
        @classmethod
        def from_pretrained(cls, name, **kwargs):
            raise ValueError(f"{kwargs.get('dtype')} is refused by this model")

    class TinyForCausalLM(PreTrainedModel):
        pass

    for overrides, blamed in (({"dtype": "bfloat16", "num_generations": 4}, ("dtype",)), ({"num_generations": 4}, None)):
        where = tmp_path / str(bool(blamed))
        where.mkdir()
        rt = Runtime(Plan(attempt=2, overrides=overrides, events=str(where / "events.jsonl"), crash_dir=str(where)))
        patch_from_pretrained(rt, SimpleNamespace(PreTrainedModel=PreTrainedModel))
        try:
            with pytest.raises(ValueError):
                TinyForCausalLM.from_pretrained(str(where / "no-model"))
        finally:
            patches.remove()
        failed = [(e.where, e.overrides) for e in read_events(where / "events.jsonl") if isinstance(e, OverrideFailed)]
        assert failed == ([("from_pretrained", blamed)] if blamed else [])


def test_a_load_is_judged_as_the_simulated_device_places_its_weights():
    """Issue 49's wider Qwen2 (12.7M parameters) in float32, swift's load of a float32 checkpoint: 47.4 MiB of weights
    hold 52 MiB of the simulated device, in whole 20 MiB segments for its 1-10 MiB matrices, as the CUDA caching
    allocator places them. The pre-flight judges that, so a load that cannot fit half the run's peak (49 MiB) is
    stopped before it loads rather than running out while it loads."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oomguard.child.load import device_tensors
    from oomguard.child.simulate import SimulatedDevice
    from oomguard.memory.estimate import load_bytes

    cfg = Qwen2Config(vocab_size=722, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    spec = ModelSpec.from_config(cfg.to_dict())
    for dtype in (torch.float32, torch.bfloat16):
        dev = SimulatedDevice(64 * GiB)
        dev.adopt(device_tensors(model.to(dtype)))
        assert load_bytes(spec, TRL_DEFAULTS.replace(dtype=str(dtype).split(".")[1]), simulated=True) == \
            dev.model.reserved
    assert 47 * MiB < 4 * spec.params < 48 * MiB and dev.model.reserved == 26 * MiB
