"""DeepSpeed for real: ZeRO-2 and ZeRO-3 GRPO runs under torchrun on CPU (gloo) with the simulated device.

DeepSpeed installs on the CPU machines from its sdist, without building ops (``pip install --no-build-isolation
deepspeed==0.19.8 einops``); it builds its shared-memory communication op on first use (about 30 s, then cached in
``~/.cache/torch_extensions``). The README's test command installs it; these tests are skipped where it is not
installed (see README, "Long runs and many GPUs").
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import (
    ACCELERATE_LAUNCH,
    TINY,
    env_without_launchers,
    free_port,
    reads_as_under_python,
    run_oomguard,
    torchrun,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (pip install --no-build-isolation deepspeed einops)")]


def events(tmp: Path, attempt: int) -> list[dict]:
    path = next((tmp / "wd").glob(f"runs/*/attempt-{attempt}/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_zero3_rung_generated_from_the_users_config_keeps_their_settings(tmp_path, wide_model):
    """From the user's ZeRO-2 JSON (with settings of their own), the multi-gpu ladder climbs to ZeRO-3 after an OOM:
    the generated config keeps their settings, the diff names it, and the run trains."""
    user = tmp_path / "ds_zero2.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1048576,
                                                      "contiguous_gradients": True},
                                "steps_per_print": 7, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}))
    # 300 MiB: their ZeRO-2 runs out in its first optimizer step (288 MiB peak), ZeRO-3 peaks at 269 MiB. On 280 MiB
    # ZeRO-3 fragments too, and the climb goes on to optimizer offload, whose CPU Adam DeepSpeed compiles for minutes.
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "300MiB", "--no-probe", "--no-predict", "--ladder",
                            "multi-gpu", "--", *torchrun(2, TINY, "--model", wide_model, "--output-dir",
                                                         str(tmp_path / "out"), "--deepspeed", str(user)),
                            env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert rep["attempts"][0]["outcome"] == "oom"
    stable = rep["stable"]
    assert stable["zero_stage"] == 3
    generated = next(r for r in rep["diff"] if r["knob"] == "deepspeed config")
    assert generated["from"] == str(user)
    cfg = json.loads(Path(generated["to"]).read_text())
    assert cfg["steps_per_print"] == 7 and cfg["zero_optimization"]["reduce_bucket_size"] == 1048576
    assert cfg["zero_optimization"]["contiguous_gradients"] is True
    assert json.loads(user.read_text())["zero_optimization"]["stage"] == 2  # the user's file is never changed


def test_the_ladder_climbs_from_no_zero_to_zero2_and_the_lock_replays_it(tmp_path, wide_model):
    """Plain DDP on two ranks runs out of memory (DDP keeps a bucket copy of the gradients); the multi-gpu ladder
    climbs to ZeRO-2 through a generated DeepSpeed config; both ranks train; the lock replays the same config."""
    cmd = torchrun(2, TINY, "--model", wide_model, "--output-dir", str(tmp_path / "out"))
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "320MiB", "--no-probe", "--no-predict", "--ladder",
                            "multi-gpu", "--", *cmd, env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert rep["attempts"][0]["outcome"] == "oom" and rep["stable"]["zero_stage"] == 2
    knobs = {r["knob"] for r in rep["diff"]}
    assert {"zero_stage", "deepspeed config"} <= knobs
    last = len(rep["attempts"])
    assert sorted(e["rank"] for e in events(tmp_path, last) if e["event"] == "train_end") == [0, 1]
    lock = tmp_path / "lock.json"
    replay = tmp_path / "replay"
    replay.mkdir()
    out, rep2 = run_oomguard(replay, "--simulate-gpu", "320MiB", "--config", str(lock), "--", *cmd,
                             env=env_without_launchers())
    assert rep2 is not None and rep2["status"] == "stable", out.stderr[-3000:]
    assert len(rep2["attempts"]) == 1 and rep2["attempts"][0]["knobs"]["zero_stage"] == 2


def test_the_guided_climb_chooses_from_the_per_rank_prediction_without_an_oom(tmp_path, wide_model):
    """Plain `oomguard run` (the memory model on), as users run it: plain DDP on two ranks is predicted over the
    device and stopped before it generates; the choice, judged per rank, keeps the experiment, both ranks train, and
    no attempt runs out of memory. Before DeepSpeed's own buffers were counted, ZeRO-2 was predicted at 175 MiB per
    rank, chosen, and ran out of memory in its first optimizer step (288 MiB).

    340 MiB: plain DDP is predicted at 383 MiB (stopped: more than 11.7% over), ZeRO-2 at 330 MiB (measured 288 MiB
    allocated), within the simulated device's 12% of doubt of the edge: sharding alone has no room, so the cheapest
    config with room is chosen, an 8-bit optimizer (precision), or sharding with it.

    It is also the launch matrix's torchrun-2-stable cell (tests/test_launch_matrix.py, ``FOLDED``): the pre-flight's
    promise under torchrun's two ranks, whose checks it makes."""
    cmd = torchrun(2, TINY, "--model", wide_model, "--output-dir", str(tmp_path / "out"))
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "340MiB", "--no-probe", "--", *cmd,
                            env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert out.returncode == rep["attempts"][-1]["exit_code"] == 0
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes[0] == "predicted" and outcomes[-1] == "ok" and "oom" not in outcomes, outcomes
    assert rep["diff"] and {r["remedy"] for r in rep["diff"]} <= set(rep["attempts"][-1]["remedies"])
    assert rep["ladder"] == "multi-gpu"  # picked for torchrun's 2 ranks
    knobs = {r["knob"] for r in rep["diff"]}
    assert not knobs & {"lora_r", "load_in_4bit", "num_generations", "max_completion_length"}, rep["diff"]
    assert {c["cost"] for c in rep["experiment"]["changed"]} <= {"none", "speed", "precision"}
    last = len(rep["attempts"])
    assert sorted(e["rank"] for e in events(tmp_path, last) if e["event"] == "train_end") == [0, 1]


# -- ZeRO-3's whole-model gather for generation --------------------------------------------------------------------------
# The deep model (16 layers of hidden 256, ~11M parameters, SGD: no optimizer state) under ZeRO-3 on two ranks, with
# 16-token completions, 4 micro-batches per generation (16 rows generated per rank) and DeepSpeed's prefetch off, as
# measured per rank and per phase (bench/zero_calibrate.py, rows deep-z3-sgd-pf0 and deep-z3-sgd-pf0-nogather):
# generating with TRL's default ds3_gather_for_generation=True peaks at 117.3 MiB allocated (predicted 118.3 MiB;
# after it DeepSpeed keeps the model gathered through the 4 training micro-steps, 122.0 MiB, which the model does not
# count); without it generation holds 77.8 MiB (predicted 78.8 MiB) and the run peaks in its optimizer step, 82.0 MiB
# (predicted 82.0 MiB). The budget sits between them: the gathered config, predicted 1.14 x 118.3 = 134.9 MiB on the
# device, is more than the pre-flight's 11.7% over 112 MiB (125.1 MiB) and is stopped before it generates; without the
# gather, 1.14 x 82.0 = 93.5 MiB with the simulated device's 12% of room is 104.7 MiB: it fits with room, so the choice
# needs no quality trade; its real peak leaves 30 MiB. The prefetch is off because with it DeepSpeed's prefetcher holds
# about half of this model while generating without the gather (deep-z3-sgd-nogather), which saves less than those
# margins; on a large model it is capped at stage3_max_live_parameters (1e9 elements), as it is here at 0.
GATHER_BUDGET = "112MiB"
ZERO3_NO_PREFETCH = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 0,
                                           "stage3_param_persistence_threshold": "auto"},
                     "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "train_batch_size": "auto", "gradient_clipping": "auto"}


def test_a_zero3_gather_for_generation_that_does_not_fit_is_predicted_and_turned_off(tmp_path, build_model):
    """ZeRO-3 under torchrun with two ranks whose training step fits each rank but whose whole-model gather for
    generation does not (plain `oomguard run`, the memory model on): the pre-flight stops it before it generates, the
    choice turns the gather off (`zero3_gather`, a speed cost) rather than trading quality (no LoRA, 4-bit, optimizer,
    dtype, fewer generations, shorter completions or a smaller batch), no attempt runs out of memory, both ranks
    train."""
    user = tmp_path / "ds_zero3.json"
    user.write_text(json.dumps(ZERO3_NO_PREFETCH))
    cmd = torchrun(2, TINY, "--model", build_model("deep"), "--output-dir", str(tmp_path / "out"), "--deepspeed",
                   str(user), "--optim", "sgd", "--max-completion-length", "16", "--gradient-accumulation-steps", "4",
                   "--max-steps", "1")
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", GATHER_BUDGET, "--no-probe", "--", *cmd,
                            env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes == ["predicted", "ok"], outcomes
    assert rep["ladder"] == "multi-gpu" and rep["original"]["zero_stage"] == 3
    assert rep["original"]["ds3_gather_for_generation"] is True  # GRPOConfig's default: the script sets none
    assert rep["stable"]["ds3_gather_for_generation"] is False
    rows = {r["knob"]: r for r in rep["diff"]}
    assert rows["ds3_gather_for_generation"]["to"] is False
    assert rows["ds3_gather_for_generation"]["remedy"] == "zero3_gather"
    quality = {"lora_r", "load_in_4bit", "optim", "dtype", "bf16", "num_generations", "max_completion_length",
               "per_device_train_batch_size"}
    assert not set(rows) & quality, rep["diff"]
    assert {c["cost"] for c in rep["experiment"]["changed"]} <= {"none", "speed"}
    both_ranks_trained(tmp_path, rep)


# -- DeepSpeed's own buffers, in the configuration forms users write ---------------------------------------------------
# The tiny model's stage-only ZeRO-2 run peaks at 1962 MiB per rank (bench/zero_calibrate.py, tiny-z2-stage), almost
# all of it DeepSpeed's default reduce bucket: 60% of that is 1178 MiB.
SIXTY_PERCENT = "1178MiB"
ZERO3_SIXTY_PERCENT = "1197MiB"  # the same for the accelerate ZeRO-3 YAML's run
ACCELERATE_YAML = (Path(__file__).parent / "fixtures" / "deepspeed" / "accelerate-deepspeed.yaml").read_text()


def zero3_yaml(tmp: Path) -> Path:
    """An accelerate ZeRO-3 YAML as recipes ship it (zero3_init_flag on)."""
    yaml = tmp / "zero3.yaml"
    yaml.write_text(ACCELERATE_YAML.format(stage=3, init="true"))
    return yaml


def sized_by_the_buffer_rung(rep: dict, stage: int) -> dict:
    """The report's diff names the DeepSpeed keys the buffer rung changed; returns the generated config."""
    rows = {r["knob"]: r for r in rep["diff"]}
    keys = ["reduce_bucket_size"] + (["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
                                     if stage == 3 else [])
    for key in keys:
        assert rows[key]["from"] is None and rows[key]["to"] == "auto"
        assert rows[key]["remedy"] == "deepspeed_buffers"
    assert rows["deepspeed config"]["remedy"] == "deepspeed_buffers"
    cfg = json.loads(Path(rows["deepspeed config"]["to"]).read_text())
    assert cfg["zero_optimization"]["stage"] == stage and cfg["zero_optimization"]["reduce_bucket_size"] == "auto"
    return cfg


def both_ranks_trained(tmp: Path, rep: dict, out=None) -> None:
    """Both ranks of the last attempt trained; and, as on a GPU, DeepSpeed's CPU shared-memory all-reduce was neither
    built nor loaded (child/stacks/deepspeed.py), where the run's output is given."""
    last = len(rep["attempts"])
    assert sorted(e["rank"] for e in events(tmp, last) if e["event"] == "train_end") == [0, 1]
    if out is not None:
        assert "shm_comm" not in out.stdout + out.stderr


# tests/compat.sh runs it under the oldest supported TRL too; the same config under `--ladder fastest` (shorter
# completions and fewer generations first) is tests/test_deepspeed_config.py's plan test: no cut of the batch shrinks
# the bucket, so that ladder's choice is the buffer rung as well
@pytest.mark.core
def test_a_stage_only_zero2_dict_is_stopped_before_it_runs_and_its_buffers_sized(tmp_path, tiny_model):
    """The issue's run: GRPOConfig(deepspeed={"zero_optimization": {"stage": 2}, batch sizes "auto"}) under torchrun,
    plain `oomguard run` at 60% of its per-rank peak. The multi-gpu ladder is picked by itself, the memory model sees
    DeepSpeed's default bucket and stops the config before it generates, the buffer rung is chosen before any quality
    trade: no real OOM, both ranks trained, the user's own keys in the generated config."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", SIXTY_PERCENT, "--",
                            *torchrun(2, TINY, "--model", tiny_model, "--output-dir", str(tmp_path / "out"),
                                      "--deepspeed", "stage2"), env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert "ladder multi-gpu: torchrun --nproc_per_node 2 starts 2 ranks" in out.stderr
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes[0] == "predicted" and "oom" not in outcomes, outcomes
    cfg = sized_by_the_buffer_rung(rep, 2)
    assert cfg["train_batch_size"] == "auto" and cfg["gradient_accumulation_steps"] == "auto"
    assert {r["knob"] for r in rep["diff"]} == {"reduce_bucket_size", "deepspeed config"}  # nothing else traded
    both_ranks_trained(tmp_path, rep, out)


def test_a_real_oom_of_the_default_bucket_is_diagnosed_as_the_bucket(tmp_path, tiny_model):
    """A stage-only JSON file (with a setting of the user's own) under torchrun, climbed one rung per OOM
    (--no-predict): the 1.86 GiB request is diagnosed as DeepSpeed's reduce bucket, not "only smaller shapes", and the
    next rung is the buffer rung; their file is unchanged. (--max-attempts 1: that the buffer rung then fits is the
    stage-only dict's test above, and that a config generated from the user's file keeps their settings is the ZeRO-3
    rung's test at the top.)"""
    user = tmp_path / "ds_zero2.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 7,
                                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "train_batch_size": "auto"}))
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", SIXTY_PERCENT, "--no-probe", "--no-predict", "--max-attempts",
                            "1", "--", *torchrun(2, TINY, "--model", tiny_model, "--output-dir", str(tmp_path / "out"),
                                                 "--deepspeed", str(user)), env=env_without_launchers())
    assert rep is not None and rep["status"] == "exhausted", out.stderr[-3000:]
    first = rep["attempts"][0]
    assert first["outcome"] == "oom" and "reduce bucket" in first["oom"]["evidence"][0]
    assert "only smaller shapes" not in out.stderr
    assert first["climbed"] == "deepspeed_buffers"
    assert json.loads(user.read_text()) == {"zero_optimization": {"stage": 2}, "steps_per_print": 7,
                                            "train_micro_batch_size_per_gpu": "auto",
                                            "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}


@pytest.mark.core
def test_an_accelerate_deepspeed_yaml_as_recipes_ship_it(tmp_path, tiny_model):
    """`accelerate launch --config_file zero3.yaml` (open-r1's and TRL's form) with a script that does not set
    use_cpu, at 60% of its peak: it runs on CPU ranks (oomguard sets use_cpu where DeepSpeed itself runs on the CPU;
    accelerate's DeepSpeed launcher does not pass the YAML's on), the config accelerate builds is modelled, and the
    buffer rung rewrites it into a config accelerate accepts: no real OOM, both ranks trained. ZeRO-3, since its YAML
    sets more than ZeRO-2's (zero3_init_flag, the stage-3 buckets the rung sizes too); ZeRO-2's buffer rung is the
    stage-only dict's test above, and a ZeRO-2 YAML is read as this one is (tests/test_deepspeed_config.py)."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", ZERO3_SIXTY_PERCENT, "--",
                            *ACCELERATE_LAUNCH, "--config_file", str(zero3_yaml(tmp_path)),
                            "--main_process_port", str(free_port()), TINY, "--model", tiny_model, "--output-dir",
                            str(tmp_path / "out"), "--no-use-cpu", env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert "says distributed_type: DEEPSPEED (ZeRO stage 3)" in out.stderr
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes[0] == "predicted" and "oom" not in outcomes, outcomes
    assert rep["original"]["zero_stage"] == 3
    cfg = sized_by_the_buffer_rung(rep, 3)
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "none"  # the YAML's settings, kept
    both_ranks_trained(tmp_path, rep, out)  # ZeRO-3 partitions the weights as they load: oomguard starts DeepSpeed's
    # communication on CPU, which transformers does not


def test_a_real_oom_under_accelerate_with_zero3_reads_as_under_python(tmp_path, tiny_model):
    """The issue's run: a recipe's accelerate ZeRO-3 YAML on two ranks with --no-preflight, at 60% of its peak: both
    ranks run out of memory as DeepSpeed sets up its default reduce bucket. The terminal shows a rank's trimmed
    traceback and oomguard's line naming its crash record, then the diagnosis; accelerate's ChildFailedError (and
    torch elastic's summary) go to the attempt's file; the attempt is an OOM with the training process's code, 86."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", ZERO3_SIXTY_PERCENT, "--no-preflight", "--max-attempts", "1",
                            "--", *ACCELERATE_LAUNCH, "--config_file", str(zero3_yaml(tmp_path)),
                            "--main_process_port", str(free_port()), TINY, "--model", tiny_model, "--output-dir",
                            str(tmp_path / "out"), "--no-use-cpu", env=env_without_launchers())
    assert rep is not None, out.stderr[-3000:]
    first = rep["attempts"][0]
    assert first["outcome"] == "oom" and first["exit_code"] == 86, out.stderr[-3000:]
    assert "reduce bucket" in first["oom"]["evidence"][0] and first["climbed"] == "deepspeed_buffers"
    reads_as_under_python(out.stderr, tmp_path / "wd", "ChildFailedError")
    assert "out of memory at step 0 (1.86 GiB requested)" in out.stderr  # the diagnosis, as under `python`
