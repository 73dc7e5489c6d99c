"""Ladders: an ordered list of remedies read from TOML, climbed one rung per OOM.

The ladder is cumulative: a rung once climbed stays in force. On each OOM the ladder is read from the top, and the
first rung that can help this diagnosis, is not already in force and changes something is climbed. Graded rungs
(shorter sequences, fewer generations) may step again on later passes, down to their floors. Rungs passed over are
reported with the reason.

>>> ladder = load_ladder("default")
>>> [r.name for r in ladder.rungs][:3]
['expandable_segments', 'empty_cache', 'shorter_sequences']
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> step = ladder.next(Context(knobs=TRL_DEFAULTS))
>>> step.remedy.name, step.knobs.expandable_segments
('expandable_segments', True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from ..strategies import LADDER_DIR, Context, Remedy, make_remedy
from ..vocab.knobs import Knobs


class LadderError(ValueError):
    """A ladder file that cannot be used; the message names the file and the problem."""


class LadderBug(RuntimeError):
    """A rung produced knobs that GRPO rejects: a bug in oomguard, never the user's fault."""


@dataclass(frozen=True)
class Step:
    """One rung climbed: the remedy, the knobs it produced, the pass, and the rungs passed over on the way."""

    remedy: Remedy
    knobs: Knobs
    pass_no: int = 1
    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Exhausted:
    """No rung can help any more; ``skipped`` says why each was passed over."""

    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Ladder:
    name: str
    description: str
    rungs: tuple[Remedy, ...]
    host_rungs: tuple[Remedy, ...] = ()
    max_passes: int = 3
    path: Path | None = field(default=None, compare=False)

    def rungs_for(self, ctx: Context) -> tuple[Remedy, ...]:
        d = ctx.diagnosis
        return self.host_rungs if d is not None and d.kind == "host-ram" else self.rungs

    def next(self, ctx: Context) -> Step | Exhausted:
        """The next rung to climb from ``ctx.knobs``, or Exhausted."""
        skipped: dict[str, str] = {}
        world = ctx.facts.world_size
        for pass_no in range(1, self.max_passes + 1):
            for r in self.rungs_for(ctx):
                if ctx.used.get(r.name, 0) >= pass_no:
                    continue
                if pass_no > 1 and not r.graded:
                    continue
                reason = (ctx.refused.get(r.name) or r.helps(ctx.diagnosis) or r.unread(ctx) or r.missing(ctx)
                          or r.blocked(ctx))
                if reason is None:
                    new = r.apply(ctx)
                    reason = "it would change nothing" if new == ctx.knobs else r.lacking(ctx, new)
                    if reason is None:
                        problems = new.validate(world)
                        if problems:
                            raise LadderBug(f"rung {r.name} produced knobs GRPO rejects: {'; '.join(problems)}")
                        return Step(r, new, pass_no, tuple(skipped.items()))
                skipped.setdefault(r.name, reason)
        return Exhausted(tuple(skipped.items()))

    def climb_to_fit(self, ctx: Context, fits: Callable[[Knobs], bool]) -> tuple[list[Step], Exhausted | None]:
        """Climb rung after rung from ``ctx`` (same diagnosis) until ``fits(knobs)`` holds.

        Used by the memory model to go straight to the first prefix of the ladder predicted to fit. Returns the steps
        taken, and Exhausted if the ladder ran out before anything fitted.
        """
        steps: list[Step] = []
        used = dict(ctx.used)
        cur = ctx
        while True:
            step = self.next(cur)
            if isinstance(step, Exhausted):
                return steps, step
            steps.append(step)
            used[step.remedy.name] = used.get(step.remedy.name, 0) + 1
            cur = Context(knobs=step.knobs, facts=cur.facts, diagnosis=cur.diagnosis, used=used,
                          read_fields=cur.read_fields, subject=cur.subject, refused=cur.refused)
            if fits(step.knobs):
                return steps, None


def available_ladders() -> dict[str, Path]:
    """Ladder name -> file, for the ladders shipped with oomguard."""
    return {p.stem: p for p in sorted(LADDER_DIR.glob("*.toml"))}


def load_ladder(name_or_path: str | Path) -> Ladder:
    """A shipped ladder by name (``default``, ``quality-first``, ...) or a ladder TOML file by path."""
    text = str(name_or_path)
    shipped = available_ladders()
    if text in shipped:
        path = shipped[text]
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise LadderError(f"no ladder named {text!r}: use one of {', '.join(shipped)} or a path to a .toml file")
        if path.is_dir():
            raise LadderError(f"{path}: is a directory; give a ladder .toml file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise LadderError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    except tomllib.TOMLDecodeError as e:
        raise LadderError(f"{path}: not valid TOML ({e})") from None
    return ladder_from_dict(data, path=path)


def ladder_from_dict(data: Mapping[str, Any], *, path: Path | None = None) -> Ladder:
    where = f"{path}: " if path else ""

    def rungs(key: str) -> tuple[Remedy, ...]:
        out = []
        items = data.get(key, [])
        if not isinstance(items, list):
            raise LadderError(f"{where}[[{key}]] must be an array of tables")
        for i, item in enumerate(items, 1):
            if not isinstance(item, dict) or "remedy" not in item:
                raise LadderError(f"{where}{key} #{i} needs a `remedy = \"name\"` line")
            params = {k: v for k, v in item.items() if k != "remedy"}
            try:
                out.append(make_remedy(str(item["remedy"]), **params))
            except (KeyError, ValueError) as e:
                raise LadderError(f"{where}{key} #{i}: {e.args[0] if e.args else e}") from None
        return tuple(out)

    main = rungs("rung")
    if not main:
        raise LadderError(f"{where}a ladder needs at least one [[rung]]")
    names = [r.name for r in main]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise LadderError(f"{where}remedy listed twice: {', '.join(sorted(dup))} (graded rungs step again on their own)")
    passes = data.get("max_passes", 3)
    if not isinstance(passes, int) or passes < 1:
        raise LadderError(f"{where}max_passes must be a positive integer")
    name = str(data.get("name") or (path.stem if path else "custom"))
    return Ladder(name=name, description=str(data.get("description", "")), rungs=main, host_rungs=rungs("host_rung"),
                  max_passes=passes, path=path)


def describe(ladders: Sequence[Ladder]) -> list[dict[str, Any]]:
    """Plain data for `oomguard ladders`."""
    return [
        {
            "name": lad.name,
            "description": lad.description,
            "path": str(lad.path) if lad.path else None,
            "rungs": [{"remedy": r.name, "trades": r.trades, "resume": r.resume, "graded": r.graded,
                       "summary": r.summary} for r in lad.rungs],
            "host_rungs": [r.name for r in lad.host_rungs],
        }
        for lad in ladders
    ]
