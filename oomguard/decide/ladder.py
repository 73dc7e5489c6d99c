"""Ladders: an ordered list of remedies read from TOML, climbed one rung per OOM.

The ladder is cumulative: a rung once climbed stays in force. On each OOM the ladder is read from the top, and the
first rung that can help this diagnosis, is not already in force and changes something is climbed. Graded rungs
(shorter sequences, fewer generations) may step again on later passes, down to their floors. Rungs passed over are
reported with the reason.

With the memory model (the default), a ladder also says how the config is chosen (``choose_by``): ``cost`` (the
default) picks, from every rung of the ladder, the config predicted to fit whose changes cost the experiment least
(``oomguard.decide.choose.cheapest``), the ladder's order only breaking ties; ``order`` climbs the ladder's prefix to
the first config predicted to fit and keeps only what is needed below it (``oomguard.decide.choose.choose``), so the
ladder's order is the preference. ``--no-predict`` climbs one rung per OOM in the ladder's order either way.

>>> ladder = load_ladder("default")
>>> [r.name for r in ladder.rungs][:4]
['expandable_segments', 'empty_cache', 'eval_batch', 'micro_batch']
>>> from oomguard.vocab.knobs import TRL_DEFAULTS
>>> step = ladder.next(Context(knobs=TRL_DEFAULTS))
>>> step.remedy.name, step.knobs.expandable_segments
('expandable_segments', True)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

try:
    import tomllib  # type: ignore[import-not-found]  # mypy checks as Python 3.10, which lacks it
except ImportError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

from ..strategies import COST_CLASSES, LADDER_DIR, Context, Remedy, cost_rank, make_remedy
from ..vocab.facts import RunFacts
from ..vocab.knobs import Knobs
from .extends import PLACES, Entry, place

# How the memory model chooses a config from a ladder: by what the changes cost the experiment, or the ladder's order.
CHOOSE_BY = ("cost", "order")


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
    choose_by: str = "cost"  # cost | order: how the memory model chooses (see the module's docstring)

    def rungs_for(self, ctx: Context) -> tuple[Remedy, ...]:
        d = ctx.diagnosis
        return self.host_rungs if d is not None and d.kind == "host-ram" else self.rungs

    def blocks(self, rungs: Sequence[Remedy]) -> list[list[Remedy]]:
        """The groups whose passes ``next`` finishes before it moves on: by cost, each run of rungs of one cost
        class in the ladder's order (so a graded micro-batch split steps again before a costlier class is tried);
        by order, the whole ladder (every rung's first pass, then the graded rungs' second, ...).

        >>> [[r.name for r in b] for b in load_ladder("default").blocks(load_ladder("default").rungs)][:2]
        [['expandable_segments', 'empty_cache', 'eval_batch'], ['micro_batch', 'generation_rounds', 'checkpointing', 'liger_kernel', 'vllm_memory', 'paged_cache', 'deepspeed_buffers']]
        """
        if self.choose_by != "cost":
            return [list(rungs)]
        out: list[list[Remedy]] = []
        for r in rungs:
            if out and out[-1][-1].cost == r.cost:
                out[-1].append(r)
            else:
                out.append([r])
        return out

    def next(self, ctx: Context) -> Step | Exhausted:
        """The next rung to climb from ``ctx.knobs``, or Exhausted: in the ladder's order, a block at a time
        (``blocks``), each block's first passes before its graded rungs' later ones."""
        skipped: dict[str, str] = {}
        world = ctx.facts.world_size
        main = self.rungs_for(ctx)
        blocks = self.blocks(main) if main is self.rungs else [list(main)]
        for block, pass_no in ((b, p) for b in blocks for p in range(1, self.max_passes + 1)):
            for r in block:
                if ctx.used.get(r.name, 0) >= pass_no:
                    continue
                if pass_no > 1 and not r.graded:
                    continue
                if r.foreign(ctx):  # never a candidate for this kind of run: passed over without a word
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

    def only(self, names: Collection[str]) -> Ladder:
        """This ladder with only the rungs named (in its order; host rungs kept)."""
        return replace(self, rungs=tuple(r for r in self.rungs if r.name in names))

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


    def climb_by_cost(self, ctx: Context, fits: Callable[[Knobs], bool]) -> tuple[list[Step], Exhausted | None]:
        """Climb the ladder's rungs of the cheapest cost class, then those of the next class too, and so on (each in
        the ladder's order), until ``fits(knobs)`` holds; then the rest of that last class: the ceiling below which
        ``oomguard.decide.cheapest`` chooses. Every rung that can apply, up to the costliest class needed, is in
        force at its strongest.

        >>> from oomguard.vocab.knobs import TRL_DEFAULTS
        >>> k = TRL_DEFAULTS.replace(learning_rate=1e-4)  # bf16 weights keep updates of this size
        >>> steps, _ = load_ladder("default").climb_by_cost(Context(knobs=k), lambda k: k.dtype == "bfloat16")
        >>> [s.remedy.cost for s in steps][-1], steps[-1].remedy.name
        ('precision', 'bf16_load')
        """
        steps: list[Step] = []
        used = dict(ctx.used)
        cur = ctx
        passed: dict[str, str] = {}  # why rungs of the classes climbed in full were passed over
        for cost in COST_CLASSES:
            tier = self.only([r.name for r in self.rungs if cost_rank(r.cost) <= cost_rank(cost)])
            if not tier.rungs:
                continue
            if cost_rank(cost) <= cost_rank("speed"):
                # a graded change that costs only time goes to its floor before anything that costs more is tried
                # (the choice below relaxes it back as far as the device allows); the ladder's max_passes bounds
                # the cuts of a blind climb, not what the memory model may weigh
                tier = replace(tier, max_passes=max(tier.max_passes, SPEED_PASSES))
            taken, ran_out = tier.climb_to_fit(cur, fits)
            if taken and passed:
                taken[0] = replace(taken[0], skipped=tuple({**passed, **dict(taken[0].skipped)}.items()))
                passed = {}
            for s in taken:
                used[s.remedy.name] = used.get(s.remedy.name, 0) + 1
            steps += taken
            if taken:
                cur = Context(knobs=taken[-1].knobs, facts=cur.facts, diagnosis=cur.diagnosis, used=dict(used),
                              read_fields=cur.read_fields, subject=cur.subject, refused=cur.refused)
            if ran_out is None:
                # this class is the costliest needed: its other rungs too, at their strongest, so that the choice
                # below can weigh each of them alone (the fewest and smallest changes of the class)
                rest, _ = tier.climb_to_fit(cur, lambda _k: False)
                return steps + rest, None
            passed.update(ran_out.skipped)
        return steps, Exhausted(tuple(passed.items()))


MULTI_GPU = "multi-gpu"  # the ladder a distributed run gets when --ladder is not given


def distributed_reason_of(facts: RunFacts) -> str | None:
    """Why a run's facts (the training process's report, or `oomguard plan`'s options) make it distributed, so that
    it takes the multi-gpu ladder when no ladder is named.

    >>> distributed_reason_of(RunFacts(world_size=4))
    'the training process reported 4 ranks'
    >>> distributed_reason_of(RunFacts(deepspeed="accelerate")), distributed_reason_of(RunFacts()) is None
    ("the training process runs DeepSpeed (its config from accelerate's plugin)", True)
    """
    if facts.deepspeed:
        src = {"accelerate": "its config from accelerate's plugin", "GRPOConfig": "GRPOConfig.deepspeed"}
        return f"the training process runs DeepSpeed ({src.get(facts.deepspeed, facts.deepspeed)})"
    if facts.fsdp:
        return "the training process runs FSDP (GRPOConfig.fsdp)"
    if facts.world_size > 1:
        return f"the training process reported {facts.world_size} ranks"
    return None


def available_ladders() -> dict[str, Path]:
    """Ladder name -> file, for the ladders shipped with oomguard."""
    return {p.stem: p for p in sorted(LADDER_DIR.glob("*.toml"))}


def load_ladder(name_or_path: str | Path, *, chain: tuple[Path, ...] = ()) -> Ladder:
    """A shipped ladder by name (``default``, ``quality-first``, ...) or a ladder TOML file by path. ``chain``: the
    files that extend this one, being read (a ladder that extends itself, through others or not, is an error)."""
    path = _ladder_path(name_or_path)
    if path.resolve() in chain:
        files = " -> ".join(p.name for p in (*chain, path.resolve()))
        raise LadderError(f"{chain[0]}: extends itself ({files})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise LadderError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    except tomllib.TOMLDecodeError as e:
        raise LadderError(f"{path}: not valid TOML ({e})") from None
    return ladder_from_dict(data, path=path, chain=chain)


def _ladder_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """The file of a shipped ladder's name, or of a path (relative to ``relative_to``, the folder of the ladder that
    extends it, when given)."""
    text = str(name_or_path)
    shipped = available_ladders()
    if text in shipped:
        return shipped[text]
    path = Path(text).expanduser()
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if not path.exists():
        raise LadderError(f"no ladder named {text!r}: use one of {', '.join(shipped)} or a path to a .toml file")
    if path.is_dir():
        raise LadderError(f"{path}: is a directory; give a ladder .toml file")
    return path


# How many passes a graded rung of cost class speed (or none) may take in a climb by cost: enough to halve a
# micro-batch or a generation round from 64 rows down to one.
SPEED_PASSES = 7


# The keys a ladder file may have at its top level; anything else is a mistake worth one line (a misspelt
# ``choose_bye`` would otherwise be ignored, and the ladder chosen by another rule than the one written).
LADDER_KEYS = ("name", "description", "extends", "remove", "choose_by", "max_passes", "rung", "host_rung")


def _unknown(key: str, known: Sequence[str]) -> str:
    """``unknown key 'x'``, with the closest known key where one is close."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(known)}")


def ladder_from_dict(data: Mapping[str, Any], *, path: Path | None = None, chain: tuple[Path, ...] = ()) -> Ladder:
    """A Ladder from a ladder file's content, checked against the schema: the top-level keys (``LADDER_KEYS``), their
    types, and each rung's remedy, typed parameters (``oomguard.strategies.params``) and place (``after``,
    ``before``). A ladder that ``extends`` another is the base's rungs with this one's removed, moved and added
    (``oomguard.decide.extends``); it takes the base's ``choose_by`` and ``max_passes`` unless it gives its own. Every
    problem is a LadderError of one line; a rung whose cost within its class is not declared (oomguard's own bug,
    ``Remedy.undeclared_cost``) a LadderBug.

    >>> ladder_from_dict({"choose_bye": "order", "rung": [{"remedy": "lora"}]})
    Traceback (most recent call last):
      ...
    oomguard.decide.ladder.LadderError: unknown key 'choose_bye' (did you mean 'choose_by'?)
    >>> ladder_from_dict({"rung": [{"remedy": "lora", "r": -4}]})
    Traceback (most recent call last):
      ...
    oomguard.decide.ladder.LadderError: rung #1: remedy 'lora': r must be an integer between 1 and 4096 (the LoRA rank), not -4
    >>> mine = ladder_from_dict({"extends": "default", "remove": ["bf16_load"], "rung": [{"remedy": "lora", "r": 8,
    ...                          "before": "micro_batch"}]})
    >>> [r.name for r in mine.rungs][:5], mine.rungs[3].p["r"], mine.choose_by
    (['expandable_segments', 'empty_cache', 'eval_batch', 'lora', 'micro_batch'], 8, 'cost')
    """
    where = f"{path}: " if path else ""
    for key in data:
        if key not in LADDER_KEYS:
            raise LadderError(f"{where}{_unknown(key, LADDER_KEYS)}")
    for key in ("name", "description", "extends"):
        if key in data and not isinstance(data[key], str):
            raise LadderError(f"{where}{key} must be a string, not {data[key]!r}")
    remove = data.get("remove", [])
    if not isinstance(remove, list) or not all(isinstance(n, str) for n in remove):
        raise LadderError(f"{where}remove must be a list of rung names, not {remove!r}")
    base = None
    if "extends" in data:
        here = (path.resolve(),) if path else ()
        try:
            base_path = _ladder_path(data["extends"], path.parent if path else None)
        except LadderError as e:
            raise LadderError(f"{where}extends: {e}") from None
        base = load_ladder(base_path, chain=(*chain, *here))
    elif remove:
        raise LadderError(f"{where}remove takes rungs out of the ladder this one extends, and it extends none "
                          "(extends = \"default\", say)")
    if base is not None:
        gone = [n for n in remove if n not in {r.name for r in (*base.rungs, *base.host_rungs)}]
        if gone:
            raise LadderError(f"{where}remove names {', '.join(gone)}, which {base.name} does not have")

    def rungs(key: str) -> tuple[Remedy, ...]:
        entries = []
        items = data.get(key, [])
        if not isinstance(items, list):
            raise LadderError(f"{where}[[{key}]] must be an array of tables")
        for i, item in enumerate(items, 1):
            if not isinstance(item, dict) or "remedy" not in item:
                raise LadderError(f"{where}{key} #{i} needs a `remedy = \"name\"` line")
            places = {k: item[k] for k in PLACES if k in item}
            if len(places) > 1 or not all(isinstance(v, str) for v in places.values()):
                raise LadderError(f"{where}{key} #{i}: give one rung name, after = \"name\" or before = \"name\", "
                                  f"not {places!r}")
            params = {k: v for k, v in item.items() if k != "remedy" and k not in PLACES}
            try:
                remedy = make_remedy(str(item["remedy"]), **params)
            except (KeyError, ValueError) as e:
                raise LadderError(f"{where}{key} #{i}: {e.args[0] if e.args else e}") from None
            if remedy.name in remove:
                raise LadderError(f"{where}{key} #{i}: {remedy.name} is listed and removed")
            entries.append(Entry(remedy, places.get("after"), places.get("before"), bool(params)))
        names = [e.item.name for e in entries]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise LadderError(f"{where}remedy listed twice: {', '.join(sorted(dup))} (graded rungs step again on "
                              "their own)")
        try:
            out = tuple(place(getattr(base, f"{key}s", ()), entries, remove))
        except ValueError as e:
            raise LadderError(f"{where}{key} {e}") from None
        for r in out:
            if (bug := r.undeclared_cost()) is not None:
                raise LadderBug(bug)
        return out

    main = rungs("rung")
    if not main:
        raise LadderError(f"{where}a ladder needs at least one [[rung]]")
    passes = data.get("max_passes", base.max_passes if base else 3)
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise LadderError(f"{where}max_passes must be a positive integer, not {passes!r}")
    choose_by = data.get("choose_by", base.choose_by if base else "cost")
    if choose_by not in CHOOSE_BY:
        raise LadderError(f"{where}choose_by must be one of {', '.join(repr(c) for c in CHOOSE_BY)}, not {choose_by!r}")
    name = str(data.get("name") or (path.stem if path else "custom"))
    return Ladder(name=name, description=str(data.get("description", "")), rungs=main, host_rungs=rungs("host_rung"),
                  max_passes=passes, path=path, choose_by=choose_by)


def describe(ladders: Sequence[Ladder]) -> list[dict[str, Any]]:
    """Plain data for `oomguard ladders`."""
    return [
        {
            "name": lad.name,
            "description": lad.description,
            "path": str(lad.path) if lad.path else None,
            "choose_by": lad.choose_by,
            "rungs": [{"remedy": r.name, "cost": r.cost, "trades": r.trades, "resume": r.resume, "graded": r.graded,
                       "summary": r.summary} for r in lad.rungs],
            "host_rungs": [r.name for r in lad.host_rungs],
        }
        for lad in ladders
    ]
