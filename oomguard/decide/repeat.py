"""An OOM that fails where the one before it failed: the same request, in the same phase, with as much memory live,
after rungs that changed the config. Those rungs changed nothing of what failed, so the climb takes them back and
closes their direction (``Climb.take_back``): cutting further the way they cut cannot help either.

Where one of them changed the shapes of the phase that failed (the rows generated or trained at once, the completion
or prompt length, the images' pixels) and the request stayed the same, the request is a fixed allocation: its size
does not follow any shape oomguard can change (a framework's own cache sized by the free memory, a buffer the script
allocates). The climb ends there with that diagnosis, rather than spending the run's signal (generations,
completion length) on cuts that leave it as it is.

>>> from oomguard.vocab.diagnosis import Diagnosis
>>> from oomguard.vocab.oomreport import OOMReport
>>> from oomguard.vocab.records import Attempt
>>> def oom(index, knobs):
...     d = Diagnosis("impossible", "generation", (), OOMReport("cuda", "allocator", "x", requested=11 << 30,
...                                                               allocated=300 << 20, capacity=6 << 30))
...     return Attempt(index, knobs, [], "oom", 1, 1.0), d
>>> cut = {"num_generations": "fewer_generations", "per_device_train_batch_size": "fewer_generations"}
>>> rep = find_repeat(oom(1, {"num_generations": 32, "per_device_train_batch_size": 32}),
...                   oom(2, {"num_generations": 12, "per_device_train_batch_size": 12}), cut)
>>> rep.rungs, rep.shaped, rep.fixed
(('fewer_generations',), ('fewer_generations',), True)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vocab.diagnosis import Diagnosis
from ..vocab.knobs import Knobs
from ..vocab.records import Attempt, AttemptKind, Outcome
from ..vocab.sizes import MiB, format_size

# Two OOMs fail alike where their request and what was live differ by at most this (a message prints two decimals).
SAME = 0.01
# Requests at or below this are the allocator's rounded small blocks (2 MiB, 20 MiB): every such request looks alike,
# so only a larger one can show a fixed allocation (oom.diagnose.SMALL_REQUEST).
SMALL_REQUEST = 20 * MiB
# The kinds of OOM whose request is this process's own tensor (not a neighbour's memory, the host, vLLM's own).
OWN_KINDS = ("shortfall", "small-allocations", "impossible", "fragmentation", "unknown")
# The knobs that set the shapes of each phase (a rung that changes one should change a request of that phase).
GENERATION_SHAPES = ("generation_rows", "max_completion_length", "max_prompt_tokens", "max_pixels")
STEP_SHAPES = ("per_device_train_batch_size", "max_completion_length", "max_prompt_tokens", "max_pixels")
SHAPE_PHASES = {"generation": GENERATION_SHAPES, "scoring": STEP_SHAPES, "forward": STEP_SHAPES,
                "backward": STEP_SHAPES}


@dataclass(frozen=True)
class Repeat:
    """Attempt ``attempt`` failed as attempt ``before`` did (``request`` bytes in ``phase``), after ``rungs``
    changed the config; ``shaped``: those of them that changed the shapes of that phase."""

    before: int
    attempt: int
    request: int | None
    phase: str
    rungs: tuple[str, ...]
    shaped: tuple[str, ...]

    @property
    def fixed(self) -> bool:
        """A request one tensor's size that shapes did not change: a fixed allocation."""
        return bool(self.shaped) and (self.request or 0) > SMALL_REQUEST

    def sized_by(self, engine: str | None, open_rungs: set[str]) -> str | None:
        """The rung of those still open (not in force, not taken back) that sizes this fixed request, if one does:
        in generation under transformers' continuous batching, the request is its paged cache, a share of the free
        memory, which ``paged_cache`` lowers (so the climb goes on to it instead of ending).

        >>> Repeat(1, 2, 11 << 30, "generation", ("micro_batch",), ("micro_batch",)).sized_by(
        ...     "continuous_batching", {"paged_cache", "checkpointing"})
        'paged_cache'
        >>> Repeat(1, 2, 11 << 30, "generation", ("micro_batch",), ("micro_batch",)).sized_by("generate", {"paged_cache"})
        """
        if self.phase == "generation" and engine == "continuous_batching" and "paged_cache" in open_rungs:
            return "paged_cache"
        return None

    def took_back(self) -> str:
        them = ", ".join(self.rungs)
        return (f"took back {them}: attempt {self.attempt} ran out of memory as attempt {self.before} did (the same "
                f"{format_size(self.request)} request in {self.phase}, as much memory live), so {them} changed "
                "nothing of what failed; not tried again")

    def fixed_line(self, predicted: int | None = None) -> str:
        """Why the climb ends: the request is a fixed allocation (``predicted``: the memory model's peak for the
        config, where it has one: then the model does not count it either)."""
        them = ", ".join(self.shaped)
        unknown = (f", which the memory model does not count (it predicted {format_size(predicted)} in all)"
                   if predicted is not None and self.request is not None and predicted < self.request else "")
        return (f"a fixed allocation of {format_size(self.request)} in {self.phase}{unknown}: it stayed the same "
                f"after {them} changed the shapes of {self.phase}, so no shape oomguard can change sizes it, and "
                "cutting generations or completion length would spend the run's signal for nothing; find what "
                "allocates it (a framework's cache sized by the free memory, such as transformers' continuous "
                "batching, or a buffer of the script's own) and size it, or give the run a larger device")


def shapes(k: Knobs, phase: str, world_size: int = 1) -> dict[str, object]:
    """The shapes of ``phase`` under ``k`` (``SHAPE_PHASES``); none for a phase shapes do not set.

    >>> shapes(Knobs(per_device_train_batch_size=4, steps_per_generation=2, max_completion_length=64), "generation")
    {'generation_rows': 8, 'max_completion_length': 64, 'max_prompt_tokens': None, 'max_pixels': None}
    """
    out: dict[str, object] = {}
    for name in SHAPE_PHASES.get(phase, ()):
        out[name] = k.rows_per_device(world_size) if name == "generation_rows" else getattr(k, name)
    return out


def _same(a: int | None, b: int | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= SAME * max(a, b, 1)


def find_repeat(before: tuple[Attempt, Diagnosis], now: tuple[Attempt, Diagnosis], who: dict[str, str],
                world_size: int = 1) -> Repeat | None:
    """Whether ``now`` (an attempt and its diagnosis) ran out of memory as ``before`` did: the same phase, the same
    request and as much live (each within SAME), both of this process's own memory, after rungs changed the config
    (``who``: which rung set each knob in force now). None otherwise, or where nothing but a leak's restart or an
    undo trial lies between them."""
    (a0, d0), (a1, d1) = before, now
    if (a0.outcome != Outcome.OOM or a1.outcome != Outcome.OOM or AttemptKind.MINIMIZE in (a0.kind, a1.kind)
            or d0.kind not in OWN_KINDS or d1.kind not in OWN_KINDS or d0.phase != d1.phase):
        return None
    r0, r1 = d0.report, d1.report
    if not r1.requested or r1.allocated is None or not _same(r0.requested, r1.requested) \
            or not _same(r0.allocated, r1.allocated):
        return None
    k0, k1 = Knobs.from_dict(a0.knobs), Knobs.from_dict(a1.knobs)
    changed = [row.knob for row in k0.diff(k1)]
    rungs = tuple(dict.fromkeys(who[k] for k in changed if who.get(k) not in (None, "lock", "adaptation")))
    if not rungs:
        return None
    before_shapes = shapes(k0, d1.phase, world_size)

    def moves(rung: str) -> bool:  # the rung's own changes alone move a shape of the phase
        mine = {k: getattr(k1, k) for k in changed if who.get(k) == rung}
        try:
            return shapes(k0.replace(**mine), d1.phase, world_size) != before_shapes
        except (ValueError, TypeError, ZeroDivisionError):  # a geometry only whole with the other rungs' knobs
            return False

    return Repeat(a0.index, a1.index, r1.requested, d1.phase, rungs, tuple(r for r in rungs if moves(r)))


__all__ = ["Repeat", "find_repeat", "shapes"]
