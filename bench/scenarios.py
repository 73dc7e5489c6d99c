"""Launches, OOMs and wall time to a stable config, and whether the final diff is minimal, per scenario and strategy.

Each scenario is a real TRL GRPO run of tests/scripts/grpo_tiny.py on the simulated device (CPU), with the budgets of
the end-to-end tests (found with bench/min_budget.py), plus one whose memory is mostly weights, gradients and
optimizer state (a wide, one-layer model loaded by name, so TRL loads it in float32). The strategies, and the flags
each passes to `oomguard run` (probes and the pre-flight stay at their defaults, as users get them: a 2-step
worst-case probe before the real run):

    default             --ladder default --no-predict          one rung per OOM, in the default ladder's order
    quality-first       --ladder quality-first --no-predict    one rung per OOM, semantics-preserving rungs first
    guided              --ladder default                       exactly `oomguard run`'s defaults (memory model on)
    guided --minimize   --ladder default --minimize            the same, then drop rungs a probe shows are not needed

What each row measures (read from the RunReport; a field the report lacks is left blank):

  launches    every attempt the run made (probes, real runs, minimize trials): each one is a process start
  trials      of those, undo trials (kind "minimize"): a probe without one change, to learn whether it is needed (every
              change with --minimize; by default only those the memory model is unsure of)
  OOMs        attempts whose outcome is "oom" (real out-of-memory errors, minimize trials included)
  predicted   pre-flight stops: outcome "predicted" (the child stopped before generating because the memory model
              was sure the config could not fit); counted apart from OOMs
  wall        the whole `oomguard run`, start to exit (the minimality checks below are not included)
  peak        the last attempt's peak (allocated bytes) as a fraction of the budget
  final diff  knob=value for each row of the report's diff (short names; the legend follows the table)
  minimal     checked by the bench itself, with probes: for each remedy in the diff (rows grouped by the diff's
              `remedy` column, so e.g. fewer_generations' num_generations and per_device_train_batch_size are undone
              together), a copy of the stable lock with those knobs set back to the user's original values (the
              original, never a midpoint) is replayed with `oomguard run --config UNDO.lock --probe-steps 2
              --max-attempts 1 --no-predict` (a replayed lock never climbs: an OOM ends it; two steps, as the runs'
              own probes, since the second holds the optimizer state: a one-step check passed undos that the runs'
              two-step probes showed to run out of memory). If any undo still fits,
              the diff is not minimal and the needless remedies are named. An undo the lock loader refuses (GRPO's
              batch rules) cannot be undone alone and counts as needed.
  targets     what the row misses of (undo trials and their OOMs not counted: they buy the minimal diff where the
              model is unsure): at most one real OOM (none when the first attempt was a pre-flight stop: the
              memory model was sure from the start), a minimal diff, stable within two launches after the first

Run it (all 16 rows: about 20 minutes on 2 shared cores, a quarter of it the checks' undo probes, one per remedy
in each final diff; the same undo is probed once per bench run):

    python bench/scenarios.py [--only KEY]... [--strategy NAME]... [--jobs 1] [--json rows.json] [--no-check]
                              [--models DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.vocab.files import read_json_object

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "scripts" / "grpo_tiny.py")
MiB = 1024 * 1024
# One intra-op thread per training process: the models are tiny, and on a shared 2-core machine torch's default of
# one thread per core mostly waits (tests/conftest.py measured 4x slower under load). Thread counts do not change
# which tensors are created, so the simulated device's figures are the same; set OMP_NUM_THREADS to override.
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
       "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Scenario:
    key: str  # what --only selects
    name: str  # what the table shows
    budget: str  # --simulate-gpu
    args: tuple[str, ...]  # grpo_tiny.py's flags
    model: str = "tiny"  # a tests/scripts/build_tiny_model.py variant


SCENARIOS = (
    Scenario("long", "long completions (118 MiB, C=128)", "118MiB", ("--max-completion-length", "128")),
    Scenario("generations", "many generations (84 MiB, C=64)", "84MiB", ("--max-completion-length", "64")),
    Scenario("tight", "tight (48 MiB, C=64)", "48MiB", ("--max-completion-length", "64")),
    # A 1024-wide, 1-layer model (16M parameters, fp32): weights + gradients + AdamW state are ~95% of the peak.
    # bench/min_budget.py: the user's config needs 342 MiB, the default ladder's rungs before the 8-bit optimizer
    # (allocator settings, C=64, 2 generations) still ~290 MiB of allocations, the 8-bit optimizer alone 242 MiB,
    # LoRA alone less: at 256 MiB one later rung is enough, but the ladder's prefix walk halves C and G on the way.
    Scenario("weights", "weights + optimizer (wide, 256 MiB, C=128)", "256MiB",
             ("--model-as-string", "--max-completion-length", "128"), model="wide"),
)

STRATEGIES: dict[str, tuple[str, ...]] = {
    "default": ("--ladder", "default", "--no-predict"),
    "quality-first": ("--ladder", "quality-first", "--no-predict"),
    "guided": ("--ladder", "default"),
    "guided --minimize": ("--ladder", "default", "--minimize"),
}

# Short knob names for the table (the legend is printed under it).
SHORT = {
    "max_completion_length": "C", "num_generations": "G", "per_device_train_batch_size": "bs",
    "gradient_accumulation_steps": "GA", "expandable_segments": "ES", "max_split_size_mb": "split_mb",
    "torch_empty_cache_steps": "empty_cache", "gradient_checkpointing": "ckpt", "load_in_4bit": "4bit",
    "lora_target_modules": "lora_mod", "max_prompt_tokens": "max_prompt",
}
LEGEND = ("C max_completion_length, G num_generations, bs per_device_train_batch_size, GA gradient_accumulation_steps, "
          "ES expandable_segments, split_mb max_split_size_mb, empty_cache torch_empty_cache_steps, "
          "4bit load_in_4bit, lora_mod lora_target_modules")


# ---------------------------------------------------------------------------------------------------------------
# Pure parts (tested in tests/test_bench_scenarios.py)


def summarise(report: Mapping[str, Any] | None, budget_bytes: int | None) -> dict[str, Any]:
    """Launches, OOMs, pre-flight stops, peak/budget and the compact diff of a RunReport; missing fields stay None.

    >>> rep = {"status": "stable", "attempts": [{"outcome": "predicted"}, {"outcome": "oom"},
    ...        {"outcome": "ok", "peak_bytes": 50 * MiB}], "diff": [{"knob": "optim", "to": "adamw_bnb_8bit"}]}
    >>> s = summarise(rep, 100 * MiB)
    >>> s["launches"], s["ooms"], s["predicted"], s["peak_fraction"], s["diff"], s["first_predicted"]
    (3, 1, 1, 0.5, 'optim=adamw_bnb_8bit', True)
    >>> s["trail"]
    '?:predicted → ?:oom → ?:ok'
    """
    rep = report if isinstance(report, Mapping) else {}
    attempts = [a for a in rep.get("attempts") or [] if isinstance(a, Mapping)]
    outcomes = [a.get("outcome") for a in attempts]
    last = attempts[-1] if attempts else {}
    peak = last.get("peak_bytes")
    capacity = budget_bytes or ((rep.get("device") or {}).get("capacity") if isinstance(rep.get("device"), Mapping)
                                else None)
    diff = rep.get("diff")
    return {
        "status": rep.get("status"),
        "launches": len(attempts) if "attempts" in rep else None,
        "ooms": outcomes.count("oom") if "attempts" in rep else None,
        "predicted": outcomes.count("predicted") if "attempts" in rep else None,
        "trials": sum(1 for a in attempts if a.get("kind") == "minimize") if "attempts" in rep else None,
        "trial_ooms": (sum(1 for a in attempts if a.get("kind") == "minimize" and a.get("outcome") == "oom")
                       if "attempts" in rep else None),
        "first_predicted": bool(outcomes) and outcomes[0] == "predicted",
        "peak_bytes": peak if isinstance(peak, int) else None,
        "peak_fraction": round(peak / capacity, 3) if isinstance(peak, int) and capacity else None,
        "diff": compact_diff(diff) if isinstance(diff, list) else None,
        "trail": " → ".join(_step(a) for a in attempts),
    }


def _step(a: Mapping[str, Any]) -> str:
    """One attempt as ``kind:outcome``, with the rungs climbed after it (``+a+b``): the row's story in the JSON."""
    climbed = a.get("climbed")
    return f"{a.get('kind') or '?'}:{a.get('outcome') or '?'}" + (f" +{climbed}" if climbed else "")


def _value(v: Any) -> str:
    if v is True:
        return "on"
    if v is False:
        return "off"
    if isinstance(v, list | tuple):
        return "+".join(map(str, v))
    return str(v)


def compact_diff(diff: Sequence[Mapping[str, Any]]) -> str:
    """The diff as ``knob=value`` pairs with short names; lora_alpha is left out when lora_r is shown (it is 2r).

    >>> compact_diff([{"knob": "num_generations", "to": 2}, {"knob": "per_device_train_batch_size", "to": 2},
    ...               {"knob": "lora_r", "to": 16}, {"knob": "lora_alpha", "to": 32}, {"knob": "expandable_segments", "to": True}])
    'G=2, bs=2, lora_r=16, ES=on'
    """
    knobs = {str(r.get("knob")) for r in diff}
    parts = []
    for r in diff:
        knob = str(r.get("knob"))
        if knob == "lora_alpha" and "lora_r" in knobs:
            continue
        parts.append(f"{SHORT.get(knob, knob)}={_value(r.get('to'))}")
    return ", ".join(parts)


def undo_groups(diff: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """The diff's rows grouped by the remedy that made them, in the diff's order: each group is undone together.

    Rows without a remedy (or naming none) are a group each, named by their knob.

    >>> rows = [{"knob": "max_completion_length", "remedy": "shorter_sequences"},
    ...         {"knob": "num_generations", "remedy": "fewer_generations"},
    ...         {"knob": "per_device_train_batch_size", "remedy": "fewer_generations"},
    ...         {"knob": "deepspeed config", "remedy": None}]
    >>> [(name, [r["knob"] for r in rs]) for name, rs in undo_groups(rows)]
    [('shorter_sequences', ['max_completion_length']), ('fewer_generations', ['num_generations', 'per_device_train_batch_size']), ('deepspeed config', ['deepspeed config'])]
    """
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in diff:
        name = str(r.get("remedy") or r.get("knob"))
        groups.setdefault(name, []).append(r)
    return list(groups.items())


def undo_lock(lock: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
              knob_names: frozenset[str] | None = None) -> dict[str, Any] | None:
    """A copy of ``lock`` with each row's knob set back to the user's original (the row's ``from``).

    An original of None (TRL's default, e.g. no LoRA) removes the override, so the user's own value applies. The
    lock's ``stable`` knobs follow, so the lock stays self-consistent; the undone rows leave its ``diff``. Returns None
    when no row names a knob (e.g. a generated DeepSpeed config): there is nothing a lock can undo.

    >>> lock = {"overrides": {"max_completion_length": 64, "lora_r": 16}, "stable": {"max_completion_length": 64,
    ...         "lora_r": 16}, "diff": [{"knob": "max_completion_length", "from": 128, "to": 64},
    ...         {"knob": "lora_r", "from": None, "to": 16}]}
    >>> u = undo_lock(lock, [lock["diff"][0]])
    >>> u["overrides"], u["stable"]["max_completion_length"], [r["knob"] for r in u["diff"]]
    ({'max_completion_length': 128, 'lora_r': 16}, 128, ['lora_r'])
    >>> undo_lock(lock, [lock["diff"][1]])["overrides"]
    {'max_completion_length': 64}
    """
    out = copy.deepcopy(dict(lock))
    overrides = dict(out.get("overrides") or {})
    stable = out.get("stable")
    undone = set()
    for r in rows:
        knob = r.get("knob")
        if not isinstance(knob, str) or (knob_names is not None and knob not in knob_names):
            continue
        if knob_names is None and " " in knob:  # "deepspeed config" and other non-knob rows
            continue
        original = r.get("from")
        if original is None:
            overrides.pop(knob, None)
        else:
            overrides[knob] = original
        if isinstance(stable, dict):
            stable[knob] = original
        undone.add(knob)
    if not undone:
        return None
    out["overrides"] = overrides
    if isinstance(out.get("diff"), list):
        out["diff"] = [r for r in out["diff"] if not (isinstance(r, Mapping) and r.get("knob") in undone)]
    return out


def minimal_verdict(checks: Sequence[Mapping[str, Any]] | None) -> str:
    """One cell: "yes", "no: X, Y needless" (undoing them still fits), or what kept the check from concluding.

    A check's ``result`` is "fits", "oom", "predicted" (a pre-flight stop: not a measurement), "invalid" (the lock
    loader refused the undo: it cannot be undone alone) or "error".

    >>> minimal_verdict([{"remedy": "lora", "result": "oom"}, {"remedy": "shorter_sequences", "result": "fits"}])
    'no: shorter_sequences needless'
    >>> minimal_verdict([{"remedy": "lora", "result": "oom"}, {"remedy": "optimizer_8bit", "result": "invalid"}])
    'yes'
    >>> minimal_verdict([{"remedy": "lora", "result": "oom"}, {"remedy": "bf16_load", "result": "error"}])
    'unknown: bf16_load check error'
    >>> minimal_verdict([])
    'yes (no change)'
    """
    if checks is None:
        return ""
    if not checks:
        return "yes (no change)"
    needless = [str(c.get("remedy")) for c in checks if c.get("result") == "fits"]
    if needless:
        return f"no: {', '.join(needless)} needless"
    unsure = [f"{c.get('remedy')} check {c.get('result')}" for c in checks
              if c.get("result") not in ("oom", "invalid")]
    if unsure:
        return "unknown: " + ", ".join(unsure)
    return "yes"


def missed_targets(row: Mapping[str, Any]) -> str:
    """The targets a row misses ("" when it meets all, "?" parts when a figure is missing).

    At most one real OOM while climbing (none when the first attempt was a pre-flight stop), a minimal diff, and
    stable within two launches after the first (three launches in all). Undo trials (probes without one change, to
    learn whether it is needed) are the price of the minimal diff where the model is unsure: they and their OOMs are
    counted in the table but not against the first and last targets.

    >>> missed_targets({"status": "stable", "ooms": 1, "launches": 3, "minimal": "yes"})
    ''
    >>> missed_targets({"status": "stable", "ooms": 1, "first_predicted": True, "launches": 5, "minimal": "no: x"})
    'OOMs 1>0, launches 5>3, not minimal'
    >>> missed_targets({"status": "stable", "ooms": 1, "trial_ooms": 1, "trials": 1, "first_predicted": True,
    ...                 "launches": 4, "minimal": "yes"})
    ''
    >>> missed_targets({"status": "exhausted", "ooms": None, "launches": 8, "minimal": ""})
    'not stable, OOMs ?, launches 8>3'
    """
    miss = []
    if row.get("status") != "stable":
        miss.append("not stable")
    limit = 0 if row.get("first_predicted") else 1
    ooms = row.get("ooms")
    if ooms is not None:
        ooms -= row.get("trial_ooms") or 0
    if ooms is None:
        miss.append("OOMs ?")
    elif ooms > limit:
        miss.append(f"OOMs {ooms}>{limit}")
    launches = row.get("launches")
    if launches is not None:
        launches -= row.get("trials") or 0
    if launches is None:
        miss.append("launches ?")
    elif launches > 3:
        miss.append(f"launches {launches}>3")
    minimal = str(row.get("minimal") or "")
    if minimal.startswith("no"):
        miss.append("not minimal")
    elif minimal.startswith("unknown"):
        miss.append("minimal ?")
    return ", ".join(miss)


COLUMNS = (("scenario", "scenario"), ("strategy", "strategy"), ("status", "status"), ("launches", "launches"),
           ("trials", "trials"), ("OOMs", "ooms"), ("predicted", "predicted"), ("wall", "wall"), ("peak/budget", "peak_fraction"),
           ("final diff", "diff"), ("minimal", "minimal"), ("misses", "misses"))
RIGHT = {"launches", "trials", "ooms", "predicted", "wall", "peak_fraction"}


def _cell(key: str, v: Any) -> str:
    if v is None:
        return ""
    if key == "wall":
        return f"{v:.1f} s"
    if key == "peak_fraction":
        return f"{100 * v:.0f}%"
    return str(v).replace("|", "\\|")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table; a scenario's name is shown on its first row only. Missing figures are blank cells.

    >>> print(format_table([{"scenario": "s", "strategy": "default", "status": "stable", "launches": 2, "ooms": 1,
    ...                      "wall": 12.34, "peak_fraction": 0.915, "diff": "C=64", "minimal": "yes"},
    ...                     {"scenario": "s", "strategy": "guided", "status": None}]))
    | scenario | strategy | status | launches | trials | OOMs | predicted | wall | peak/budget | final diff | minimal | misses |
    |---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|
    | s | default | stable | 2 |  | 1 |  | 12.3 s | 92% | C=64 | yes |  |
    |  | guided |  |  |  |  |  |  |  |  |  |  |
    """
    head = "| " + " | ".join(h for h, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---:" if k in RIGHT else "---" for _, k in COLUMNS) + "|"
    lines = [head, rule]
    previous = None
    for r in rows:
        cells = []
        for _, k in COLUMNS:
            v = r.get(k)
            if k == "scenario":
                v, previous = ("" if v == previous else v), v
            cells.append(_cell(k, v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def select(items: Sequence[str], wanted: Sequence[str] | None, what: str,
           names: Callable[[str], Sequence[str]] = lambda s: (s,)) -> list[str]:
    """The items a selector names (exact key, or a substring of a name); a selector naming nothing is an error.

    >>> select(["long", "tight"], ["tig"], "scenario")
    ['tight']
    >>> select(["long"], ["wide"], "scenario")
    Traceback (most recent call last):
    ...
    SystemExit: no scenario matches 'wide' (choose from: long)
    """
    if not wanted:
        return list(items)
    chosen = []
    for w in wanted:
        hits = [i for i in items if w == i] or [i for i in items if any(w in n for n in names(i))]
        if not hits:
            raise SystemExit(f"no {what} matches {w!r} (choose from: {', '.join(items)})")
        chosen += [h for h in hits if h not in chosen]
    return [i for i in items if i in chosen]


# ---------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class Bench:
    models: dict[str, str]
    timeout: float = 1800.0
    check: bool = True
    _cache: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def command(self, s: Scenario, d: Path, *flags: str) -> list[str]:
        return [sys.executable, "-m", "oomguard", "run", "--quiet", "--simulate-gpu", s.budget, *flags,
                "--report", str(d / "report.json"), "--lock", str(d / "oomguard.lock.json"), "--workdir", str(d / "wd"),
                "--", sys.executable, TINY, "--model", self.models[s.model], "--output-dir", str(d / "out"), *s.args]

    def run(self, s: Scenario, strategy: str) -> dict[str, Any]:
        from oomguard.vocab.sizes import parse_size

        row: dict[str, Any] = {"scenario": s.name, "key": s.key, "strategy": strategy, "budget": s.budget,
                               "flags": " ".join(STRATEGIES[strategy])}
        with tempfile.TemporaryDirectory(prefix="oomguard-scenario-") as tmp:
            d = Path(tmp)
            t = time.perf_counter()
            try:
                out = subprocess.run(self.command(s, d, *STRATEGIES[strategy]), cwd=d, capture_output=True, text=True,
                                     timeout=self.timeout, env=ENV)
                row["exit_code"] = out.returncode
            except subprocess.TimeoutExpired:
                row["exit_code"] = None
                row["error"] = f"timed out after {self.timeout:.0f}s"
                out = None
            row["wall"] = round(time.perf_counter() - t, 1)
            report = read_json_object(d / "report.json")
            if report is None and out is not None:
                lines = (out.stderr or out.stdout).strip().splitlines()
                row["error"] = lines[-1] if lines else "no report"
            row.update(summarise(report, parse_size(s.budget)))
            row["status"] = row["status"] or "no report"
            lock = read_json_object(d / "oomguard.lock.json")
            if self.check and row["status"] == "stable" and lock is not None:
                diff = lock.get("diff") if isinstance(lock.get("diff"), list) else (report or {}).get("diff") or []
                row["checks"] = [self.undo(s, name, rows, lock) for name, rows in undo_groups(diff)]
                row["minimal"] = minimal_verdict(row["checks"])
        row["misses"] = missed_targets(row)
        return row

    def undo(self, s: Scenario, remedy: str, rows: list[Mapping[str, Any]], lock: Mapping[str, Any]) -> dict[str, Any]:
        """Replay the stable lock with one remedy's rows set back to the user's values: does it still fit?"""
        knobs = [str(r.get("knob")) for r in rows]
        edited = undo_lock(lock, rows, _knob_names())
        if edited is None:
            return {"remedy": remedy, "knobs": knobs, "result": "n/a"}
        key = json.dumps([s.key, edited.get("overrides")], sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                return {"remedy": remedy, "knobs": knobs, **self._cache[key], "cached": True}
        with tempfile.TemporaryDirectory(prefix="oomguard-undo-") as tmp:
            d = Path(tmp)
            (d / "undo.lock.json").write_text(json.dumps(edited, indent=1))
            t = time.perf_counter()
            try:
                out = subprocess.run(self.command(s, d, "--config", str(d / "undo.lock.json"), "--probe-steps", "2",
                                                  "--max-attempts", "1", "--no-predict"),
                                     cwd=d, capture_output=True, text=True, timeout=self.timeout, env=ENV)
                rc: int | None = out.returncode
                tail = (out.stderr or out.stdout).strip().splitlines()[-1:]
            except subprocess.TimeoutExpired:
                rc, tail = None, [f"timed out after {self.timeout:.0f}s"]
            report = read_json_object(d / "report.json")
            attempts = (report or {}).get("attempts") or []
            outcome = attempts[-1].get("outcome") if attempts and isinstance(attempts[-1], Mapping) else None
            if outcome == "ok":
                result = "fits"
            elif outcome in ("oom", "predicted"):
                result = outcome
            elif report is None and rc == 2:
                result = "invalid"  # the lock loader refused it: GRPO's batch rules
            else:
                result = "error"
            res = {"result": result, "overrides": edited.get("overrides"), "seconds": round(time.perf_counter() - t, 1),
                   "peak_bytes": attempts[-1].get("peak_bytes") if attempts else None,
                   "message": (tail[0] if tail else "") if result in ("invalid", "error") else None}
        with self._lock:
            self._cache[key] = res
        return {"remedy": remedy, "knobs": knobs, **res}


def _knob_names() -> frozenset[str] | None:
    try:
        from oomguard.vocab.knobs import KNOB_NAMES
    except ImportError:  # the bench outlives renames: fall back to "a knob has no space in its name"
        return None
    return frozenset(KNOB_NAMES)


def build_models(variants: set[str], where: str, tiny: str | None) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from build_tiny_model import VARIANTS, build

    base = Path(where)
    models = {}
    for v in sorted(variants):
        if v == "tiny" and tiny:
            models[v] = tiny
        else:
            try:
                models[v] = str(build(base / f"{v}-llama", **VARIANTS[v]))
            except Exception as e:  # e.g. a directory the builder did not make: it is never overwritten
                raise SystemExit(f"cannot build the {v} model in {base / f'{v}-llama'}: {e}") from None
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", metavar="SCENARIO",
                   help=f"a scenario key or part of its name, repeatable ({', '.join(s.key for s in SCENARIOS)})")
    p.add_argument("--strategy", action="append", metavar="NAME", help=f"repeatable ({', '.join(STRATEGIES)})")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: wall times are only comparable "
                                                       "one at a time)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also save the rows (with each undo check)")
    p.add_argument("--no-check", action="store_true", help="skip the minimality checks (no undo probes)")
    p.add_argument("--models", metavar="DIR", help="where the models are built or found (default: a temp dir)")
    p.add_argument("--model", metavar="DIR", help="the tests' tiny model, if already built")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one oomguard run (default 1800)")
    a = p.parse_args()
    by_key = {s.key: s for s in SCENARIOS}
    keys = select(list(by_key), a.only, "scenario", lambda k: (k, by_key[k].name))
    select(list(STRATEGIES), a.strategy, "strategy")  # an unknown name is a one-line error before anything builds
    scenarios = [by_key[k] for k in keys]
    with contextlib.ExitStack() as stack:  # models built in a temporary directory are deleted at the end
        where = a.models or stack.enter_context(tempfile.TemporaryDirectory(prefix="oomguard-models-"))
        bench = Bench(build_models({s.model for s in scenarios}, where, a.model), timeout=a.timeout,
                      check=not a.no_check)
        run_all(bench, scenarios, a)


def run_all(bench: Bench, scenarios: list[Any], a: argparse.Namespace) -> None:
    strategies = select(list(STRATEGIES), a.strategy, "strategy")
    units = [(s, st) for s in scenarios for st in strategies]
    rows: list[dict[str, Any] | None] = [None] * len(units)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = {pool.submit(bench.run, s, st): i for i, (s, st) in enumerate(units)}
        for f in concurrent.futures.as_completed(futures):
            row = f.result()
            rows[futures[f]] = row
            checks = "; ".join(f"{c['remedy']}: {c['result']}" for c in row.get("checks") or [])
            print(f"[{time.perf_counter() - started:6.0f}s] {row['key']} / {row['strategy']}: {row['status']}, "
                  f"{row.get('launches')} launches, {row.get('ooms')} OOMs, {row.get('wall')} s, {row.get('diff')}"
                  + (f"; undo {checks}" if checks else ""), file=sys.stderr, flush=True)
    done = [r for r in rows if r is not None]
    checks = sum(c.get("seconds") or 0 for r in done for c in r.get("checks") or [] if not c.get("cached"))
    print(f"bench: {time.perf_counter() - started:.0f} s in all, {checks:.0f} s of it undo probes", file=sys.stderr)
    print(format_table(done))
    print(f"\nShort names: {LEGEND}.")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(done, indent=1, default=str))


if __name__ == "__main__":
    main()
