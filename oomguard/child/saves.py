"""oomguard's checkpoint cadence beside the user's own saving, and the checkpoints it adds taken away again.

A leak's restarts need a recent checkpoint (``Plan.checkpoint_every``; ``--checkpoint-every N`` asks the same). The
user's config is left as it is: ``save_strategy``, ``save_steps`` (``"epoch"`` and ``"best"`` too) and
``save_total_limit`` stay the user's, so transformers' own checks (``load_best_model_at_end`` wants the saves on the
evaluation's schedule) see what the user wrote, and every checkpoint the user's config writes is still written.
oomguard's callback asks the trainer for one more save at each multiple of the cadence where the user's config saves
none (``TrainerControl.should_save``). :class:`AddedCheckpoints`:

- marks each checkpoint it added (:data:`MARK`), so that nothing else is ever deleted: not the user's, not a
  checkpoint of an earlier run in the same directory;
- deletes its older ones at each save (all but the newest, what a restart resumes from; never the best model's), and
  all of them once training ends;
- tells transformers' rotation, for the one save, to leave room for its own checkpoints, so that the user's
  ``save_total_limit`` never deletes one of the user's checkpoints sooner than the user's config would.

The cadence is the knob ``checkpoint_every``, an adaptation in the report's diff and the lock (``Climb.adapt``), so a
replay of the lock saves the same.

>>> a = AddedCheckpoints(6, limit=None)
>>> [s for s in range(1, 20) if a.wants(s)]
[6, 12, 18]
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

MARK = "oomguard-added.json"  # in a checkpoint oomguard's cadence added: deleted again by oomguard, never the user's
WHY = ("a checkpoint at least every {every} step(s) besides the script's own, so that a restart after a late OOM loses "
       "at most {every} step(s); oomguard deletes the ones it adds, all but the newest")


class AddedCheckpoints:
    """The checkpoints a cadence of ``every`` steps adds to the user's own saving (``limit``: the user's
    ``save_total_limit``), handled by the callback around each save on the process that writes them."""

    def __init__(self, every: int, limit: int | None) -> None:
        self.every = every
        self.limit = limit
        self.forced: int | None = None  # the step whose save oomguard asked for

    def wants(self, step: int) -> bool:
        """Whether the cadence wants a checkpoint at ``step``."""
        return step > 0 and step % self.every == 0

    def step_end(self, args: Any, state: Any, control: Any) -> None:
        """At a step's end, after transformers' own flow decided whether the user's config saves: ask for a save where
        the cadence wants one and the user's config makes none; make the rotation leave room for oomguard's own."""
        if not control.should_save and self.wants(state.global_step):
            control.should_save = True
            self.forced = state.global_step
        if control.should_save and self.limit and getattr(args, "should_save", True):
            extra = len(self.added(args.output_dir)) + (self.forced == state.global_step)
            args.save_total_limit = self.limit + extra

    def saved(self, args: Any, state: Any) -> None:
        """A save is done: mark it if oomguard asked for it (else make sure it is not marked: the user's save at the
        same step wrote it again), delete oomguard's older ones, give the rotation back the user's limit."""
        ours, self.forced = self.forced == state.global_step, None
        if not getattr(args, "should_save", True):
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        mark = path / MARK
        try:
            if ours and path.is_dir():
                mark.write_text(json.dumps({"step": state.global_step, "why": "oomguard's checkpoint cadence added "
                                            "it; oomguard deletes it once a newer checkpoint exists"}))
            elif not ours:
                mark.unlink(missing_ok=True)
        except OSError:
            pass
        self._prune(args, state, keep=path)
        if self.limit:
            args.save_total_limit = self.limit

    def ended(self, args: Any, state: Any) -> None:
        """Training finished: no restart needs oomguard's checkpoints any more."""
        if getattr(args, "should_save", True):
            self._prune(args, state, keep=None)

    def added(self, output_dir: str) -> list[Path]:
        """The checkpoints oomguard added in ``output_dir`` (marked)."""
        try:
            return [p for p in Path(output_dir).glob("checkpoint-*") if (p / MARK).is_file()]
        except OSError:
            return []

    def _prune(self, args: Any, state: Any, keep: Path | None) -> None:
        best = getattr(state, "best_model_checkpoint", None)
        for p in self.added(args.output_dir):
            if p == keep or (best and os.path.abspath(best) == os.path.abspath(p)):
                continue
            shutil.rmtree(p, ignore_errors=True)


def added_checkpoints(rt: Any, cfg: Any) -> AddedCheckpoints | None:
    """The cadence of this attempt (the plan's, else a replayed lock's ``checkpoint_every``) on a GRPOConfig, reported
    as an adaptation (the diff, the lock); None without one."""
    every = rt.plan.checkpoint_every or rt.overrides.checkpoint_every
    if not every or saves_as_often(cfg, int(every)):
        return None
    rt.adapt("checkpoint_every", int(every), WHY.format(every=int(every)))
    return AddedCheckpoints(int(every), getattr(cfg, "save_total_limit", None))


def saves_as_often(cfg: Any, every: int) -> bool:
    """Whether the script's own config already saves at least every ``every`` steps (then nothing is added).

    >>> from types import SimpleNamespace
    >>> saves_as_often(SimpleNamespace(save_strategy="steps", save_steps=5), 6), saves_as_often(
    ...     SimpleNamespace(save_strategy="steps", save_steps=500), 6)
    (True, False)
    """
    steps = getattr(cfg, "save_steps", None)
    strategy = str(getattr(getattr(cfg, "save_strategy", None), "value", getattr(cfg, "save_strategy", ""))).lower()
    return strategy == "steps" and isinstance(steps, (int, float)) and 1 <= steps <= every


__all__ = ["MARK", "WHY", "AddedCheckpoints", "added_checkpoints", "saves_as_often"]
