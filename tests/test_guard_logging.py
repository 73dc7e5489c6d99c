"""`@oomguard.guard` says what it does while it retries: one `oomguard` log line per OOM and per climb."""

from __future__ import annotations

import logging
import subprocess
import sys

import oomguard

OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which 1.00 GiB is "
       "free.")


def _train(knobs):
    if knobs.per_device_train_batch_size > 2:
        raise RuntimeError(OOM)
    return "trained"


def test_one_warning_per_oom_and_per_climb(caplog):
    caplog.set_level(logging.DEBUG, logger="oomguard")
    assert oomguard.guard(_train)() == "trained"
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "oomguard"]
    warnings = [m for lvl, m in lines if lvl == logging.WARNING]
    assert len(warnings) == 4, lines  # two OOMs, two climbs
    assert "_train() attempt 1/8 ran out of memory: shortfall (2.00 GiB requested)" in warnings[0]
    # the cheapest rung that helps: a micro-batch split (the same gradients), halved again
    assert warnings[1].startswith("climbing micro_batch: per_device_train_batch_size=4")
    assert "micro_batch (again)" in warnings[3]
    assert any(lvl == logging.INFO and "stable after 3 attempts" in m for lvl, m in lines)
    # what changed, in cost-class words; no "kept:" line, since the function built no GRPOConfig to keep
    infos = [m for lvl, m in lines if lvl == logging.INFO]
    assert "changed: 4 micro-steps of 2 rows per step (yours: 1 of 8) (speed)" in infos, infos
    assert not any(m.startswith("kept:") for m in infos)


def test_verbose_false_keeps_it_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="oomguard")
    assert oomguard.guard(_train, verbose=False)() == "trained"
    levels = {r.levelno for r in caplog.records if r.name == "oomguard"}
    assert levels == {logging.DEBUG}


def test_lines_are_visible_without_any_logging_setup():
    code = ("import oomguard\n"
            f"def train(knobs):\n    if knobs.per_device_train_batch_size > 4:\n        raise RuntimeError({OOM!r})\n"
            "oomguard.guard(train)()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "oomguard: train() attempt 1/8 ran out of memory" in out.stderr
    assert "oomguard: climbing micro_batch" in out.stderr
    quiet = subprocess.run([sys.executable, "-c", code.replace("guard(train)", "guard(train, verbose=False)")],
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "oomguard" not in quiet.stderr
