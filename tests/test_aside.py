"""What a launcher prints after a training process stopped itself on purpose, or died of an uncaught OOM, goes to a
file, not the terminal (``run.aside.Aside``); oomguard's own lines still reach the terminal. The end-to-end cells are
the launch matrix's ``predicted`` and OOM ones (tests/test_launch_matrix.py: torchrun and accelerate with two ranks
print no launcher's traceback) and tests/test_deepspeed.py's real OOM under accelerate with ZeRO-3."""

from __future__ import annotations

import sys

import pytest

from oomguard.run.aside import Aside
from oomguard.run.proc import Interrupts, run_attempt


def test_before_the_stop_everything_shows_and_after_it_only_oomguards_lines(tmp_path):
    stopped = [False]
    a = Aside(lambda: stopped[0], tmp_path / "after.log")
    assert a.split(1, b"step 1\n") == b"step 1\n"
    stopped[0] = True
    shown = a.split(2, b"oomguard: pre-flight: stopping\nTraceback (most recent call last):\n  File \"x\"\nChildFail")
    assert shown == b"oomguard: pre-flight: stopping\n"
    assert a.split(2, b"edError: exit 87\n  oomguard probe 1/8: stopped\n") == b"  oomguard probe 1/8: stopped\n"
    a.flush()
    assert (tmp_path / "after.log").read_bytes() == (b"Traceback (most recent call last):\n  File \"x\"\n"
                                                     b"ChildFailedError: exit 87\n")
    assert a.lines == 3


def test_a_launcher_after_a_stop_on_purpose_prints_into_the_attempts_file(tmp_path, capfd):
    mark = tmp_path / "stopped-on-purpose"
    code = (f"import sys, pathlib; sys.stderr.write('oomguard: pre-flight: too big\\n'); sys.stderr.flush(); "
            f"pathlib.Path({str(mark)!r}).write_text('1'); "
            "sys.stderr.write('Traceback (most recent call last):\\nChildFailedError\\n'); sys.exit(1)")
    aside = Aside(mark.exists, tmp_path / "after-stop.log")
    res = run_attempt([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, Interrupts(), aside=aside)
    err = capfd.readouterr().err
    assert res.returncode == 1
    assert "oomguard: pre-flight: too big" in err and "Traceback" not in err
    assert "ChildFailedError" in (tmp_path / "after-stop.log").read_text()


# what torchrun prints after rank 1 died of an OOM (the other rank's error at the collective, the elastic summary)
OOM_END = (b"  File \"/x/trl/grpo_trainer.py\", line 2753, in _generate\n"
           b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
           b"oomguard: out of memory; the last 6 of 40 frames are above; attempt-1/crash-rank1.json keeps the full "
           b"traceback\n")
AFTER = (b"[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: Connection closed by peer\n"
         b"E1129 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 86) local_rank: 1\n"
         b"Traceback (most recent call last):\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
         b"[rank1]: oomguard: out of memory; attempt-1/crash-rank0.json keeps the full traceback\n")


@pytest.mark.parametrize("cut", [0, 10, len(OOM_END) - 5, len(OOM_END), len(OOM_END) + 7])
def test_after_a_ranks_oom_line_only_oomguards_lines_show_wherever_the_reads_fall(tmp_path, cut):
    """The training process prints its trimmed traceback, then oomguard's OOM line: both show, in order, however the
    pipe's reads split them; after the line, the launcher's traceback and the other rank's error go to the file, and
    another rank's OOM line (behind torch's ``[rank1]:`` prefix) still shows."""
    a = Aside(lambda: False, tmp_path / "after.log")
    data = b"step 0 generating\r" + OOM_END + AFTER
    shown = a.split(2, data[:cut]) + a.split(2, data[cut:])
    a.flush()
    assert shown == b"step 0 generating\r" + OOM_END + b"[rank1]: oomguard: out of memory; attempt-1/crash-rank0.json " \
                    b"keeps the full traceback\n"
    aside = (tmp_path / "after.log").read_text()
    assert "ChildFailedError" in aside and "Connection closed by peer" in aside and "crash-rank0" not in aside
    assert a.why == "the out-of-memory error" and a.lines == 5


def test_an_oom_line_on_one_stream_sets_the_others_aside_too(tmp_path):
    a = Aside(lambda: False, tmp_path / "after.log")
    assert a.split(1, b"step 0\n") == b"step 0\n"
    assert a.split(2, OOM_END) == OOM_END
    assert a.split(1, b"{'loss': 0.1}\noomguard attempt 1/8: out of memory\n") == b"oomguard attempt 1/8: out of memory\n"


def test_a_line_that_only_mentions_oomguard_is_not_the_end(tmp_path):
    a = Aside(lambda: False, tmp_path / "after.log")
    text = b"RuntimeError: oomguard: out of memory was printed by the script\nlog: oomguard: out of memory\n"
    assert a.split(2, text) == text and not a.oom
