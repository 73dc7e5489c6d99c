"""A ladder built on another (``extends = "default"``): the base's rungs in the base's order, with the rungs this file
removes taken out, and the rungs it lists moved, given other parameters or added. So a rung is named once, in the
ladder that first lists it, and every ladder built on that one gets it in its place.

What a ladder file's ``[[rung]]`` (or ``[[host_rung]]``) does, in the file's order, after ``remove = [...]``:

- a rung the ladder already has keeps its place, unless ``after = "name"`` or ``before = "name"`` moves it; its
  parameters are the file's where the file gives any, else the base's;
- a rung it does not have yet goes ``after``/``before`` the rung named, or, with neither, right after the rung the
  file listed before it (the end of the ladder for the file's first).

Without ``extends`` the base is empty, so a file's rungs keep the file's order, as they always did.

>>> from collections import namedtuple
>>> R = namedtuple("R", "name params")
>>> base = [R("a", 1), R("b", 1), R("c", 1)]
>>> [r.name for r in place(base, [Entry(R("c", 1), after="a"), Entry(R("x", 1)), Entry(R("y", 1))], ["b"])]
['a', 'c', 'x', 'y']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PLACES = ("after", "before")


@dataclass(frozen=True)
class Entry:
    """One ``[[rung]]`` of a ladder file: the remedy it names (anything with a ``name``), where it goes (``after`` or
    ``before`` a rung, at most one), and whether the file gave it parameters (a rung the ladder has keeps its own
    otherwise)."""

    item: Any
    after: str | None = None
    before: str | None = None
    params: bool = True


def place(base: Sequence[Any], entries: Sequence[Entry], remove: Sequence[str] = ()) -> list[Any]:
    """``base`` with the rungs named in ``remove`` taken out, then each entry placed (see the module's docstring).
    A ``ValueError`` names the entry (``#2``, 1-based in the file) and what is wrong; the caller adds the file.

    >>> from collections import namedtuple
    >>> R = namedtuple("R", "name params")
    >>> place([R("a", 1)], [Entry(R("b", 1), before="z")])
    Traceback (most recent call last):
      ...
    ValueError: #1: before 'z': the ladder has no rung z here (it has a)
    """
    out = [r for r in base if r.name not in remove]
    previous: str | None = None
    for i, e in enumerate(entries, 1):
        name = e.item.name
        anchor = e.after or e.before
        if anchor is not None:
            names = [r.name for r in out if r.name != name]
            if anchor == name or anchor not in names:
                has = ", ".join(names) or "no rung yet"
                raise ValueError(f"#{i}: {'after' if e.after else 'before'} {anchor!r}: the ladder has no rung "
                                 f"{anchor} here (it has {has})")
        at = next((j for j, r in enumerate(out) if r.name == name), None)
        item = e.item if at is None or e.params else out[at]
        if at is not None and anchor is None:
            out[at] = item  # its place kept, its parameters the file's
        else:
            if at is not None:
                del out[at]
            if anchor is not None:
                j = next(j for j, r in enumerate(out) if r.name == anchor)
                out.insert(j + 1 if e.after else j, item)
            elif previous is not None:
                out.insert(next(j for j, r in enumerate(out) if r.name == previous) + 1, item)
            else:
                out.append(item)
        previous = name
    return out


__all__ = ["PLACES", "Entry", "place"]
