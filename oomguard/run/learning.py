"""What ``oomguard run`` hears from the training process's events, handed to the one owner of the climb's decisions
(``oomguard.decide.conductor``): the user's own config and the run's facts, the TRL it runs and the device it sees,
the construction points it passed through, a config that cannot learn (one warning). The decisions these feed (the
ladder, the probe count, the judge's device) are the conductor's; this module only reads the events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..decide.conductor import Conductor
from ..decide.experiment import precision_warning
from ..vocab.events import (
    Adapted,
    ChildEvent,
    CodeSeen,
    DatasetSeen,
    DeviceMeasured,
    ModelSeen,
    OtherEvent,
    ProcessStarted,
    ProtocolError,
    Ran,
    strict,
)
from ..vocab.facts import RunFacts
from ..vocab.knobs import KNOB_NAMES, Knobs


def take_events(conductor: Conductor, events: Sequence[ChildEvent], *, sized_by_nvml: bool,
                say: Callable[[str], None], warn: Callable[[str], None]) -> dict[str, Any] | None:
    """Give the conductor what the training process reported (the script's own values, first report wins, and the
    run's facts); ``say`` what that decides, ``warn`` once of what the user should fix. Returns the device's context
    as the training process measured it (event ``device``), for the report, where it reported one.

    >>> from oomguard.decide.climb import Climb
    >>> from oomguard.decide.ladder import load_ladder
    >>> from oomguard.decide.conductor import Policy
    >>> c = Conductor(Climb(load_ladder("default")), None, Policy(), launched=True)
    >>> take_events(c, [CodeSeen(point="config", observed={"num_generations": 4})], sized_by_nvml=False,
    ...             say=print, warn=print)
    >>> c.climb.original().num_generations, sorted(c.reached)
    (4, ['config'])
    """
    c = conductor.climb
    facts = c.facts
    device: dict[str, Any] | None = None
    reached = conductor.reached if conductor.reached is not None else set()
    for ev in events:
        if isinstance(ev, CodeSeen):
            reached.add(ev.point)
            c.observe(ev.observed, point=ev.point)
            c.resolve(ev.resolved)
            facts = facts.replace(**_known_facts(ev.facts, warn))
            if ev.world_size:
                facts = facts.replace(world_size=ev.world_size)
        elif isinstance(ev, DatasetSeen):
            facts = facts.replace(prompt_tokens_max=ev.prompt_tokens_max or facts.prompt_tokens_max,
                                  prompt_tokens_p95=ev.prompt_tokens_p95 or facts.prompt_tokens_p95,
                                  dataset_rows=ev.rows or facts.dataset_rows)
        elif isinstance(ev, Ran):
            c.resolve(ev.resolved)
        elif isinstance(ev, Adapted):
            c.adapt(ev.knob, ev.value, ev.why)
        elif isinstance(ev, ModelSeen):
            reached.update(("model", *ev.reaches))  # before a load: points the script passes after it
            facts = facts.replace(model_config=ev.config or facts.model_config)
        elif isinstance(ev, OtherEvent):
            _unknown("event", ev.kind, warn)
        elif isinstance(ev, DeviceMeasured) and ev.context_bytes:
            device = {k: getattr(ev, k) for k in ("context_bytes", "measured_bytes", "how", "allocator_bytes",
                                                  "final")}
            if conductor.judge is not None and ev.final:  # --gpu-memory: the context really held
                conductor.judge.set_context(int(ev.context_bytes))
    lines = conductor.take_facts(facts)
    if (line := conductor.take_device(c.facts.device_total, sized_by_nvml)) is not None:
        say(line)
    # measured on the loaded weights: the user's own config may not learn
    if c.facts.bf16_moving is not None and (warning := precision_warning(c.original(), c.facts)):
        ran = c.effective()[0]
        if (ran.dtype, ran.bf16) != (c.original().dtype, c.original().bf16):  # a lock or a rung set another precision
            warning = f"your own config, not the precision this run uses: {warning}"
        warn(warning)
    for line in lines:
        say(line)
    return device


def ran_report(events: Sequence[ChildEvent]) -> Ran | None:
    """What the attempt's main training process last reported it runs (rank 0, or the process without a rank; a
    helper that multiprocessing started is never one), or None where it reported nothing.

    >>> ran_report([Ran(knobs={"num_generations": 4}, pid=1, rank=1), Ran(knobs={"num_generations": 8}, pid=2, rank=0)]).knobs
    {'num_generations': 8}
    """
    helpers = {e.pid for e in events if isinstance(e, ProcessStarted) and e.helper}
    said = [e for e in events if isinstance(e, Ran) and e.pid not in helpers]
    main = [e for e in said if e.rank in (None, 0)] or said
    return main[-1] if main else None


def knobs_ran(knobs: Knobs, events: Sequence[ChildEvent]) -> Knobs:
    """``knobs`` (the config the climb set for an attempt) with the values its training process reported it ran on
    top: what the attempt's record, the report's stable config and the lock say ran.

    >>> k = knobs_ran(Knobs(num_generations=4, max_completion_length=64), [Ran(knobs={"num_generations": 8})])
    >>> k.num_generations, k.max_completion_length
    (8, 64)
    """
    ran = ran_report(events)
    if ran is None:
        return knobs
    reported = {k: v for k, v in ran.knobs.items() if k in KNOB_NAMES}
    plain = Knobs.from_dict(reported)
    return knobs.replace(**{k: getattr(plain, k) for k in reported})


def _known_facts(reported: dict[str, Any], warn: Callable[[str], None]) -> dict[str, Any]:
    """The facts of ``reported`` that RunFacts holds; another is oomguard's own mistake (the training process and the
    supervisor are the same version): an error under OOMGUARD_STRICT_EVENTS, else said once."""
    known = RunFacts.__dataclass_fields__
    for k in reported:
        if k not in known:
            _unknown("fact", k, warn)
    return {k: v for k, v in reported.items() if k in known}


def _unknown(what: str, name: str, warn: Callable[[str], None]) -> None:
    if strict():
        raise ProtocolError(f"the training process reported the {what} {name!r}, which this supervisor does not know")
    warn(f"the training process reported the {what} {name!r}, which this supervisor does not know (ignored; "
         "oomguard's training process and supervisor should be the same version: please report it)")


__all__ = ["knobs_ran", "ran_report", "take_events"]
