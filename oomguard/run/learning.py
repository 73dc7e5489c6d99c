"""What ``oomguard run`` learns from the training process's events: the user's own config and the run's facts (for
the climb), the TRL it runs and the device it sees (for the memory model), a config that cannot learn or a patch
that failed (one warning each), and what an attempt's peak teaches the model, online and across runs."""

from __future__ import annotations

from typing import Any

from ..decide.climb import Climb
from ..decide.experiment import precision_warning
from ..decide.ladder import load_ladder
from ..vocab.diagnosis import Diagnosis
from ..vocab.events import (
    Adapted,
    ChildEvent,
    CodeSeen,
    DatasetSeen,
    DeviceMeasured,
    ModelSeen,
    OtherEvent,
    ProtocolError,
    strict,
)
from ..vocab.knobs import Knobs, RunFacts
from ..vocab.records import Attempt, AttemptKind, Outcome
from ..vocab.sizes import format_size
from ..vocab.trlrange import head_of, support
from .group import Group
from .launch import MULTI_GPU, facts_reason
from .options import PROBE_TAIL, Reporter, RunOptions


class Learning:
    """The Supervisor's part that takes what the training process reports (a mixin of ``Supervisor``)."""

    # the Supervisor's state these methods read and write (set in Supervisor.__init__)
    argv: list[str]
    o: RunOptions
    ui: Reporter
    climb: Climb
    guide: Any
    group: Group | None

    def _learn(self, events: list[ChildEvent]) -> None:
        """Take what the training process reported: the script's own values (first report wins), and facts."""
        c = self.climb
        facts = c.facts
        for ev in events:
            if isinstance(ev, CodeSeen):
                self.reached.add(ev.point)
                c.observe(ev.observed)
                c.resolve(ev.resolved)
                facts = facts.replace(**self._known_facts(ev.facts))
                if ev.world_size:
                    facts = facts.replace(world_size=ev.world_size)
            elif isinstance(ev, DatasetSeen):
                facts = facts.replace(prompt_tokens_max=ev.prompt_tokens_max or facts.prompt_tokens_max,
                                      prompt_tokens_p95=ev.prompt_tokens_p95 or facts.prompt_tokens_p95,
                                      dataset_rows=ev.rows or facts.dataset_rows)
            elif isinstance(ev, Adapted):
                c.adapt(ev.knob, ev.value, ev.why)
            elif isinstance(ev, ModelSeen):
                self.reached.update(("model", *ev.reaches))  # before a load: points the script passes after it
                facts = facts.replace(model_config=ev.config or facts.model_config)
            elif isinstance(ev, OtherEvent):
                self._unknown("event", ev.kind)
            elif isinstance(ev, DeviceMeasured) and ev.context_bytes:
                self.device = {k: getattr(ev, k) for k in ("context_bytes", "measured_bytes", "how",
                                                           "allocator_bytes", "final")}
                if self.guide is not None and ev.final:  # --gpu-memory: the context really held
                    self.guide.set_context(int(ev.context_bytes))
        if self.guide is not None:  # what vLLM needs on this device, for the rung that shrinks its reservation
            facts = facts.replace(vllm_min_utilization=self.guide.vllm_floor(facts, c.effective()[0]))
        c.learn(facts)
        self._take_device(facts.device_total)
        if facts.bf16_moving is not None:  # measured on the loaded weights: the user's own config may not learn
            self._warn(precision_warning(c.original(), facts))
        self._take_trl(facts.trl_version, facts.trl_head, facts.stack_untested)
        if self.o.ladder_auto and c.ladder.name != MULTI_GPU and not c.climbed and (why := facts_reason(facts)):
            c.ladder = load_ladder(MULTI_GPU)  # before the first decision: nothing was climbed on the other ladder
            self._ladder_line(why)

    def _known_facts(self, reported: dict[str, Any]) -> dict[str, Any]:
        """The facts of ``reported`` that RunFacts holds; another is oomguard's own mistake (the training process and
        the supervisor are the same version): an error under OOMGUARD_STRICT_EVENTS, else said once."""
        known = RunFacts.__dataclass_fields__
        for k in reported:
            if k not in known:
                self._unknown("fact", k)
        return {k: v for k, v in reported.items() if k in known}

    def _unknown(self, what: str, name: str) -> None:
        if strict():
            raise ProtocolError(f"the training process reported the {what} {name!r}, which this supervisor does not "
                                "know")
        self._warn(f"the training process reported the {what} {name!r}, which this supervisor does not know "
                   "(ignored; oomguard's training process and supervisor should be the same version: please report "
                   "it)")

    def _take_device(self, total: int | None) -> None:
        """The size of the device the training process computes on, as CUDA reports it there: where the size came
        from NVML and differs (a device order or a MIG layout NVML could not resolve), it is the one judged."""
        if not total or not self.sized_by_nvml or total == self.capacity:
            return
        old, self.capacity = self.capacity, total
        if self.guide is not None:
            self.guide.capacity = total
        self.ui.message(f"the training process sees a device of {format_size(total)}"
                        + (f", not the {format_size(old)} NVML reported" if old else "")
                        + ": predictions use its size from now on")

    def _warn(self, line: str | None) -> None:
        """Say ``line`` once, and keep it for the report."""
        if line and line not in self.warnings:
            self.warnings.append(line)
            self.ui.message(f"warning: {line}")

    def _take_trl(self, version: str | None, head: str | None, stack_untested: str | None = None) -> None:
        """The command's TRL, read before launching or reported by the training process: a release newer than the
        tested ones (or a stack whose memory no measurement covers) gets one line, and a probe verifies its first
        choice even under --no-probe; the guide models its LM head (the reported one, else the one its release is
        known to have) and its measured error."""
        if version is None or (version, head, stack_untested) == self.trl_seen:
            return
        s = support(version)
        untested = s.untested or bool(stack_untested)
        if untested and (self.trl_seen is None or self.trl_seen[0] != version or self.trl_seen[2] != stack_untested):
            self.ui.message(str(s.message) if s.untested else
                            f"{stack_untested}: the pre-flight stops only far over the device, and a probe verifies "
                            "the first choice")
            if self.o.probe_steps <= 0 and not self.o.replay:
                self.o.probe_steps = 2
        self.trl_seen = (version, head, stack_untested)
        if self.guide is not None:
            self.guide.set_trl(head or head_of(version), untested)

    def _ladder_line(self, why: str) -> None:
        """One line: the ladder oomguard picked by itself, and why."""
        self.ui.message(f"ladder {MULTI_GPU}: {why}, so the rungs that only apply to distributed runs (DeepSpeed's "
                        "buffers, ZeRO stages, offload) come before any trade of quality; --ladder NAME picks another")

    def _teach_guide(self, attempt: Attempt, diag: Diagnosis | None) -> None:
        """The memory model's prediction for the attempt, and what it learns from it (online, and across runs)."""
        if self.guide is None:
            return
        c = self.climb
        knobs = Knobs.from_dict(attempt.knobs)
        est = self.guide.predict(c.facts, knobs)
        if attempt.outcome != Outcome.PREDICTED:  # a stop keeps the figure it was stopped on (a load, perhaps)
            attempt.predicted_bytes = est.peak_bytes if est else None
        # a success teaches the steady state only once an optimizer step has run with its state in place
        if attempt.outcome == Outcome.OK and (attempt.step or 0) < 2:
            return
        peak = attempt.peak_bytes
        if peak and attempt.kind != AttemptKind.RUN:
            peak = int(peak * (1 + PROBE_TAIL))
        self.guide.learn(c.facts, knobs, attempt.outcome, peak, diag.report if diag else None)
        if attempt.outcome == Outcome.OK and attempt.kind != AttemptKind.RUN:
            # what this machine teaches later runs of this model: a probe's worst case, like the prediction's
            self.guide.record(c.facts, knobs, attempt.peak_bytes, attempt.peak_reserved_bytes)
