"""Terminal output (rich). Imported only by commands that print, so `oomguard --help` stays fast."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..vocab.distributed import DS_DEFAULTS
from ..vocab.sizes import format_size

_BACKEND_NAMES = {"cuda": "CUDA", "hip": "HIP (ROCm)", "xpu": "XPU", "mps": "MPS", "npu": "NPU", "cpu": "CPU allocator",
                  "host": "host RAM", "vllm": "vLLM"}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def note(message: str) -> None:
    """A one-line message to stderr: ``oomguard: <message>``."""
    Console(stderr=True, highlight=False).print(f"[bold yellow]oomguard:[/] {escape(message)}", soft_wrap=True)


def size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def findings(out: Console, items: Sequence[dict[str, Any]]) -> None:
    for i, f in enumerate(items):
        if i:
            out.print()
        where = f"{f['source']}" + (f":{f['line']}" if f.get("line") else "")
        head = Text()
        head.append(where, style="bold")
        head.append(f"  {_BACKEND_NAMES.get(f['backend'], f['backend'])} out of memory", style="bold red")
        head.append(f" · {f['kind']}", style="bold")
        if f.get("phase") and f["phase"] != "unknown":
            head.append(f" · during {f['phase']}")
        if f.get("rank") is not None:
            head.append(f" · rank {f['rank']}")
        out.print(head)
        figs = [
            ("requested", f.get("requested_bytes")), ("capacity", f.get("capacity_bytes")),
            ("free", f.get("free_bytes")), ("allocated", f.get("allocated_bytes")),
            ("reserved-unallocated", f.get("reserved_unallocated_bytes")), ("this process", f.get("process_bytes")),
        ]
        shown = [f"{k} {size(v)}" for k, v in figs if v is not None]
        if f.get("other_processes"):
            shown.append("others " + ", ".join(f"pid {p['pid']} {size(p['bytes'])}" for p in f["other_processes"]))
        if shown:
            out.print("  " + " · ".join(shown), style="dim")
        if f.get("evidence"):
            out.print("  [bold]Why[/]")
            for e in f["evidence"]:
                out.print(f"   • {escape(e)}", soft_wrap=True)
        if f.get("remedies"):
            out.print("  [bold]What to do[/]")
            for n, r in enumerate(f["remedies"], 1):
                frees = f" [green](frees ~{size(r['frees_bytes'])})[/]" if r.get("frees_bytes") else ""
                out.print(f"   {n}. [cyan]{r['name']}[/]: {escape(r['reason'])}{frees}", soft_wrap=True)


def snapshots(out: Console, items: Sequence[dict[str, Any]]) -> None:
    for s in items:
        out.print()
        out.print(Text(f"{s['source']}  memory snapshot", style="bold"))
        t = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
        for c in ("pool", "segments", "reserved", "allocated", "unallocated"):
            t.add_column(c, justify="right" if c != "pool" else "left")
        for name, p in s["pools"].items():
            t.add_row(name, str(p["segments"]), size(p["reserved"]), size(p["allocated"]),
                      size(p["reserved"] - p["allocated"]))
        out.print(t)
        out.print(f"  largest free block {size(s['largest_free_block_bytes'])} of "
                  f"{size(s['reserved_unallocated_bytes'])} reserved-unallocated "
                  f"(fragmentation {s['fragmentation']:.0%})")
        if s["largest_blocks"]:
            out.print("  [bold]Largest live blocks[/]")
            for b in s["largest_blocks"][:5]:
                fr = b["frame"]
                where = f"{fr['filename']}:{fr['line']} in {fr['name']}" if fr else "(no Python frame recorded)"
                out.print(f"   {size(b['size']):>11}  {escape(where)}", soft_wrap=True)
        if s["oom_events"]:
            out.print(f"  {len(s['oom_events'])} OOM event(s) in the trace")


def trends(out: Console, items: Sequence[dict[str, Any]]) -> None:
    """Each memory trace ``oomguard analyze`` read (``AnalyzeResult.trends``) and what it says."""
    for t in items:
        out.print()
        who = f", process {t['pid']}" if t.get("pid") else ""
        out.print(Text(f"{t['source']}:{t.get('first_line') or 1}  memory trace, {t['steps']} steps "
                       f"({t.get('first_step')} to {t.get('last_step')} read after settling){who}", style="bold"))
        for e in t.get("evidence") or ["Nothing grows: no leak, no fragmentation growth, no long sample."]:
            out.print(f"   • {escape(e)}", soft_wrap=True)


def diff_table(out: Console, rows: Sequence[dict[str, Any]], title: str = "What oomguard changed",
               stable: bool = True) -> None:
    """The diff of a run: each knob, the user's value, the value it ends with and the rung that set it. Where nothing
    was stable (``stable`` False), the column holds the last config tried, and says so."""
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in ("knob", "original", "stable" if stable else "last tried", "remedy"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["knob"], NOT_SEEN if r.get("unseen") else _v(r["from"], r["knob"]), _v(r["to"]),
                  r.get("action") or r.get("remedy") or "")
    out.print(t)


# the original value of a knob the command never said (it stopped before the point that sets it)
NOT_SEEN = "not seen yet"


def _v(v: Any, knob: str = "") -> str:
    if v is None and knob in DS_DEFAULTS:  # a DeepSpeed size the config left out
        return f"DeepSpeed's default ({DS_DEFAULTS[knob]:,})"
    if v is None:
        return "unset"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return str(v)


def is_tty() -> bool:
    return sys.stdout.isatty()


_TERMS = [
    ("weights", "weights"), ("reference", "reference model"), ("gradients", "gradients"),
    ("optimizer", "optimizer state"), ("activations", "activations"), ("logits", "log-prob tiles (LM head)"),
    ("kv_cache", "generation KV cache"), ("vllm", "vLLM reservation"), ("overhead", "context + fragmentation"),
]


# The verdict `oomguard plan` prints, as `oomguard run` acts on it (``memory.estimate.verdict``).
_VERDICT = {"run": "[green]sure to fit[/]", "probe": "[yellow]probe first[/]", "stop": "[red]predicted not to fit[/]"}
# How `oomguard plan` says what `oomguard run` would do with a config (``Prediction.launches``).
_FIRST = {"run": "one launch, the real run (the memory model is sure this config fits)",
          "probe": "a short worst-case probe first (it may fit; only a probe can tell), then the real run",
          "stop": "stopped by the pre-flight before it generates (predicted not to fit), then the choice above"}
_THEN = {"run": "its real run at once (sure to fit)", "probe": "probed first, then its real run",
         "stop": "stopped by the pre-flight too (predicted not to fit), and the climb goes on"}
_SIDE = {"vllm": "vLLM's share", "training": "training"}


def _card_verdict(r: dict[str, Any]) -> str:
    if r["verdict"] == "stop":
        return f"[red]no[/], {_SIDE[r['short']['side']]} {size(r['short']['bytes'])} short"
    return "[green]sure[/]" if r["verdict"] == "run" else "[yellow]probe first[/]"


def _split_cells(r: dict[str, Any]) -> list[str]:
    """The colocated split's cells: the range where vLLM and training both fit, and the value run launches with."""
    rng = r["fit_range"]
    if rng is None:
        fits = f"none: {_SIDE[r['fit_short']['side']]} {size(r['fit_short']['bytes'])} short"
    elif r["fit_knob"] == "vllm_gpu_memory_utilization":
        fits = f"{rng[0]:.2f} to {rng[1]:.2f}"
    else:
        fits = f"up to {rng[1]:,}"
    run = r["run_value"]
    return [fits, "—" if run is None else f"{run:.2f}" if isinstance(run, float) else f"{run:,}"]


def cards_table(out: Console, rows: list[dict[str, Any]], model: str, fit: str | None,
                lines: Sequence[str] = ()) -> None:
    """One row per card (``oomguard plan --gpu A,B,...``): the config's predicted peak, the verdict `oomguard run`
    acts on, the largest ``fit`` that fits (``--fit``; for vLLM's share, the range where vLLM and training both fit
    and the value run launches with), and what ``oomguard run`` would change where it stops the config; with the TRL
    ``lines`` (whose defaults fill the config) before it and what the model does not count after it, as the
    one-card answer says them."""
    for line in lines:
        out.print(escape(line), soft_wrap=True)
    out.print(f"[bold]{model}[/]: one row per card, at the settings given")
    split = fit in ("vllm_gpu_memory_utilization", "vllm_max_model_length")
    t = Table(header_style="bold")
    t.add_column("card", justify="right")
    t.add_column("peak", justify="right")
    t.add_column("verdict")
    if split:
        t.add_column("vLLM's share: both fit" if fit == "vllm_gpu_memory_utilization" else "vLLM's context: fits",
                     justify="right")
        t.add_column("oomguard run sets", justify="right")
    elif fit:
        t.add_column(f"largest {fit}", justify="right")
    some_short = any(r["verdict"] == "stop" for r in rows)
    if some_short:
        t.add_column("else oomguard run would set")
    for r in rows:
        cells = [size(r["capacity_bytes"]), size(r["peak_bytes"]), _card_verdict(r)]
        if split:
            cells += _split_cells(r)
        elif fit:
            cells.append("none fits" if r["fit_value"] is None else f"{r['fit_value']:,}")
        change = ("" if r["verdict"] != "stop" else "no rung fits it" if not r["suggest"]
                  else " ".join(f"{k}={_v(v)}" for k, v in r["suggest"].items()))
        t.add_row(*cells, *([change] if some_short else []))
    out.print(t)
    for r in rows:
        if r.get("fit_short"):
            out.print(f"{r['gpu']}: {escape(r['fit_short']['why'])}", soft_wrap=True)
    for line in dict.fromkeys(line for r in rows for line in r.get("not_modelled", ())):
        out.print(f"not modelled: {escape(line)}", soft_wrap=True)
    if split:
        out.print("both fit: vLLM's share holds its weights, its profile's activations and a KV cache for its context "
                  "and the generation batch, and training fits beside it, each with the memory model's margin kept "
                  "free; oomguard run sets: the value it launches with (yours, unless the pre-flight stops it)",
                  soft_wrap=True)
    elif fit:
        out.print(f"largest {fit}: the largest value GRPO accepts at the other settings that the memory model judges "
                  "to fit, with its error kept free as `oomguard run` keeps it", soft_wrap=True)


def plan_table(out: Console, p: Any, model: str) -> None:
    """The breakdown, the verdict `oomguard run` acts on with the margin that decides it, and the suggested rungs."""
    e = p.estimate
    out.print(f"[bold]{model}[/]: predicted peak in the {e.dominant_phase.replace('_', '/')} phase")
    t = Table(header_style="bold")
    t.add_column("term")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    for key, label in _TERMS:
        v = e.breakdown.get(key, 0)
        if v:
            t.add_row(label, size(v), f"{v / max(1, e.peak_bytes):.0%}")
    t.add_row("[bold]peak[/]", f"[bold]{size(e.peak_bytes)}[/]", "")
    out.print(t)
    out.print(f"trainable parameters {e.trainable_params:,} of {e.total_params:,}")
    out.print(f"{_VERDICT[p.verdict.decision]} in {size(p.capacity)}: {escape(p.verdict.line())}", soft_wrap=True)
    out.print(f"  margins: {escape(p.verdict.margins())}", soft_wrap=True)
    launches = p.launches()
    first = f"oomguard run: {_FIRST[launches['first']]}"
    if p.climb is None:
        out.print(first, soft_wrap=True)
        return
    if not p.steps:
        out.print(f"{first}; no rung of the ladder applies", soft_wrap=True)
        return
    if p.first != "stop":
        out.print("[bold]if its probe runs out of memory[/], the rungs oomguard run would choose (as predicted now)")
    if p.fallback is not None:
        out.print("[bold]first a cheaper config[/], predicted within the memory model's error of the card (a probe "
                  "tells), before the choice, which changes what is trained or learned", soft_wrap=True)
    elif p.first == "stop":
        out.print("[bold]the rungs that cost the experiment least[/]" if p.choose_by == "cost"
                  else "[bold]cheapest rungs, in the ladder's order[/]")
    for s in p.steps:
        r = s.remedy
        note = r.trade_for(p.suggest)
        out.print(f"  [cyan]{r.name}[/]  (costs {r.cost}{': ' + note if note else ''})", soft_wrap=True)
    out.print("  " + " ".join(f"{k}={_v(v)}" for k, v in p.suggest.items()), soft_wrap=True)
    if p.after is not None and p.after_verdict is not None:
        out.print(f"  then: peak {size(p.after.peak_bytes)}, {_VERDICT[p.after_verdict.decision]}")
    if p.fallback is not None:
        out.print("  if it runs out of memory, the choice: " + " ".join(f"{k}={_v(v)}" for k, v in
                                                                     p.to_dict()["fallback"].items()), soft_wrap=True)
    then = launches["then"]
    out.print(first + (f"; the choice: {_THEN[then]}" if then else ""), soft_wrap=True)

