"""`oomguard knobs` and `oomguard ladders` as a terminal shows them: one row per knob, one line per rung.

The data is the commands' JSON (``vocab.knobtable.describe_knobs``, ``decide.ladder.describe``); this module only
lays it out.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from .render import console


def print_knobs(data: list[dict[str, Any]]) -> None:
    """Each knob's name, type, TRL's default and where it reaches, then what it means."""
    out = console()
    out.print(f"[bold]{'knob':<28} {'type':<27} {'TRL default':<18} reaches[/]", soft_wrap=True)
    for r in data:
        d = r["default"]
        default = "unset" if d is None else ",".join(map(str, d)) if isinstance(d, list) else str(d)
        out.print(f"[cyan]{r['name']:<28}[/] {escape(r['type']):<27} {escape(default):<18} {', '.join(r['reaches'])}",
                  soft_wrap=True)
        out.print(f"    [dim]{escape(r['meaning'])}[/]", soft_wrap=True)


def print_ladders(data: list[dict[str, Any]]) -> None:
    """Each ladder, how it chooses, and its rungs in order."""
    out = console()
    for lad in data:
        chooses = ("the cheapest config for the experiment, the order breaking ties" if lad["choose_by"] == "cost"
                   else "the first config in this order, keeping only what is needed")
        out.print(f"[bold]{lad['name']}[/]  {lad['description']}  [dim](chooses {chooses})[/]", soft_wrap=True)
        for i, r in enumerate(lad["rungs"], 1):
            graded = " (graded)" if r["graded"] else ""
            out.print(f"  {i:>2}. [cyan]{r['remedy']}[/]{graded}  costs {r['cost']}, "
                      f"checkpoint: {r['resume']}  [dim]{r['summary']}[/]", soft_wrap=True)
        if lad["host_rungs"]:
            out.print(f"      host RAM: {', '.join(lad['host_rungs'])}")
        out.print()
