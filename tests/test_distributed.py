"""The multi-gpu ladder and the DeepSpeed/FSDP settings it writes (DeepSpeed itself is not needed to test this)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomguard.child.config import apply_config, observe_config
from oomguard.child.runtime import Runtime
from oomguard.decide.ladder import Exhausted, load_ladder
from oomguard.oom.diagnose import diagnose
from oomguard.strategies import Context, make_remedy
from oomguard.vocab.distributed import deepspeed_config, ds_config_sizes, observe_deepspeed
from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs, RunFacts
from oomguard.vocab.oomreport import OOMReport
from oomguard.vocab.protocol import Plan

SHORT = diagnose(OOMReport("cuda", "allocator", "x", requested=4 << 30, capacity=80 << 30, free=1 << 30),
                 phase="forward")


def climb(facts, knobs=TRL_DEFAULTS):
    lad, used, names = load_ladder("multi-gpu"), {}, []
    while True:
        step = lad.next(Context(knobs=knobs, facts=facts, diagnosis=SHORT, used=dict(used)))
        if isinstance(step, Exhausted):
            return names, knobs
        names.append(step.remedy.name)
        used[step.remedy.name] = used.get(step.remedy.name, 0) + 1
        knobs = step.knobs


COSTLY = {"optimizer_8bit", "bf16_load", "lora", "load_4bit", "fewer_generations", "shorter_sequences"}


def test_several_ranks_shard_before_trading_quality():
    """One rung per OOM (--no-predict): ZeRO-2 first, and every sharding and offload rung (speed) before any change of
    precision, of what is trained or of what GRPO learns from."""
    names, knobs = climb(RunFacts(world_size=4))
    assert names[0] == "zero2"
    first_costly = min(names.index(n) for n in COSTLY if n in names)
    assert {"zero2", "zero3", "offload_optimizer", "offload_params"} <= set(names[:first_costly])
    assert knobs.zero_stage == 3 and knobs.offload_optimizer and knobs.offload_params
    assert "fsdp_offload" not in names


def test_one_rank_skips_sharding_and_fsdp_runs_take_fsdp_offload():
    assert "zero2" not in climb(RunFacts(world_size=1))[0]
    names, knobs = climb(RunFacts(world_size=2, fsdp=True))
    assert "zero2" not in names and knobs.fsdp_offload
    assert names.index("fsdp_offload") < min(names.index(n) for n in COSTLY if n in names)


def test_generated_config_keeps_the_users_settings():
    user = {"zero_optimization": {"stage": 2, "overlap_comm": True}, "train_micro_batch_size_per_gpu": "auto"}
    cfg = deepspeed_config(user, zero_stage=3, offload_optimizer=True)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["overlap_comm"] is True
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert user["zero_optimization"]["stage"] == 2  # the user's dict is not changed
    assert observe_deepspeed(cfg) == {"zero_stage": 3, "offload_optimizer": True, "offload_params": False,
                                      "overlap_comm": True}
    assert deepspeed_config(None, zero_stage=2)["train_micro_batch_size_per_gpu"] == "auto"


def test_the_child_writes_the_generated_config_and_points_grpo_config_at_it(tmp_path):
    user = tmp_path / "ds_zero2.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    events = tmp_path / "events.jsonl"
    zero3 = make_remedy("zero3").apply(Context(knobs=Knobs(zero_stage=2), facts=RunFacts(world_size=2)))
    overrides = {**zero3.to_dict(only_set=True), "offload_optimizer": True}
    rt = Runtime(Plan(attempt=3, overrides=overrides, crash_dir=str(tmp_path), events=str(events)))
    cfg = SimpleNamespace(deepspeed=str(user), fsdp="", per_device_train_batch_size=8, gradient_checkpointing=True,
                          save_strategy="no", save_steps=500)
    assert observe_config(cfg)["zero_stage"] == 2
    apply_config(rt, cfg)
    generated = json.loads((tmp_path / "deepspeed-attempt3.json").read_text())
    assert cfg.deepspeed == str(tmp_path / "deepspeed-attempt3.json")
    assert generated["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                              "stage3_gather_16bit_weights_on_model_save": True,
                                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                              "stage3_param_persistence_threshold": "auto"}
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    assert ev[0]["event"] == "generated" and ev[0]["replaces"] == str(user)


def test_fsdp_offload_is_added_to_the_users_fsdp_options(tmp_path):
    rt = Runtime(Plan(overrides={"fsdp_offload": True}))
    cfg = SimpleNamespace(deepspeed=None, fsdp="full_shard auto_wrap", save_strategy="no", save_steps=500)
    apply_config(rt, cfg)
    assert cfg.fsdp == "full_shard auto_wrap offload"


def test_the_zero_rungs_size_deepspeeds_buffers_from_the_model_unless_the_user_did():
    """DeepSpeed's own default bucket (5e8 elements) is a 1.9 GiB float32 buffer on every rank: a ZeRO rung leaves
    the sizes it writes to transformers ("auto": from the model's hidden size); a size the user set stays."""
    ctx = Context(knobs=Knobs(), facts=RunFacts(world_size=2))
    k3 = make_remedy("zero3").apply(ctx)
    assert k3.reduce_bucket_size == k3.stage3_prefetch_bucket_size == k3.stage3_param_persistence_threshold == "auto"
    zero = deepspeed_config(None, zero_stage=3, sizes=ds_config_sizes(k3))["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == "auto"
    mine = Knobs(zero_stage=1, reduce_bucket_size=20_000_000)
    k2 = make_remedy("zero2").apply(Context(knobs=mine, facts=RunFacts(world_size=2)))
    assert k2.reduce_bucket_size == 20_000_000 and k2.stage3_prefetch_bucket_size is None
    cfg = deepspeed_config({"zero_optimization": {"stage": 1, "reduce_bucket_size": 2e7}}, zero_stage=2,
                           sizes=ds_config_sizes(k2))
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 20_000_000
    assert "reduce_bucket_size" not in deepspeed_config(None, zero_stage=1)["zero_optimization"]


def test_several_ranks_without_zero_hold_ddps_gradient_buckets():
    """DistributedDataParallel keeps a flat copy of every trainable gradient from the moment it wraps the model:
    measured on the simulated device with two ranks (the wide model: 121.7 MiB at train begin for 60.8 MiB of float32
    weights; 352.2 MiB peak). ZeRO replaces it with its own partitioned buffers."""
    from oomguard.memory.estimate import ModelSpec, estimate

    wide = ModelSpec(vocab_size=724, hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=128,
                     intermediate_size=4096, tie_word_embeddings=True)
    k = Knobs(dtype="float32", optim="adamw_torch", max_completion_length=32, num_generations=4,
              per_device_train_batch_size=4)
    one = estimate(wide, k, prompt_tokens=14, simulated=True)
    two = estimate(wide, k, world_size=2, prompt_tokens=14, simulated=True)
    zero2 = estimate(wide, k.replace(zero_stage=2), world_size=2, prompt_tokens=14, simulated=True)
    weights = 4 * wide.params
    assert two.phases["generation"] - one.phases["generation"] == weights  # the buckets, from the start
    assert two.peak_alloc_bytes == pytest.approx(352.2 * 2**20, rel=0.05)
    assert zero2.phases["generation"] < two.phases["generation"]


ZERO_ROWS = json.loads((Path(__file__).parent / "fixtures" / "deepspeed" / "zero-rows-simulated.json").read_text())
# What the model leaves out, measured: after a generation with the gather off, DeepSpeed 0.19.8 keeps a LoRA run's
# frozen base gathered through the checkpointed backward (87.9 MiB where the same run with the gather peaks at 45.7 MiB
# in training, and its step runs about 50 times slower)
NOT_MODELLED = {"deep-z3-lora-pf0-nogather": "DeepSpeed keeps LoRA's frozen base gathered in training after a "
                                             "generation without the gather (not modelled)"}


def _zero_row(row):
    from oomguard.memory.estimate import ModelSpec, estimate

    return estimate(ModelSpec.from_config(row["config"]), Knobs(**row["knobs"]), world_size=2,
                    prompt_tokens=row["facts"]["prompt_tokens_max"], simulated=True)


@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.xfail(reason=NOT_MODELLED[r["name"]], strict=True))
                                 if r["name"] in NOT_MODELLED else r for r in ZERO_ROWS],
                         ids=[r["name"] for r in ZERO_ROWS])
def test_the_per_rank_prediction_under_zero_matches_what_each_rank_measured(row):
    """Real two-rank TRL GRPO runs under torchrun with DeepSpeed (0.19.8) on the simulated device
    (``python bench/zero_calibrate.py --json``): plain DDP, ZeRO-2 and ZeRO-3 on the tiny model (activations a large
    share), the wide one (weights, gradients and AdamW state about 95%) and the deep one. DeepSpeed's fp32 master
    partition, the gradients it gathers per partition and flattens again for the step are what the model once missed
    (ZeRO-2 on the wide model: 175 MiB predicted, 288 measured); ZeRO-3's flat gradient partition, kept in every
    phase, and the gradients it flattens into fp32 for the step (the deep model's SGD run: 14% under before)."""
    # docs/limitations.md: within 5%, and the stage-only rows within 0.6% (held to 1%)
    bound = 0.01 if row["name"].endswith("-stage") else 0.05
    assert _zero_row(row).peak_alloc_bytes == pytest.approx(max(row["peaks"]), rel=bound)


@pytest.mark.parametrize("row", [r for r in ZERO_ROWS if r["stage"] == 3], ids=lambda r: r["name"])
def test_the_zero3_generation_phase_matches_what_each_rank_measured_with_and_without_the_gather(row):
    """Each rank's generation phase, measured alone (bench/_phase_rank.py), with TRL's whole-model gather and without
    it (the ``-nogather`` rows): the rank's partition plus a full copy of every partitioned parameter, or what
    DeepSpeed's prefetcher holds at once (half of the deep model, all of the one-layer wide one, one submodule's
    with the prefetch off)."""
    measured = max(p["generation"] for p in row["phases"])
    assert _zero_row(row).phases["generation"] == pytest.approx(measured, rel=0.02)  # docs/limitations.md: 1.8%


# -- ZeRO-3 and generation -------------------------------------------------------------------------------------------
WIDE = dict(vocab_size=724, hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=128,
            intermediate_size=4096, tie_word_embeddings=True)
DEEP = dict(vocab_size=724, hidden_size=256, num_layers=16, num_heads=4, num_kv_heads=4, head_dim=64,
            intermediate_size=512, tie_word_embeddings=True)


def test_zero3_generation_gathers_the_whole_model_on_every_rank_and_without_the_gather_what_deepspeed_prefetches():
    """TRL's ds3_gather_for_generation (default True) gathers every partitioned parameter in full for the whole of
    generate, on top of the rank's own partition. False leaves generation to DeepSpeed's hooks, whose prefetcher runs
    ahead of the forward: half of a deep model at once, all of a one-layer one; with the prefetch off
    (stage3_prefetch_bucket_size 0) one submodule's parameters and the tied embedding."""
    from oomguard.memory.estimate import ModelSpec, estimate

    k = Knobs(dtype="float32", optim="adamw_torch", max_completion_length=32, num_generations=4,
              per_device_train_batch_size=4, zero_stage=3, stage3_prefetch_bucket_size="auto",
              stage3_param_persistence_threshold="auto")
    deep, wide = ModelSpec(**DEEP), ModelSpec(**WIDE)

    def gained(spec, world, **kw):
        whole = estimate(spec, k.replace(**kw), world_size=world, prompt_tokens=14, simulated=True)
        layered = estimate(spec, k.replace(ds3_gather_for_generation=False, **kw), world_size=world, prompt_tokens=14,
                           simulated=True)
        assert {p: v for p, v in whole.phases.items() if p != "generation"} == {
            p: v for p, v in layered.phases.items() if p != "generation"}
        return whole.phases["generation"] - layered.phases["generation"]

    def full(spec):  # what GatheredParameters allocates: every parameter above the persistence threshold, in full
        return 4 * sum(t for t in spec.param_tensors() if t >= 10 * spec.hidden_size)

    for world in (2, 4):  # the whole model comes in full, whatever the share a rank holds
        assert gained(deep, world, stage3_prefetch_bucket_size=0) == pytest.approx(full(deep), rel=0.05)
        assert gained(deep, world) == pytest.approx(0.5 * full(deep), rel=0.05)
        assert gained(wide, world) <= 0.01 * full(wide)  # one layer: the prefetcher holds all of it
    # with vLLM generating, the trainer's model is not gathered for it; one rank has nothing to gather
    vllm = k.replace(use_vllm=True, vllm_mode="server")
    assert (estimate(deep, vllm, world_size=4, prompt_tokens=14, simulated=True).phases
            == estimate(deep, vllm.replace(ds3_gather_for_generation=False), world_size=4, prompt_tokens=14,
                        simulated=True).phases)
    assert gained(deep, 1) == 0


def test_the_gather_rung_comes_after_zero3_and_only_where_it_can_help():
    rung = make_remedy("zero3_gather")
    z3 = Context(knobs=TRL_DEFAULTS.replace(zero_stage=3), facts=RunFacts(world_size=2))
    assert rung.foreign(z3) is None and rung.apply(z3).ds3_gather_for_generation is False
    assert rung.cost == "speed" and rung.resume == "continue"
    assert rung.foreign(Context(knobs=TRL_DEFAULTS.replace(zero_stage=2), facts=RunFacts(world_size=2)))
    assert "vLLM" in rung.foreign(Context(knobs=TRL_DEFAULTS.replace(zero_stage=3, use_vllm=True),
                                          facts=RunFacts(world_size=2)))
    done = Context(knobs=TRL_DEFAULTS.replace(zero_stage=3, ds3_gather_for_generation=False),
                   facts=RunFacts(world_size=2))
    assert rung.blocked(done) == "already layer by layer"
    names = [r.name for r in load_ladder("multi-gpu").rungs]
    assert names.index("zero3") + 1 == names.index("zero3_gather") < names.index("optimizer_8bit")


def test_the_gather_reaches_trl_s_config_and_is_read_from_it():
    cfg = SimpleNamespace(ds3_gather_for_generation=True, deepspeed=None, fsdp="", fsdp_config=None)
    rt = Runtime(Plan(overrides={"ds3_gather_for_generation": False}))
    assert observe_config(cfg)["ds3_gather_for_generation"] is True
    apply_config(rt, cfg)
    assert cfg.ds3_gather_for_generation is False
