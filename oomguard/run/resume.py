"""How the next real run continues from the newest checkpoint, given what changed since it was saved.

A rung that only changes shapes lets the checkpoint continue (``resume_from_checkpoint``); one that changes the batch
geometry continues with a warning that the data position and the LR schedule drift; one that changes what is trained
(the optimizer state, the adapters, the dtype) starts a new run from the checkpoint's weights, or from step 0 when the
checkpoint holds only an adapter. A new run always writes into a fresh directory, flat under the user's output dir and
never one that exists, so no checkpoint of the user's is ever overwritten.

>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> resume_plan(None, None, TRL_DEFAULTS, [], None, 3) is None
True
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ..decide.choose import Rung
from ..vocab.knobs import Knobs
from ..vocab.protocol import ResumePlan


def fresh_dir(output_dir: str | None, checkpoint: Path, index: int) -> str:
    """``<output dir>/oomguard-attempt-<index>``: flat (never inside an earlier oomguard-attempt dir), never existing.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> fresh_dir(str(out / "oomguard-attempt-6"), out / "oomguard-attempt-6" / "checkpoint-4", 8) == str(out / "oomguard-attempt-8")
    True
    """
    base = Path(output_dir or checkpoint.parent)
    while re.fullmatch(r"oomguard-attempt-\d+(-\d+)?", base.name):
        base = base.parent
    fresh = base / f"oomguard-attempt-{index}"
    n = 2
    while fresh.exists():
        fresh, n = base / f"oomguard-attempt-{index}-{n}", n + 1
    return str(fresh)


def resume_plan(checkpoint: str | None, checkpoint_knobs: Knobs | None, knobs: Knobs, climbed: Sequence[Rung],
                output_dir: str | None, index: int) -> ResumePlan | None:
    """The plan's ``resume`` entry for real run ``index`` with ``knobs``, or None without a usable checkpoint.

    ``climbed`` are the rungs climbed so far: those whose knobs differ from the checkpoint's run (climbed since,
    relaxed, or dropped by a choice) decide how the run may continue.
    """
    if not checkpoint or not Path(checkpoint).is_dir():
        return None
    ckpt = Path(checkpoint)
    changed = {r.knob for r in (checkpoint_knobs or Knobs()).diff(knobs)}
    since = list({r.name: r.remedy for r in climbed if set(r.remedy.changes) & changed}.values())
    new_run = sorted({r.name for r in since if r.resume == "new-run"})
    drift = sorted({r.name for r in since if r.resume == "continue-drift"})
    if new_run:
        fresh = fresh_dir(output_dir, ckpt, index)
        weights = any(ckpt.glob("model*.safetensors")) or any(ckpt.glob("pytorch_model*.bin"))
        if not weights:
            return ResumePlan(mode="restart", checkpoint=str(ckpt), output_dir=fresh,
                              why=f"{', '.join(new_run)} changes what is trained and {ckpt.name} holds only an "
                                  f"adapter: the run starts again from step 0 in {fresh} (your checkpoints stay as "
                                  "they are)")
        return ResumePlan(mode="weights", checkpoint=str(ckpt), output_dir=fresh,
                          why=f"{', '.join(new_run)} changes the optimizer state, the adapters or the dtype, so "
                              f"{ckpt.name} cannot simply continue: a new run starts from its weights (step 0, fresh "
                              f"optimizer) and saves into {fresh}")
    why = f"continuing from {ckpt} (resume_from_checkpoint)"
    if drift:
        why += f"; {', '.join(drift)} changed the batch geometry, so the data position and LR schedule drift"
    return ResumePlan(mode="continue", checkpoint=str(ckpt), why=why)


__all__ = ["fresh_dir", "resume_plan"]
