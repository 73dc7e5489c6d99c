"""The multi-gpu ladder and the DeepSpeed/FSDP settings it writes (DeepSpeed itself is not needed to test this)."""

import json
from types import SimpleNamespace

from oomguard.child.patches import apply_config, observe_config
from oomguard.child.runtime import Plan, Runtime
from oomguard.diagnose import diagnose
from oomguard.distributed import deepspeed_config, observe_deepspeed
from oomguard.knobs import TRL_DEFAULTS, RunFacts
from oomguard.ladder import Exhausted, load_ladder
from oomguard.oom import OOMReport
from oomguard.strategies import Context

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


def test_several_ranks_shard_before_trading_quality():
    names, knobs = climb(RunFacts(world_size=4))
    assert names[:4] == ["zero2", "zero3", "offload_optimizer", "offload_params"]
    assert knobs.zero_stage == 3 and knobs.offload_optimizer and knobs.offload_params
    assert "fsdp_offload" not in names


def test_one_rank_skips_sharding_and_fsdp_runs_take_fsdp_offload():
    assert "zero2" not in climb(RunFacts(world_size=1))[0]
    names, knobs = climb(RunFacts(world_size=2, fsdp=True))
    assert "zero2" not in names and names[0] == "fsdp_offload" and knobs.fsdp_offload


def test_generated_config_keeps_the_users_settings():
    user = {"zero_optimization": {"stage": 2, "overlap_comm": True}, "train_micro_batch_size_per_gpu": "auto"}
    cfg = deepspeed_config(user, zero_stage=3, offload_optimizer=True)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["overlap_comm"] is True
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert user["zero_optimization"]["stage"] == 2  # the user's dict is not changed
    assert observe_deepspeed(cfg) == {"zero_stage": 3, "offload_optimizer": True, "offload_params": False}
    assert deepspeed_config(None, zero_stage=2)["train_micro_batch_size_per_gpu"] == "auto"


def test_the_child_writes_the_generated_config_and_points_grpo_config_at_it(tmp_path):
    user = tmp_path / "ds_zero2.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    events = tmp_path / "events.jsonl"
    rt = Runtime(Plan(attempt=3, overrides={"zero_stage": 3, "offload_optimizer": True}, crash_dir=str(tmp_path),
                      events=str(events)))
    cfg = SimpleNamespace(deepspeed=str(user), fsdp="", per_device_train_batch_size=8, gradient_checkpointing=True,
                          save_strategy="no", save_steps=500)
    assert observe_config(cfg)["zero_stage"] == 2
    apply_config(rt, cfg)
    generated = json.loads((tmp_path / "deepspeed-attempt3.json").read_text())
    assert cfg.deepspeed == str(tmp_path / "deepspeed-attempt3.json")
    assert generated["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                              "stage3_gather_16bit_weights_on_model_save": True}
    ev = [json.loads(line) for line in events.read_text().splitlines()]
    assert ev[0]["event"] == "generated" and ev[0]["replaces"] == str(user)


def test_fsdp_offload_is_added_to_the_users_fsdp_options(tmp_path):
    rt = Runtime(Plan(overrides={"fsdp_offload": True}))
    cfg = SimpleNamespace(deepspeed=None, fsdp="full_shard auto_wrap", save_strategy="no", save_steps=500)
    apply_config(rt, cfg)
    assert cfg.fsdp == "full_shard auto_wrap offload"
