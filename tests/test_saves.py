"""oomguard's checkpoint cadence (a leak's restarts, --checkpoint-every) beside the user's own saving
(oomguard/child/saves.py): the script's config stays as written (transformers' own checks pass, epoch and best saving
stay), the checkpoints it adds are deleted again, all but the newest, the user's save_total_limit keeps exactly the
user's checkpoints, and the cadence is an adaptation in the diff and the lock, so a replay saves the same. The end to
end run is tests/test_late_oom_e2e.py's leak, whose script saves every 5 steps and keeps 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.decide.climb import ADAPTATION, Climb
from oomguard.decide.ladder import load_ladder
from oomguard.vocab.protocol import Plan

trl = pytest.importorskip("trl")


def grpo_config(tmp: Path, plan: Plan, **script):
    """A real GRPOConfig as a script builds it, through oomguard's patch with ``plan``; the process's Runtime too."""
    import trl.trainer.grpo_config as grpo_config_module

    from oomguard.child import patches
    from oomguard.child.runtime import Runtime

    rt = Runtime(plan)
    patches.patch_grpo_config(rt, grpo_config_module)
    try:
        cfg = trl.GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, report_to=[], **script)
    finally:
        patches.remove()
    return cfg, rt


@pytest.mark.parametrize("script", [
    # load_best_model_at_end: transformers wants save_steps a round multiple of eval_steps (a cadence of 6 is not)
    {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 4, "save_steps": 20},
    {"save_strategy": "epoch"},
    {"save_strategy": "best", "eval_strategy": "steps", "eval_steps": 5, "metric_for_best_model": "reward"},
    {"save_strategy": "no"},
    {"save_steps": 5},  # saves as often already: nothing added, nothing in the diff
])
def test_a_cadence_leaves_the_script_s_saving_as_written_and_transformers_accepts_it(tmp_path, script):
    events = tmp_path / "events.jsonl"
    cfg, rt = grpo_config(tmp_path, Plan(checkpoint_every=6, events=str(events)), **script)
    assert cfg.save_strategy == script.get("save_strategy", "steps")
    assert cfg.save_steps == script.get("save_steps", 500)
    adapted = [json.loads(line) for line in events.read_text().splitlines() if '"adapted"' in line]
    if script.get("save_steps") == 5:
        assert rt.added is None and adapted == []
        return
    assert rt.added is not None and rt.added.every == 6
    assert [(a["knob"], a["value"]) for a in adapted] == [("checkpoint_every", 6)]


def saving_run(out: Path, steps: int, every: int | None, **script) -> list[tuple[list[int], list[int]]]:
    """The saves of a ``steps``-step run of the script's config, as transformers' Trainer makes them (its own flow
    callback decides the script's saves, its rotation applies save_total_limit), with oomguard's cadence of ``every``
    beside them: after each step, the checkpoints on disk (the script's, oomguard's marked ones)."""
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import DefaultFlowCallback
    from transformers.trainer_utils import rotate_checkpoints

    from oomguard.child.saves import MARK, AddedCheckpoints

    out.mkdir()
    args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to=[], logging_steps=1, **script)
    added = AddedCheckpoints(every, args.save_total_limit) if every else None
    state, flow, seen = TrainerState(max_steps=steps), DefaultFlowCallback(), []
    state.compute_steps(args, steps)
    for step in range(1, steps + 1):
        state.global_step = step
        control = flow.on_step_end(args, state, TrainerControl())
        if added is not None:
            added.step_end(args, state, control)
        if control.should_save:
            (out / f"checkpoint-{step}").mkdir()
            rotate_checkpoints(output_dir=str(out), save_total_limit=args.save_total_limit, use_mtime=False)
            if added is not None:
                added.saved(args, state)
        if step == steps and added is not None:
            added.ended(args, state)
        on_disk = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        seen.append(([s for s in on_disk if not (out / f"checkpoint-{s}" / MARK).exists()],
                     [s for s in on_disk if (out / f"checkpoint-{s}" / MARK).exists()]))
    return seen


@pytest.mark.parametrize("script", [{"save_steps": 10, "save_total_limit": 2}, {"save_steps": 10},
                                    {"save_strategy": "no"}, {"save_steps": 4, "save_total_limit": 1}])
def test_the_added_checkpoints_go_again_and_the_script_keeps_exactly_its_own(tmp_path, script):
    alone = saving_run(tmp_path / "alone", 24, None, **script)
    guarded = saving_run(tmp_path / "guarded", 24, 3, **script)
    for step, ((own, _), (users, ours)) in enumerate(zip(alone, guarded, strict=True), 1):
        assert users == own, step  # every checkpoint the script keeps, no other, at every step
        assert len(ours) <= 1 and (not ours or ours[0] == max(users + ours)), step  # oomguard's newest at most
        assert not ours or step - ours[0] < 3 or (users and step - users[-1] < 3), step  # a restart loses < 3 steps
    assert guarded[-1][1] == []  # none of oomguard's left once training ended


def test_the_cadence_is_an_adaptation_in_the_diff_and_the_lock_and_a_replay_saves_the_same(tmp_path):
    from oomguard.child.saves import added_checkpoints
    from oomguard.vocab.lock import Lock

    c = Climb(load_ladder("default"))
    c.adapt("checkpoint_every", 5, "a checkpoint at least every 5 step(s)")
    c.adapt("checkpoint_every", 3, "a checkpoint at least every 3 step(s)")  # a later restart saves more often
    assert c.effective()[0].checkpoint_every == 3 and c.overrides() == {"checkpoint_every": 3}
    report = c.report("stable", "", 0)
    assert [(r["knob"], r["to"], r["remedy"]) for r in report.diff] == [("checkpoint_every", 3, ADAPTATION)]
    assert "checkpoint_every=3 (a checkpoint at least every 3 step(s))" in str(c.experiment().changed)
    lock = Lock.from_dict({**Lock(overrides=c.overrides()).to_dict()})
    # the replay's training process: the lock's value as an override, no cadence in the plan
    cfg, rt = grpo_config(tmp_path, Plan(overrides=lock.overrides))
    assert rt.added is not None and rt.added.every == 3 and added_checkpoints(rt, cfg) is not None
