"""The Supervisor: launch the user's command, watch it, and after an OOM let the climb choose the next config.

``Supervisor.run`` reads top to bottom like torchrun's elastic agent (``_invoke_run``): the conductor's loop
(``Conductor.drive``) asks this front-end to launch an attempt in a fresh process group and say how it ended
(``Launcher.launch`` -> ``Ended``), records it, decides what comes next (probe, run, undo trial, done), and the
supervisor shows it. It is a plain loop rather than a tenacity ``Retrying``: what comes next is the conductor's
decision, not a retry policy.

The supervisor never imports torch: everything it learns about the training process comes from the typed events of
the plan's events file, the CrashRecord, the exit status and the tail of the output. It decides nothing: every
decision of the climb is the ``Conductor``'s (``oomguard.decide.conductor``: the first attempt, what each attempt
teaches the memory model, the next config and attempt, the ladder, the budget, each attempt's record), the one
``@oomguard.guard`` and ``oomguard plan`` use too. The supervisor is composed of a ``Launcher`` (one attempt, from its plan to its record:
``attempts``) and a ``Writer`` (the end: ``ending``), each with its own state.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..decide.climb import Climb, Decision
from ..decide.conductor import Conductor, Ended, Next, ladder_line, say
from ..memory.allocmodel import context_for
from ..memory.device import accelerator_present, gpu_bf16, gpu_name, gpu_total_memory
from ..vocab import allocconf
from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.protocol import EXIT_OOM
from ..vocab.records import Attempt
from .attempts import Launcher
from .command import (
    EXIT_BUG,
    EXIT_EXHAUSTED,
    EXIT_LEAKED,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    InternalError,
    UsageError,
    internal_error,
    load_lock,
    resolve_command,
)
from .ending import Writer
from .follower import follow
from .group import NOTICE_AFTER, Group, GroupError
from .options import BOOT_DIR, Reporter, RunOptions
from .proc import Interrupts, become_subreaper


class Supervisor:
    def __init__(self, argv: list[str], options: RunOptions, reporter: Reporter) -> None:
        self.argv = argv
        self.o = options
        self.ui = reporter
        self.run_dir = options.workdir / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.interrupts = Interrupts()
        user = allocconf.user_settings(os.environ)  # read from the variable torch reads
        climb = Climb(
            options.ladder,
            pinned=Knobs.from_dict(options.replay.overrides if options.replay else {}),
            pinned_by=options.replay.pinned_by() if options.replay else {},
            env_knobs={"expandable_segments": bool(user.expandable_segments),
                       "max_split_size_mb": user.max_split_size_mb},
            facts=RunFacts(alloc_conf_locked=user.locked_text(),
                           bf16_supported=None if options.simulate_gpu else gpu_bf16()),
        )
        capacity = options.capacity or options.simulate_gpu or options.gpu_memory or gpu_total_memory()
        simulated = bool(options.simulate_gpu)
        sim_context = context_for(options.simulate_gpu, options.simulate_context) if options.simulate_gpu else None
        judge = None  # the memory model, loaded only where it can judge: a known size
        if options.predict and capacity:
            from ..decide.judge import Judge

            judge = Judge(capacity, simulated=simulated, context=sim_context,
                          device_name=None if simulated else gpu_name(), warn=reporter.message)
        # a probe needs a device that could run out of memory: an accelerator, or a simulated or named size
        policy = options.policy_for(device=bool(capacity) or accelerator_present())
        self.conductor = Conductor(climb, judge, policy, capacity=capacity, launched=True)
        for line in self.conductor.take_trl(options.trl.version if options.trl else None, None):
            reporter.message(line)
        self.group = Group(options.membership) if options.membership else None
        self.store: Any = None  # the group's store, held by a helper process (oomguard.rendezvous)
        sized_by_nvml = not (options.capacity or options.simulate_gpu or options.gpu_memory)
        self.launcher = Launcher(argv, options, reporter, self.conductor, self.run_dir, self.group, self.interrupts,
                                 sim_context=sim_context, sized_by_nvml=sized_by_nvml)
        self.writer = Writer(argv, options, reporter, self.conductor, self.launcher, self.run_dir, self.group)

    def open_group(self) -> None:
        """Form the group of a job's nodes before the first launch (oomguard.group), through torch's Store held by a
        helper (oomguard.rendezvous): at torchrun's rendezvous host where the command has one and no directory was
        named, else in the directory."""
        from .rendezvous import open_store

        assert self.group is not None
        g, m = self.group, self.group.m
        g.notice = self.ui.message
        role = "leads: it decides every attempt" if m.leader else "follows node 0, which decides every attempt"
        g.via = f"{m.store[0]}:{m.store[1]}" if m.store else None  # named while a client waits for the host
        try:
            self.store = open_store(m, self.argv, lambda: g.waiting([0] if m.node else list(range(1, m.nodes))),
                                    NOTICE_AFTER)
        except GroupError as e:
            raise UsageError(str(e), 1) from None
        where = (f"through a store at {g.via}, torchrun's rendezvous host (this node "
                 f"{'hosts it' if self.store.role == 'host' else 'reaches it'})" if g.via else f"in {g.base}")
        self.ui.message(f"node {m.node} of {m.nodes} ({m.source}); this node {role}; the group meets {where}")
        try:
            g.open(self.store)
            if m.leader:
                g.assemble()
        except GroupError as e:
            self.store.close(wait=5)
            raise UsageError(str(e), 1) from None

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Launch, classify, ask the conductor what is next, until it says done or the budget is spent; then write
        the report. An error of oomguard's own ends as one line (InternalError), its traceback kept in the run's
        directory."""
        try:
            return self._run()
        except (UsageError, InternalError):
            raise
        except Exception as e:
            raise InternalError(internal_error(e, self.run_dir)) from None

    def _run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        become_subreaper()  # orphaned ranks come back to this process, where the attempt's sweep finds them
        if self.o.ladder_reason:
            self.ui.message(ladder_line(self.o.ladder_reason))
        if self.group is None:
            return self._lead()
        self.open_group()
        try:
            if not self.group.m.leader:
                return follow(self.launcher, self.writer)
            return self._lead()
        except BaseException as e:  # the others must not wait for a node that has left
            self.group.fail(f"node {self.group.m.node} ended with an error: {e}")
            raise
        finally:
            self.group.done()
            self.store.close()  # a host stays until every node has read the end

    def _lead(self) -> int:
        """The conductor drives the attempts (``Conductor.drive``); this front-end launches each and shows it."""
        self.when = ""
        with self.interrupts:
            try:
                last = self.conductor.drive(self._launch, lambda nxt: say(nxt, self.ui.message, self._show),
                                            self._ended)
                self.when = "while it wrote the run's report"
                return self.writer.finish(last, self.interrupts.signum)
            except KeyboardInterrupt:
                self.interrupts.signum = self.interrupts.signum or 2
            except UsageError:
                raise
            except Exception as e:  # oomguard's own: the attempt's processes are ended already (proc.run_attempt)
                return self._failed(e, self._last(), self.when)
        return self.writer.finish(self._last(), self.interrupts.signum)

    def _launch(self, nxt: Next) -> Ended:
        self.when = f"during attempt {len(self.conductor.climb.attempts) + 1}"
        return self.launcher.launch(nxt)

    def _ended(self, last: Attempt, diag: Diagnosis | None) -> bool:
        """Show how attempt ``last`` ended; an interrupt ends the run there."""
        self.when = f"after attempt {last.index}"
        self.ui.attempt_end(last, diag)
        return bool(self.interrupts.signum)

    def _last(self) -> Attempt | None:
        return self.conductor.climb.attempts[-1] if self.conductor.climb.attempts else None

    def _failed(self, e: Exception, last: Any, when: str) -> int:
        """An error of oomguard's own ended the run: keep its traceback, and write the report (and the lock of a stable
        attempt) with one line naming it; where even that fails, the lock alone, then the line (InternalError)."""
        line = internal_error(e, self.run_dir, when)
        try:
            return self.writer.finish(last, self.interrupts.signum, error=line)
        except Exception as again:
            internal_error(again, self.run_dir, "while it wrote the report after that")
            kept = self.writer.salvage_lock(last)
            raise InternalError(line + (f"; no report was written, the lock is in {kept}" if kept else
                                        "; no report was written")) from None

    def _show(self, d: Decision) -> None:
        if d.exhausted is not None:
            self.ui.decision([], d.exhausted, {})
        else:
            self.ui.decision(d.steps, None, d.changes, d.skipped_rows())


__all__ = ["BOOT_DIR", "EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_LEAKED", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "EXIT_OOM", "Reporter",
           "RunOptions", "Supervisor", "UsageError", "load_lock", "resolve_command"]
