"""How an attempt ended, decided from what its training processes recorded, whatever the launcher's exit code.

Pure: the events, crash records and exit status are made here, no process runs. The end-to-end counterpart is
tests/test_launch_matrix.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from oomguard.decide.climb import Climb
from oomguard.decide.conductor import Conductor, Policy
from oomguard.decide.ladder import load_ladder
from oomguard.oom.parse import parse_oom
from oomguard.run.classify import Ranks, classify
from oomguard.run.proc import ProcessResult
from oomguard.run.verdict import conclude
from oomguard.vocab.events import CodeSeen, OOMRaised, PreflightStop, ProcessEnded, ProcessStarted, StepDone
from oomguard.vocab.knobs import TRL_DEFAULTS
from oomguard.vocab.records import CrashRecord, Outcome

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.73 GiB of which "
            "1.28 GiB is free. Including non-PyTorch memory, this process has 14.43 GiB memory in use. Of the "
            "allocated memory 11.82 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but "
            "unallocated.")
LAUNCHER_CODES = (0, 1, 2, 87, 137, -signal.SIGKILL)


def result(code: int, stderr: str = "", host_oom: list[str] | None = None, interrupted: int | None = None,
           strong: bool = True, pid: int | None = None):
    return ProcessResult(code, "", stderr, interrupted, 1.0, host_oom=host_oom or [], host_strong=strong,
                         host_checked="the cgroup's OOM-kill counter did not rise", pid=pid)


def trained(pid: int, rank: int | None = None) -> list:
    return [CodeSeen("config", pid=pid, rank=rank), CodeSeen("trainer", pid=pid, rank=rank)]


def crash(adir: Path, pid: int, rank: int | None = None) -> tuple[Path, OOMRaised]:
    path = adir / f"crash-rank{rank}.json"
    CrashRecord(message=CUDA_OOM, exception_type="torch.OutOfMemoryError", report=parse_oom(CUDA_OOM),
                phase="generation", rank=rank, pid=pid).write(path)
    return path, OOMRaised(step=0, phase="generation", path=str(path), pid=pid, rank=rank)


def decide(tmp_path: Path, res: ProcessResult, events: list):
    warnings: list[str] = []
    ended = classify(1, res, tmp_path, events, TRL_DEFAULTS, [], warnings.append)
    con = Conductor(Climb(load_ladder("default")), None, Policy(), launched=True)
    return con.take(ended), ended.diagnosis, warnings  # the record the conductor builds from it


def ended(how: str, pid: int, rank: int | None = None, **kw) -> ProcessEnded:
    return ProcessEnded(how, pid=pid, rank=rank, reached=("config", "trainer"), **kw)


def test_a_pre_flight_stop_is_read_from_the_events_whatever_the_launcher_exits_with(tmp_path):
    for code in LAUNCHER_CODES:
        events = [*trained(11, 0), *trained(12, 1),
                  PreflightStop(predicted_bytes=3 << 30, capacity=1 << 30, margin=0.15, pid=11, rank=0),
                  ended("predicted", 11, 0), PreflightStop(predicted_bytes=3 << 30, capacity=1 << 30, pid=12, rank=1),
                  ended("predicted", 12, 1)]
        attempt, diag, _ = decide(tmp_path, result(code), events)
        assert attempt.outcome == Outcome.PREDICTED and diag is None, code
        assert attempt.predicted_bytes == 3 << 30


def test_a_stop_before_vllm_starts_is_diagnosed_with_its_reason_written_first(tmp_path):
    reason = "vLLM's KV cache would hold 1,024 tokens, fewer than the 2,048 of one sequence"
    events = [*trained(11), PreflightStop(predicted_bytes=1 << 30, capacity=2 << 30, pid=11, before="starts vLLM",
                                          reason=reason), ended("predicted", 11)]
    attempt, diag, _ = decide(tmp_path, result(87), events)
    assert attempt.outcome == Outcome.PREDICTED and attempt.note == f"stopped before starting vLLM: {reason}"
    assert diag.kind == "vllm-reservation" and diag.facts.reason == reason
    assert diag.evidence == (f"{reason}.", "vLLM has no room for the KV cache of one full-length sequence: raise "
                             "vllm_gpu_memory_utilization or lower vllm_max_model_length.")


def finished(pid: int) -> StepDone:
    return StepDone(step=2, final=True, pid=pid)


def test_every_training_process_finishing_is_a_fit_even_when_the_launcher_exits_1(tmp_path):
    events = [*trained(11, 0), *trained(12, 1), finished(11), finished(12), ended("exit", 11, 0, code=0),
              ended("exit", 12, 1, code=0)]
    attempt, _, warnings = decide(tmp_path, result(1), events)
    assert attempt.outcome == Outcome.OK and attempt.exit_code == 1
    assert "passed through" in attempt.note and warnings
    climb = Climb(load_ladder("default"))
    climb.record(attempt)
    status, code, message = conclude(attempt, climb)
    assert (status, code) == ("stable", 1) and "exited with code 1, passed through" in message


def test_one_ranks_oom_decides_the_job_while_the_other_was_stopped_by_its_launcher(tmp_path):
    path, oom = crash(tmp_path, 12, rank=1)
    events = [*trained(11, 0), *trained(12, 1), oom, ended("oom", 12, 1, path=str(path))]  # rank 0: SIGTERM, silent
    attempt, diag, _ = decide(tmp_path, result(1), events)
    assert attempt.outcome == Outcome.OOM and attempt.oom["rank"] == 1 and diag is not None
    assert attempt.exit_code == 86  # the rank's own code, not torchrun's 1: an OOM reads as under `python`


def test_an_oom_a_rank_caught_before_it_failed_of_another_error_is_not_the_attempts_ending(tmp_path):
    """A script's own retry caught an OOM of trainer.train() (oomguard wrote its CrashRecord on the way), then the
    rank failed of a KeyError: the KeyError ended it, passed through, not climbed as an OOM."""
    _, oom = crash(tmp_path, 11, rank=0)
    events = [*trained(11, 0), *trained(12, 1), oom, ended("error", 11, 0, error="KeyError: 'answer'")]
    attempt, diag, _ = decide(tmp_path, result(1), events)
    assert attempt.outcome == Outcome.FAILED and diag is None and attempt.note == "rank 0 (pid 11) raised KeyError: 'answer'"


def test_the_output_is_read_for_an_oom_only_where_no_training_process_recorded_its_end(tmp_path):
    """Under torchrun the other ranks are stopped by a signal and write no end, so some rank is always silent after a
    failure: an OOM a script caught and printed earlier, still in the output's tail, made rank 0's KeyError an OOM."""
    tail = f"caught and retried with a smaller batch: torch.OutOfMemoryError: {CUDA_OOM}\n"
    events = [*trained(11, 0), *trained(12, 1), ended("error", 11, 0, error="KeyError: 'answer'")]
    attempt, _, _ = decide(tmp_path, result(1, stderr=tail), events)
    assert attempt.outcome == Outcome.FAILED and "KeyError" in attempt.note
    # no rank could say anything (killed hard, as an abort in CUDA's own threads does): the output is all there is
    attempt, _, _ = decide(tmp_path, result(-signal.SIGABRT, stderr=tail), trained(11, 0) + trained(12, 1))
    assert attempt.outcome == Outcome.OOM


def test_an_oom_the_script_caught_and_outlived_is_not_the_attempts_ending(tmp_path):
    """A script that catches the OOM of trainer.train() (its own retry with a smaller batch) and ends cleanly: the
    CrashRecord oomguard wrote on the way does not make the attempt an OOM."""
    _, oom = crash(tmp_path, 11)
    events = [*trained(11), oom, ended("exit", 11, code=0)]
    attempt, _, _ = decide(tmp_path, result(0, stderr=f"caught: {CUDA_OOM}"), events)
    assert attempt.outcome == Outcome.OK


def test_a_script_that_leaves_by_os_exit_after_training_has_finished(tmp_path):
    """Some scripts end with os._exit(0) to skip a hanging teardown: no `end` event, but training had finished."""
    events = [*trained(11), StepDone(step=2, final=True, pid=11)]
    assert decide(tmp_path, result(0), events)[0].outcome == Outcome.OK
    assert decide(tmp_path, result(0), trained(11))[0].outcome == Outcome.FAILED  # gone before training ended


def test_a_non_oom_failure_is_passed_through_with_its_reason_and_the_commands_code(tmp_path):
    events = [*trained(11, 0), *trained(12, 1), ended("error", 12, 1, error="ValueError: bad reward")]
    for code in (1, 2):
        attempt, diag, _ = decide(tmp_path, result(code), events)
        assert attempt.outcome == Outcome.FAILED and diag is None
        assert attempt.note == "rank 1 (pid 12) raised ValueError: bad reward"
        status, exit_code, message = conclude(attempt, Climb(load_ladder("default")))
        assert (status, exit_code) == ("failed", code) and "ValueError: bad reward" in message


def test_a_raise_systemexit_of_the_scripts_own_is_read_from_the_exit_status(tmp_path):
    """`raise SystemExit(1)` leaves no mark in the process (its end reads exit 0): where the command is the training
    process, its exit status is its own; behind a launcher, a non-zero status with training unfinished fails."""
    events = [*trained(11), ended("exit", 11, code=0)]
    assert decide(tmp_path, result(1, pid=11), events)[0].outcome == Outcome.FAILED
    assert decide(tmp_path, result(1, pid=99), events)[0].outcome == Outcome.FAILED  # launcher: training unfinished
    assert decide(tmp_path, result(0, pid=11), events)[0].outcome == Outcome.OK


def test_a_launcher_that_exits_0_does_not_hide_a_failed_rank(tmp_path):
    events = [*trained(11), ended("exit", 11, code=3)]
    attempt, _, _ = decide(tmp_path, result(0), events)
    assert attempt.outcome == Outcome.FAILED and attempt.note == "the training process (pid 11) exited with code 3"
    status, code, message = conclude(attempt, Climb(load_ladder("default")))
    assert (status, code) == ("failed", 1) and "exited with code 0 but its training did not finish" in message


def test_a_rank_killed_without_a_word_is_a_host_oom_only_with_evidence(tmp_path):
    events = [*trained(11, 0), *trained(12, 1), ended("error", 11, 0, error="RuntimeError: gloo connection closed")]
    evidence = ["the cgroup's OOM-kill counter rose from 0 to 1 during the attempt (memory.events)"]
    attempt, diag, _ = decide(tmp_path, result(1, host_oom=evidence), events)
    assert attempt.outcome == Outcome.OOM and diag.kind == "host-ram"
    assert diag.facts.host_signs == tuple(evidence) and diag.evidence[-1] == "The cgroup's OOM-kill counter rose " \
        "from 0 to 1 during the attempt (memory.events)." and attempt.oom["evidence"] == list(diag.evidence)
    assert "rank 1 (pid 12) was killed without a word (the command exited 1)" in attempt.oom["message"]
    weak = ["the attempt's processes reached 30 GiB of resident memory, 93% of the machine's RAM (32 GiB)"]
    attempt, _, _ = decide(tmp_path, result(1, host_oom=weak, strong=False), events)
    assert attempt.outcome == Outcome.FAILED and "gloo" in attempt.note  # the rank's own error outweighs it
    assert decide(tmp_path, result(1, host_oom=weak, strong=False), trained(12, 1))[0].outcome == Outcome.OOM
    attempt, diag, _ = decide(tmp_path, result(1), events)  # no evidence: the peer's error is the reason
    assert attempt.outcome == Outcome.FAILED and "gloo" in attempt.note
    attempt, _, warnings = decide(tmp_path, result(1), trained(12, 1))
    assert attempt.outcome == Outcome.FAILED and "rank 1 (pid 12) ended without a word" in attempt.note
    assert "no sign of the kernel's OOM killer" in attempt.note and warnings


def test_without_records_the_exit_status_and_the_output_decide_as_before(tmp_path):
    """A command whose processes oomguard's bootstrap did not reach (a shell script that resets PYTHONPATH, a
    program that is not Python) leaves no records: its exit status and output are all there is."""
    assert decide(tmp_path, result(0), [])[0].outcome == Outcome.OK
    assert decide(tmp_path, result(1, stderr=CUDA_OOM), [])[0].outcome == Outcome.OOM
    attempt, _, _ = decide(tmp_path, result(-signal.SIGKILL), [])
    assert attempt.outcome == Outcome.FAILED and attempt.note.startswith("killed by SIGKILL (exit 137)")
    evidence = ["the kernel log says: Out of memory: Killed process 4242 (python)"]
    assert decide(tmp_path, result(-signal.SIGKILL, host_oom=evidence), [])[0].outcome == Outcome.OOM


def test_an_interrupt_wins_over_everything_the_ranks_said(tmp_path):
    path, oom = crash(tmp_path, 11)
    events = [*trained(11), oom, ended("oom", 11, path=str(path))]
    assert decide(tmp_path, result(1, interrupted=2), events)[0].outcome == Outcome.INTERRUPTED


def test_what_decides_an_attempt_while_other_ranks_still_run():
    alive = {11: True, 12: True}
    ranks = Ranks.of(trained(11, 0) + trained(12, 1))
    assert ranks.decided(lambda pid: alive[pid]) is None
    ranks.add(ended("exit", 11, 0, code=0))  # one rank finished first: the other may still be training
    assert ranks.decided(lambda pid: alive[pid]) is None
    alive[12] = False  # the other is gone without a word (killed): the job is decided
    assert ranks.decided(lambda pid: alive[pid]) == "rank 1 (pid 12) is gone without a word"
    helper = Ranks.of([ProcessEnded("error", pid=30, error="BrokenPipeError")])  # not a training process
    assert helper.decided(lambda pid: True) is None


def test_a_failed_rank_decides_once_it_is_gone_and_only_pids_of_this_host_are_asked():
    """An error end is written before the process's own atexit work (an upload): the grace starts once it is gone.
    A PID from another host or PID namespace (srun, a container) names another process: never asked."""
    ranks = Ranks.of([ProcessStarted(pid=11, where="a:ns1"), *trained(11, 0),
                      ProcessStarted(pid=12, where="b:ns9"), *trained(12, 1)])
    assert ranks.decided(lambda pid: pid != 12, here="a:ns1") is None  # pid 12 is elsewhere: never asked
    assert ranks.decided(lambda pid: pid != 11, here="a:ns1") == "rank 0 (pid 11) is gone without a word"
    ranks = Ranks.of([ProcessStarted(pid=11, where="a:ns1"), *trained(11, 0),
                      ended("error", 11, 0, error="ValueError: x")])
    assert ranks.decided(lambda pid: True, here="a:ns1") is None  # still finishing its own atexit work
    assert ranks.decided(lambda pid: False, here="a:ns1") == "rank 0 (pid 11) ended: error"


def test_a_spawned_helper_that_built_a_config_is_not_a_training_process(tmp_path):
    """A dataloader or datasets.map worker spawned by multiprocessing re-imports the script: it may build a
    GRPOConfig, and it is terminated when its work is done. Its silence is not a rank's death."""
    events = [*trained(11), ProcessStarted(pid=40, helper=True), CodeSeen("config", pid=40), finished(11),
              ended("exit", 11, code=0)]
    assert decide(tmp_path, result(0, pid=11), events)[0].outcome == Outcome.OK


ENDINGS = st.sampled_from(["ok", "error", "exit3", "oom", "predicted", "silent"])


@given(endings=st.lists(ENDINGS, min_size=1, max_size=4), code=st.sampled_from(LAUNCHER_CODES), data=st.data())
def test_the_job_is_decided_once_whatever_order_the_ranks_wrote_in(tmp_path_factory, endings, code, data):
    """Ranks that record different endings: the decision is the same for any interleaving of their records, and
    follows one order: OOM, pre-flight stop, failure, fit."""
    adir = tmp_path_factory.mktemp("attempt")
    streams = []
    for rank, how in enumerate(endings):
        pid = 100 + rank
        evs = trained(pid, rank)
        if how == "oom":
            path, oom = crash(adir, pid, rank)
            evs += [oom, ended("oom", pid, rank, path=str(path))]
        elif how == "predicted":
            evs += [PreflightStop(predicted_bytes=1, capacity=1, pid=pid, rank=rank), ended("predicted", pid, rank)]
        elif how != "silent":
            evs += ([ended("error", pid, rank, error="E")] if how == "error"
                    else [ended("exit", pid, rank, code=3)] if how == "exit3"
                    else [finished(pid), ended("exit", pid, rank, code=0)])
        streams.append(evs)
    events = []
    while any(streams):  # an interleaving that keeps each process's own order
        s = data.draw(st.sampled_from([s for s in streams if s]))
        events.append(s.pop(0))
    attempt, _, _ = decide(adir, result(code), events)
    expected = (Outcome.OOM if "oom" in endings else Outcome.PREDICTED if "predicted" in endings
                else Outcome.OK if set(endings) == {"ok"} else Outcome.FAILED)
    assert attempt.outcome == expected


def test_a_host_oom_kill_while_a_rank_saves_is_diagnosed_as_the_saves(tmp_path):
    """Trainer's _save_checkpoint reports that it began (a `saving` event); a process the kernel kills before the
    checkpoint is saved died of host RAM at a save, and the diagnosis says so. After the save, it is the run's."""
    from oomguard.vocab.events import CheckpointSaved, Saving

    evidence = ["the cgroup's OOM-kill counter rose from 0 to 1 during the attempt (memory.events)"]
    saving = [*trained(12, 1), Saving(step=2)]
    attempt, diag, _ = decide(tmp_path, result(-signal.SIGKILL, host_oom=evidence), saving)
    assert attempt.outcome == Outcome.OOM and (diag.kind, diag.phase) == ("host-ram", "save")
    assert any("checkpoint save" in e for e in diag.evidence)
    saved = [*saving, CheckpointSaved(2, "out/checkpoint-2")]
    assert decide(tmp_path, result(-signal.SIGKILL, host_oom=evidence), saved)[1].phase != "save"
