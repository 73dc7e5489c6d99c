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

from helpers import TINY, env_without_launchers, run_oomguard, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (pip install --no-build-isolation deepspeed einops)")]


def events(tmp: Path, attempt: int) -> list[dict]:
    path = next((tmp / "wd").glob(f"runs/*/attempt-{attempt}/events.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_zero_run_trains_on_every_rank(tmp_path, tiny_model, stage):
    """The user's own ZeRO config (batch sizes "auto") on two CPU ranks. ZeRO-3 partitions the weights while they
    load, with DeepSpeed's own communication, which transformers does not start on CPU: oomguard does."""
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "1GiB", "--no-probe", "--",
                            *torchrun(2, TINY, "--model", tiny_model, "--output-dir", str(tmp_path / "out"),
                                      "--deepspeed", stage), env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    assert rep["original"]["zero_stage"] == int(stage)
    ended = [e["rank"] for e in events(tmp_path, 1) if e["event"] == "train_end"]
    assert sorted(ended) == [0, 1]


def test_the_zero3_rung_generated_from_the_users_config_keeps_their_settings(tmp_path, wide_model):
    """From the user's ZeRO-2 JSON (with settings of their own), the multi-gpu ladder climbs to ZeRO-3 after an OOM:
    the generated config keeps their settings, the diff names it, and the run trains."""
    user = tmp_path / "ds_zero2.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1048576,
                                                      "contiguous_gradients": True},
                                "steps_per_print": 7, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}))
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "280MiB", "--no-probe", "--no-predict", "--ladder",
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


def test_the_guided_climb_chooses_zero_from_the_per_rank_prediction_without_an_oom(tmp_path, wide_model):
    """Plain `oomguard run` (the memory model on), as users run it: plain DDP on two ranks is predicted over the
    device and stopped before it generates; the choice shards (ZeRO, through a generated DeepSpeed config), both
    ranks train, and no attempt runs out of memory. Before DeepSpeed's own buffers were counted, ZeRO-2 was
    predicted at 175 MiB per rank, chosen, and ran out of memory in its first optimizer step (288 MiB)."""
    cmd = torchrun(2, TINY, "--model", wide_model, "--output-dir", str(tmp_path / "out"))
    out, rep = run_oomguard(tmp_path, "--simulate-gpu", "320MiB", "--no-probe", "--ladder", "multi-gpu", "--",
                            *cmd, env=env_without_launchers())
    assert rep is not None and rep["status"] == "stable", out.stderr[-3000:]
    outcomes = [a["outcome"] for a in rep["attempts"]]
    assert outcomes[0] == "predicted" and "oom" not in outcomes, outcomes
    assert rep["stable"]["zero_stage"] in (2, 3)
    assert {"zero_stage", "deepspeed config"} <= {r["knob"] for r in rep["diff"]}
    last = len(rep["attempts"])
    assert sorted(e["rank"] for e in events(tmp_path, last) if e["event"] == "train_end") == [0, 1]
