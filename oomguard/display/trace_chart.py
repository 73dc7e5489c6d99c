"""A run's memory trace as a picture: kept memory and peak per step, the reserved memory, the device's line, and where
a leak's rate crosses it. A self-contained SVG (no script, no network) for the HTML reports and the docs.

It reads plain data, as ``oomguard analyze --json`` writes a trend (``AnalyzeResult.trends``) and the training process
sends it: ``samples`` (the ``mem`` events' fields: ``step``, ``kept``, ``peak``, ``reserved``), ``verdicts`` (each a
dict with ``kind``; a leak's ``rate``, ``until``, ``end`` and ``runs_out_at``, a long sample's ``step``) and the
device's ``capacity``. Nothing here imports the trend's code.

>>> svg = trace_svg([{"step": s, "kept": (64 + 6 * s) << 20, "peak": (90 + 6 * s) << 20} for s in range(1, 9)],
...                 capacity=112 << 20, verdicts=[{"kind": "leak", "rate": 6 << 20, "until": 8, "end": 112 << 20,
...                                                "runs_out_at": 12}])
>>> svg.startswith("<svg") and 'class="kept"' in svg and 'class="projection"' in svg and "full by step 12" in svg
True
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from ..vocab.sizes import format_size

KEPT, PEAK, RESERVED, DEVICE, PROJECTION, LONG = "#4c72b0", "#dd8452", "#b0b0b0", "#d64545", "#c44e52", "#8172b2"


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def trace_svg(samples: Sequence[Mapping[str, Any]], *, capacity: int | None = None,
              verdicts: Sequence[Mapping[str, Any]] = (), oom_step: int | None = None, width: int = 860,
              height: int = 320, title: str = "Memory per step") -> str:
    """The SVG of one trace (see the module's docstring). Steps run left to right up to the last sample, or to the
    step a leak fills the device at, where that is near enough to show (within 3 times the steps traced).
    ``oom_step``: the step that ran out of memory, where it is known (a mark)."""
    pts = [s for s in samples if isinstance(s.get("step"), int)]
    if not pts:
        return ""
    leak = next((v for v in verdicts if v.get("kind") == "leak" and v.get("runs_out_at") is not None), None)
    first, last = pts[0]["step"], pts[-1]["step"]
    end = max(last, oom_step or last)
    if leak is not None and capacity and leak["runs_out_at"] - last <= 3 * max(1, last - first):
        end = max(end, int(leak["runs_out_at"]))
    values = [v for s in pts for k in ("kept", "peak", "reserved") if (v := s.get(k)) is not None]
    top = max([*values, capacity or 0]) * 1.08 or 1
    left, right, top_pad, bottom = 78, 16, 26, 58
    w, h = width - left - right, height - top_pad - bottom

    def x(step: float) -> float:
        return left + w * ((step - first) / max(1, end - first))

    def y(b: float) -> float:
        return top_pad + h * (1 - b / top)

    out = [f'<svg class="trace-chart" role="img" aria-label="{_e(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<rect width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{left}" y="16" font-weight="600">{_e(title)}</text>']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        v = top / 1.08 * frac
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_e(format_size(v))}</text>')
    for step in _ticks(first, end):
        out.append(f'<text x="{x(step):.1f}" y="{height - bottom + 16}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{left + w / 2:.1f}" y="{height - bottom + 32}" text-anchor="middle" fill="#666">step</text>')
    for key, colour in (("reserved", RESERVED), ("peak", PEAK), ("kept", KEPT)):
        line = [(x(s["step"]), y(s[key])) for s in pts if s.get(key) is not None]
        if line:
            d = " ".join(f"{a:.1f},{b:.1f}" for a, b in line)
            out.append(f'<polyline class="{key}" points="{d}" fill="none" stroke="{colour}" stroke-width="2">'
                       f"<title>{key}</title></polyline>")
    if capacity:
        out.append(f'<line class="device" x1="{left}" x2="{width - right}" y1="{y(capacity):.1f}" '
                   f'y2="{y(capacity):.1f}" stroke="{DEVICE}" stroke-width="2" stroke-dasharray="6,4"/>'
                   f'<text x="{left + 6}" y="{y(capacity) - 5:.1f}" fill="{DEVICE}">'
                   f"device {_e(format_size(capacity))}</text>")
    if leak is not None and capacity and end > last:
        peaks = [s["peak"] for s in pts[-max(1, len(pts) // 3):] if s.get("peak") is not None]
        start = max(peaks) if peaks else leak.get("end")
        if start is not None:
            at = int(leak["runs_out_at"])
            out.append(f'<line class="projection" x1="{x(last):.1f}" y1="{y(start):.1f}" x2="{x(at):.1f}" '
                       f'y2="{y(min(capacity, start + leak["rate"] * (at - last))):.1f}" stroke="{PROJECTION}" '
                       f'stroke-width="2" stroke-dasharray="3,3"><title>at {_e(format_size(leak["rate"]))} per step'
                       f'</title></line><circle cx="{x(at):.1f}" cy="{y(capacity):.1f}" r="4" fill="{PROJECTION}"/>'
                       f'<text x="{x(at) - 6:.1f}" y="{y(capacity) - 8:.1f}" text-anchor="end" fill="{PROJECTION}">'
                       f"full by step {at} at this rate</text>")
    if oom_step is not None:
        out.append(f'<line class="oom" x1="{x(oom_step):.1f}" x2="{x(oom_step):.1f}" y1="{top_pad}" '
                   f'y2="{top_pad + h}" stroke="{DEVICE}" stroke-width="1.5"/><text x="{x(oom_step) + 4:.1f}" '
                   f'y="{top_pad + h - 6}" fill="{DEVICE}">out of memory at step {oom_step}</text>')
    for v in verdicts:
        if v.get("kind") == "long-sample" and v.get("peak") is not None and first <= v.get("step", -1) <= end:
            out.append(f'<circle class="long-sample" cx="{x(v["step"]):.1f}" cy="{y(v["peak"]):.1f}" r="6" '
                       f'fill="none" stroke="{LONG}" stroke-width="2"><title>long sample at step {v["step"]}'
                       "</title></circle>")
    legend = [("kept (allocated at the step's end)", KEPT), ("peak of the step", PEAK), ("reserved", RESERVED)]
    lx = left + 8
    for label, colour in legend:
        out.append(f'<rect x="{lx}" y="{height - 14}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{lx + 14}" y="{height - 5}">{_e(label)}</text>')
        lx += 14 + 7 * len(label) + 16
    out.append("</svg>")
    return "".join(out)


def _ticks(first: int, last: int, most: int = 10) -> list[int]:
    """Round step numbers along the axis.

    >>> _ticks(1, 12), _ticks(3, 400)[:3]
    ([1, 2, 4, 6, 8, 10, 12], [3, 50, 100])
    """
    span = max(1, last - first)
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10**4, 10**5, 10**6)
                if span / s <= most)
    ticks = [first] + [t for t in range((first // step + 1) * step, last + 1, step) if t - first >= step / 2]
    if ticks[-1] != last and last - ticks[-1] >= step / 2:
        ticks.append(last)
    return ticks


def trend_block(trend: Mapping[str, Any]) -> str:
    """An HTML block for one trend of ``oomguard analyze`` (or of a run): a heading, its chart and its sentences."""
    head = f"Memory trace in {trend.get('source', '')}" + (f", process {trend['pid']}" if trend.get("pid") else "")
    chart = trace_svg(trend.get("samples") or [], capacity=trend.get("capacity_bytes"),
                      verdicts=trend.get("verdicts") or [])
    said = trend.get("evidence") or ["Nothing grows: no leak, no fragmentation growth, no long sample."]
    return (f"<h2>{_e(head)}</h2>{chart}<ul class=\"ev\">" + "".join(f"<li>{_e(s)}</li>" for s in said) + "</ul>")
