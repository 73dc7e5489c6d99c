"""Self-contained HTML reports for `oomguard run --html` and `oomguard analyze --html`.

One file, no network: inline CSS, SVG charts drawn here, and a few lines of script (a JSON toggle, and a marker the
tests check to know the page ran without errors). Everything from a log or a report is escaped.

>>> page = run_html({"status": "stable", "attempts": [], "diff": [], "original": {}, "message": "ok"})
>>> page.startswith("<!DOCTYPE html>") and 'id="peak-chart"' in page
True
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..vocab.files import write_atomic
from ..vocab.records import climbed_labels, ran_to_end
from ..vocab.sizes import format_size
from .trace_chart import trace_svg, trend_block

_COLOURS = {"ok": "#2e9d5b", "oom": "#d64545", "predicted": "#e08a2c", "failed": "#8a8a8a", "interrupted": "#c9a227"}
_TERM_COLOURS = {"weights": "#4c72b0", "reference": "#8172b2", "gradients": "#dd8452", "optimizer": "#c44e52",
                 "activations": "#55a868", "logits": "#64b5cd", "kv_cache": "#937860", "vllm": "#da8bc3",
                 "overhead": "#8c8c8c"}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#222;
padding:0 1rem}h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
.status{display:inline-block;padding:.1rem .6rem;border-radius:1rem;color:#fff;font-weight:600}
.stable{background:#2e9d5b}.exhausted,.failed{background:#d64545}.interrupted{background:#c9a227}
table{border-collapse:collapse;margin:.5rem 0;width:100%}th,td{border:1px solid #ddd;padding:.3rem .5rem;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
table.figures{width:auto;min-width:22rem}code{background:#f4f4f4;padding:0 .25rem;border-radius:3px}.muted{color:#666}.ev li{margin:.2rem 0}
svg text{font:12px system-ui,sans-serif}pre{background:#f7f7f7;padding:.8rem;overflow:auto;max-height:30rem}
button{font:inherit;padding:.2rem .7rem}.legend span{display:inline-block;margin-right:1rem}
.legend i{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:-1px}
"""

_SCRIPT = """
(function () {
  var b = document.getElementById('toggle-json');
  var pre = document.getElementById('raw-json');
  if (b && pre) {
    b.addEventListener('click', function () {
      var hidden = pre.style.display === 'none';
      pre.style.display = hidden ? 'block' : 'none';
      b.textContent = hidden ? 'Hide the JSON' : 'Show the JSON';
    });
  }
  var bars = document.querySelectorAll('[data-bytes]');
  bars.forEach(function (el) { el.setAttribute('aria-label', el.getAttribute('data-label') || ''); });
  document.body.setAttribute('data-rendered', String(bars.length));
})();
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _size(n: Any) -> str:
    return "—" if n is None else format_size(int(n))


def _page(title: str, body: str, data: Any) -> str:
    raw = html.escape(json.dumps(data, indent=2, default=str))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{body}"
        "<h2>Raw data</h2><button id=\"toggle-json\" type=\"button\">Show the JSON</button>"
        f"<pre id=\"raw-json\" style=\"display:none\">{raw}</pre>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def peak_chart(attempts: Sequence[dict[str, Any]], capacity: int | None, *, width: int = 860) -> str:
    """One bar per attempt: its peak (or, for an OOM, what it had allocated plus the failing request) against the
    device's capacity."""
    values = []
    for a in attempts:
        oom = a.get("oom") or {}
        needed = None
        if a.get("outcome") == "oom" and oom.get("allocated_bytes") is not None:
            needed = oom["allocated_bytes"] + (oom.get("requested_bytes") or 0)
        values.append((a, a.get("peak_bytes"), needed))
    top = max([capacity or 0] + [v or 0 for _, p, n in values for v in (p, n)]) or 1
    h, pad_l, pad_b, bar_gap = 260, 96, 40, 14
    n = max(1, len(values))
    bw = max(14, min(90, (width - pad_l - 20) // n - bar_gap))

    def y(b: float) -> float:
        return 20 + (h - pad_b - 20) * (1 - b / top)

    parts = [f'<svg id="peak-chart" role="img" aria-label="Peak memory per attempt" width="{width}" height="{h}" '
             f'viewBox="0 0 {width} {h}" xmlns="http://www.w3.org/2000/svg">']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        v = top * frac
        parts.append(f'<line x1="{pad_l}" x2="{width - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{pad_l - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_e(_size(v))}</text>')
    for i, (a, peak, needed) in enumerate(values):
        x = pad_l + 10 + i * (bw + bar_gap)
        colour = _COLOURS.get(str(a.get("outcome")), "#999")
        kind = a.get("kind", "run")
        if needed is not None and (peak is None or needed > peak):
            label = (f"attempt {a.get('index')} ({kind}): out of memory; allocated {_size(needed - (a['oom'].get('requested_bytes') or 0))}"
                     f" + the failing request = {_size(needed)}")
            parts.append(f'<rect data-bytes="{needed}" data-label="{_e(label)}" x="{x}" y="{y(needed):.1f}" width="{bw}" '
                         f'height="{max(1.0, y(0) - y(needed)):.1f}" fill="{colour}" fill-opacity="0.25" stroke="{colour}" '
                         f'stroke-dasharray="4,3"><title>{_e(label)}</title></rect>')
        if peak is not None:
            label = f"attempt {a.get('index')} ({kind}): {a.get('outcome')}, peak {_size(peak)}"
            parts.append(f'<rect data-bytes="{peak}" data-label="{_e(label)}" x="{x}" y="{y(peak):.1f}" '
                         f'width="{bw}" height="{max(1.0, y(0) - y(peak)):.1f}" fill="{colour}">'
                         f'<title>{_e(label)}</title></rect>')
        parts.append(f'<text x="{x + bw / 2}" y="{h - pad_b + 16}" text-anchor="middle">#{_e(a.get("index"))}'
                     f'{" " + _e(kind) if kind != "run" else ""}</text>')
    if capacity:
        parts.append(f'<line x1="{pad_l}" x2="{width - 10}" y1="{y(capacity):.1f}" y2="{y(capacity):.1f}" '
                     f'stroke="#d64545" stroke-width="2" stroke-dasharray="6,4"/><text x="{width - 12}" '
                     f'y="{y(capacity) - 5:.1f}" text-anchor="end" fill="#d64545">capacity {_e(_size(capacity))}'
                     "</text>")
    parts.append("</svg>")
    return "".join(parts)


def breakdown_chart(breakdown: dict[str, int], *, width: int = 860) -> str:
    """A stacked bar of the memory terms (the memory model's breakdown, or measured figures)."""
    total = sum(v for v in breakdown.values() if v and v > 0) or 1
    x, parts = 0.0, [f'<svg id="breakdown-chart" role="img" aria-label="Memory breakdown" width="{width}" height="46" '
                     f'viewBox="0 0 {width} 46" xmlns="http://www.w3.org/2000/svg">']
    legend = []
    for key, v in breakdown.items():
        if not v or v <= 0:
            continue
        w = (width - 2) * v / total
        colour = _TERM_COLOURS.get(key, "#aaa")
        label = f"{key}: {_size(v)} ({v / total:.0%})"
        parts.append(f'<rect data-bytes="{v}" data-label="{_e(label)}" x="{x + 1:.1f}" y="4" width="{w:.1f}" '
                     f'height="38" fill="{colour}"><title>{_e(label)}</title></rect>')
        x += w
        legend.append(f'<span><i style="background:{colour}"></i>{_e(label)}</span>')
    parts.append("</svg>")
    return "".join(parts) + f'<div class="legend">{"".join(legend)}</div>'


def timeline_chart(attempts: Sequence[dict[str, Any]], *, width: int = 860) -> str:
    """The attempts one after another in time, coloured by outcome, with the rung climbed after each."""
    total = sum(float(a.get("seconds") or 0) for a in attempts) or 1.0
    row, h = 26, 26 * max(1, len(attempts)) + 24
    parts = [f'<svg id="timeline-chart" role="img" aria-label="Attempts timeline" width="{width}" height="{h}" '
             f'viewBox="0 0 {width} {h}" xmlns="http://www.w3.org/2000/svg">']
    t, scale = 0.0, (width - 260) / total
    labels = climbed_labels([a.get("climbed") for a in attempts])
    for i, a in enumerate(attempts):
        s = float(a.get("seconds") or 0)
        colour = _COLOURS.get(str(a.get("outcome")), "#999")
        label = f"#{a.get('index')} {a.get('kind', 'run')} {a.get('outcome')} {s:.1f}s"
        parts.append(f'<rect data-bytes="0" data-label="{_e(label)}" x="{10 + t * scale:.1f}" y="{4 + i * row}" '
                     f'width="{max(2.0, s * scale):.1f}" height="{row - 6}" fill="{colour}"><title>{_e(label)}</title>'
                     f'</rect><text x="{16 + (t + s) * scale:.1f}" y="{4 + i * row + 15}">{_e(label)}'
                     f'{" → " + _e(labels[i]) if labels[i] else ""}</text>')
        t += s
    parts.append(f'<text x="10" y="{h - 6}" class="muted">total {total:.1f}s</text></svg>')
    return "".join(parts)


def figures_chart(f: dict[str, Any], index: int, *, width: int = 860) -> str:
    """The device at the moment of one OOM: capacity split into what held it, and the request that failed below."""
    cap = f.get("capacity_bytes")
    if not cap:
        return ""
    alloc = f.get("allocated_bytes") or 0
    ru = f.get("reserved_unallocated_bytes") or 0
    proc = f.get("process_bytes")
    non_torch = max(0, proc - alloc - ru) if proc is not None else 0
    others = sum((p.get("bytes") or 0) for p in f.get("other_processes") or [])
    free = f.get("free_bytes")
    if free is None:
        free = max(0, cap - alloc - ru - non_torch - others)
    segments = [("allocated by PyTorch", alloc, "#4c72b0"), ("reserved, unallocated", ru, "#dd8452"),
                ("rest of this process", non_torch, "#8172b2"), ("other processes", others, "#937860"),
                ("free", free, "#cfe8d6")]
    req = f.get("requested_bytes") or 0
    top = max(cap, alloc + ru + non_torch + others + free, req) or 1
    scale = (width - 20) / top
    parts = [f'<svg id="figures-{index}" class="figures-chart" role="img" aria-label="Device memory at the OOM" '
             f'width="{width}" height="70" viewBox="0 0 {width} 70" xmlns="http://www.w3.org/2000/svg">']
    x = 10.0
    legend = []
    for name, v, colour in segments:
        if v <= 0:
            continue
        label = f"{name}: {_size(v)}"
        parts.append(f'<rect data-bytes="{v}" data-label="{_e(label)}" x="{x:.1f}" y="6" width="{v * scale:.1f}" '
                     f'height="30" fill="{colour}"><title>{_e(label)}</title></rect>')
        x += v * scale
        legend.append(f'<span><i style="background:{colour}"></i>{_e(label)}</span>')
    parts.append(f'<line x1="{10 + cap * scale:.1f}" x2="{10 + cap * scale:.1f}" y1="2" y2="40" stroke="#222"/>')
    if req:
        label = f"the failing request: {_size(req)}"
        parts.append(f'<rect data-bytes="{req}" data-label="{_e(label)}" x="10" y="46" width="{max(2.0, req * scale):.1f}" '
                     f'height="14" fill="#d64545"><title>{_e(label)}</title></rect>')
        legend.append(f'<span><i style="background:#d64545"></i>{_e(label)}</span>')
    parts.append("</svg>")
    return "".join(parts) + f'<div class="legend">{"".join(legend)} <span class="muted">capacity {_e(_size(cap))}'\
        "</span></div>"


def _diff_table(rows: Sequence[dict[str, Any]], stable: bool = True) -> str:
    """The diff as a table; where nothing was stable its third column is the last config tried, and says so."""
    if not rows:
        return '<p class="muted">Nothing was changed.</p>'
    body = "".join(f"<tr><td><code>{_e(r['knob'])}</code></td>"
                   f"<td>{_e('not seen yet' if r.get('unseen') else r.get('from'))}</td><td>{_e(r.get('to'))}</td>"
                   f"<td>{_e(r.get('action') or r.get('remedy'))}</td></tr>" for r in rows)
    to = "stable" if stable else "last tried"
    return f"<table id=\"diff\"><tr><th>knob</th><th>original</th><th>{to}</th><th>remedy</th></tr>{body}</table>"


def _finding_block(f: dict[str, Any], *, show_source: bool = True) -> str:
    figs = [("requested", "requested_bytes"), ("capacity", "capacity_bytes"), ("free", "free_bytes"),
            ("allocated", "allocated_bytes"), ("reserved but unallocated", "reserved_unallocated_bytes"),
            ("this process", "process_bytes")]
    cells = "".join(f"<tr><td>{_e(n)}</td><td class=\"num\">{_e(_size(f.get(k)))}</td></tr>"
                    for n, k in figs if f.get(k) is not None)
    ev = "".join(f"<li>{_e(e)}</li>" for e in f.get("evidence") or [])
    rem = "".join(f"<li><code>{_e(r['name'])}</code>: {_e(r['reason'])}"
                  + (f" <span class=\"muted\">(frees ~{_e(_size(r['frees_bytes']))})</span>" if r.get("frees_bytes")
                     else "") + "</li>" for r in f.get("remedies") or [])
    where = (f"{f.get('source')}" + (f":{f.get('line')}" if f.get("line") else "") + ": ") if show_source else ""
    return (f"<h3>{_e(where)}<span class=\"muted\">{_e(f.get('backend'))}</span> {_e(f.get('kind'))}"
            f"{' during ' + _e(f.get('phase')) if f.get('phase') not in (None, 'unknown') else ''}</h3>"
            + (f"<table class=\"figures\">{cells}</table>" if cells else "")
            + f"<p><b>Why</b></p><ul class=\"ev\">{ev}</ul>"
            + (f"<p><b>What to do</b></p><ol>{rem}</ol>" if rem else ""))


def run_html(report: dict[str, Any], breakdown: dict[str, int] | None = None) -> str:
    """The page for a RunReport (as JSON data)."""
    attempts = report.get("attempts") or []
    dev = report.get("device") or {}
    capacity = dev.get("simulate_gpu") or dev.get("gpu_memory") or dev.get("capacity")
    for a in attempts:
        cap = (a.get("oom") or {}).get("capacity_bytes")
        capacity = capacity or cap
    status = str(report.get("status", ""))
    body = [f"<h1>oomguard run report <span class=\"status {_e(status)}\">{_e(status)}</span></h1>",
            f"<p>{_e(report.get('message'))}</p>"]
    if report.get("command"):
        body.append(f"<p class=\"muted\"><code>{_e(' '.join(map(str, report['command'])))}</code></p>")
    body.append("<h2>Peak memory per attempt</h2>" + peak_chart(attempts, capacity))
    body.append('<div class="legend"><span><i style="background:#2e9d5b"></i>ok</span>'
                '<span><i style="background:#d64545"></i>out of memory: solid, the peak reached; dashed, what was '
                'allocated plus the request that failed</span><span><i style="background:#8a8a8a"></i>failed</span>'
                '</div>')
    if breakdown:
        body.append("<h2>Memory breakdown (memory model, final config)</h2>" + breakdown_chart(breakdown))
    body.append("<h2>Attempts</h2>" + timeline_chart(attempts))
    traced = [a for a in attempts if len(a.get("trace") or []) >= 4]
    if traced:  # the memory trace of each attempt that trained a few steps: a leak shows as a rising line
        body.append("<h2>Memory per step</h2>")
        for a in traced:
            verdicts = (a.get("trend") or {}).get("verdicts") or []
            step = a.get("step")
            body.append(trace_svg(a["trace"], capacity=capacity, verdicts=verdicts,
                                  oom_step=step + 1 if a.get("outcome") == "oom" and isinstance(step, int) else None,
                                  title=f"Attempt {a.get('index')} ({a.get('kind', 'run')})"))
    stable = ran_to_end(str(report.get("status")), report.get("exit_code"))
    body.append(("<h2>What changed</h2>" if stable else "<h2>What was tried</h2>")
                + _diff_table(report.get("diff") or [], stable))
    from ..decide.experiment import experiment_lines
    from .ui import alternatives_lines

    said = experiment_lines(report.get("experiment")) + alternatives_lines(report.get("alternatives") or [],
                                                                         report.get("command"))
    if said:
        body.append("<h2>What your experiment kept, and what else fits</h2><pre id=\"experiment\">"
                    + "\n".join(_e(line) for line in said) + "</pre>")
    labels = dict(zip((id(a) for a in attempts), climbed_labels([a.get("climbed") for a in attempts]), strict=True))
    evid = [a for a in attempts if a.get("oom")]
    if evid:
        body.append("<h2>Diagnoses</h2>")
        for a in evid:
            body.append(f"<h3>Attempt {_e(a.get('index'))} ({_e(a.get('kind', 'run'))})</h3>"
                        + _finding_block(a["oom"], show_source=False) + figures_chart(a["oom"], a.get("index", 0)))
            if labels[id(a)]:
                body.append(f"<p>Climbed <code>{_e(labels[id(a)])}</code>.</p>")
            if a.get("skipped"):
                items = "".join(f"<li><code>{_e(s['remedy'])}</code>: {_e(s['reason'])}</li>" for s in a["skipped"])
                body.append(f"<details><summary>Rungs passed over</summary><ul>{items}</ul></details>")
    return _page("oomguard run report", "".join(body), report)


def analyze_html(result: Any) -> str:
    """The page for `oomguard analyze` results."""
    data = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    findings = data.get("findings") or []
    body = [f"<h1>oomguard analyze</h1><p>{len(findings)} out-of-memory error(s) in {data.get('files_read', 0)} "
            "file(s).</p>"]
    for i, f in enumerate(findings):
        body.append(_finding_block(f) + figures_chart(f, i))
    for s in data.get("snapshots") or []:
        body.append(f"<h2>Snapshot {_e(s.get('source'))}</h2>")
        body.append(breakdown_chart({"allocated": s.get("allocated_bytes") or 0,
                                     "overhead": s.get("reserved_unallocated_bytes") or 0}))
    for t in data.get("trends") or []:
        body.append(trend_block(t))
    if data.get("notes"):
        body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in data["notes"]) + "</ul>")
    return _page("oomguard analyze", "".join(body), data)


def _write(path: str | os.PathLike[str], text: str) -> Path:
    return write_atomic(path, text)


def write_run_html(path: str | os.PathLike[str], report: dict[str, Any],
                   breakdown: dict[str, int] | None = None) -> Path:
    return _write(path, run_html(report, breakdown))


def write_analyze_html(path: str | os.PathLike[str], result: Any) -> Path:
    return _write(path, analyze_html(result))
