"""Issue 11's 24 GiB case on a real GPU: TRL's GRPO quickstart with Qwen2.5-3B under `oomguard run --gpu-memory`.

The model is a random-initialised Qwen2.5-3B (the published shape, saved in bf16 with a word-level tokenizer over
its whole vocabulary: ``gpu_calibrate.build``). The client script is TRL's quickstart shape: ``GRPOTrainer(model=
"<path>", reward_funcs=<a length reward>, train_dataset=<64 prompts of 100-200 tokens>, args=GRPOConfig(output_dir,
max_steps=3, logging_steps=1, report_to=[], save_strategy="no"))``, everything else TRL 1.16's defaults: the model
given by name is loaded in float32, 8 prompts x 8 generations per step, 512-token completions, gradient
checkpointing, fused AdamW. The one addition is ``processing_class=PreTrainedTokenizerFast.from_pretrained(path)``:
transformers 5 maps ``model_type: qwen2`` to ``Qwen2Tokenizer``, which cannot read a word-level vocabulary and turns
every prompt into zero tokens (checked on CPU; the 2026-11-22 quickstart reports recorded 2-token prompts, which fits).
It changes no memory figure other than the prompt length it makes real.

Each strategy is one `oomguard run --gpu-memory 24GiB` (default: oomguard's own defaults; ``--minimize`` adds a run
with ``--minimize``; ``--strategy quality-first`` one with that ladder), with a fresh calibration store so every run
starts from the built-in fit, as a user's first run would. The table (from the RunReports) gives launches, real OOMs,
pre-flight stops, wall time, the final diff, the stable peak against the cap, whether the completion length and the
generations were kept, and whether the diff is minimal: a remedy is needed when some attempt of the run itself had
the stable config without it and ran out of memory (``--minimize`` trials count); ``--check-minimal`` replays the
stable lock without each remedy still unproven (one 1-step probe each) while the time budget lasts.

    python3 bench/gpu_quickstart.py --out $OUT                      # build + default strategy: ~5 minutes on an H100
    python3 bench/gpu_quickstart.py --out $OUT --skip-build --strategy minimize --timeout 540   # model reused (the
                                                           # machine must still be warm; else drop --skip-build)
    python3 bench/gpu_quickstart.py --from-report tests/fixtures/h100/report-qwen3b-quickstart-24GiB-default.json

Writes OUT/quickstart-<strategy>.json (the RunReport), OUT/quickstart-<strategy>.log (the run's output) and
OUT/quickstart-summary.json (the table's rows). ``--deadline`` (570 s) bounds the whole script so it ends, with its
table, inside one 10-minute device call; a run cut short by it is interrupted with SIGINT, and oomguard still writes
its report.
"""

from __future__ import annotations

import argparse
import ast
import calendar
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# The installed oomguard (the wheel carried to the GPU machine) wins over the checkout, so the repository root goes
# last, only for a checkout that nothing installed. oomguard is imported here, before gpu_calibrate (which puts the
# root first on sys.path) is.
if importlib.util.find_spec("oomguard") is None:
    sys.path.append(str(ROOT))
from scenarios import compact_diff, minimal_verdict, missed_targets, undo_groups, undo_lock  # noqa: E402

import oomguard  # noqa: E402, F401
from oomguard.vocab.files import read_json_object  # noqa: E402

GiB = 1024**3
ARCH = "q3b"
VOCAB = 151936  # Qwen2.5's vocabulary (gpu_calibrate.ARCHS["q3b"])
# Strategy name -> the flags it adds to `oomguard run` (probes, prediction and the pre-flight stay at their defaults).
STRATEGIES: dict[str, tuple[str, ...]] = {
    "default": (),
    "minimize": ("--minimize",),
    "quality-first": ("--ladder", "quality-first"),
}
# What GRPOTrainer and GRPOConfig receive in the client: anything else would no longer be TRL's defaults.
TRAINER_KWARGS = ("model", "reward_funcs", "train_dataset", "args", "processing_class")
CONFIG_KWARGS = ("output_dir", "max_steps", "logging_steps", "report_to", "save_strategy")

CLIENT = '''"""TRL's GRPO quickstart shape with a random-initialised Qwen2.5-3B (written by bench/gpu_quickstart.py).

Everything not named here is TRL 1.16's default: the model given by name (loaded in float32), 8 prompts x 8
generations per step, 512-token completions, gradient checkpointing, fused AdamW. processing_class is passed because
transformers 5 maps model_type qwen2 to Qwen2Tokenizer, which reads no word-level vocabulary (every prompt would be
empty); it changes nothing else.
"""

import random

from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

MODEL = {model!r}
OUTPUT_DIR = {output_dir!r}
VOCAB_SIZE = {vocab}


def make_prompts(n={rows}, shortest={shortest}, longest={longest}, seed=0):
    """n prompts of shortest..longest words; the word-level tokenizer makes each word one token."""
    rng = random.Random(seed)
    return [" ".join(f"w{{rng.randrange(3, VOCAB_SIZE)}}" for _ in range(rng.randint(shortest, longest)))
            for _ in range(n)]


def reward_len(completions, **kwargs):
    """TRL's documentation example: completions close to 20 words score best."""
    return [-abs(20 - len(c.split())) for c in completions]


if __name__ == "__main__":
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=reward_len,
        train_dataset=Dataset.from_dict({{"prompt": make_prompts()}}),
        args=GRPOConfig(output_dir=OUTPUT_DIR, max_steps=3, logging_steps=1, report_to=[], save_strategy="no"),
        processing_class=PreTrainedTokenizerFast.from_pretrained(MODEL),
    )
    trainer.train()
'''


# ---------------------------------------------------------------------------------------------------------------
# Pure parts (tests/test_gpu_scripts.py)


def client_source(model: str, output_dir: str, rows: int = 64, shortest: int = 100, longest: int = 200) -> str:
    """The client script's text: TRL's quickstart shape on ``model`` (see the module docstring).

    >>> src = client_source("/models/q3b", "/tmp/out")
    >>> compile(src, "client.py", "exec") is not None and "model=MODEL" in src and "'/models/q3b'" in src
    True
    """
    return CLIENT.format(model=model, output_dir=output_dir, vocab=VOCAB, rows=rows, shortest=shortest,
                         longest=longest)


def call_keywords(source: str, name: str) -> dict[str, ast.expr]:
    """The keyword arguments of the (single) call to ``name`` in ``source``, as AST nodes.

    >>> sorted(call_keywords("f(a=1, b=g(c=2))", "g"))
    ['c']
    """
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == name]
    if len(calls) != 1:
        raise ValueError(f"expected one call to {name}, found {len(calls)}")
    return {k.arg: k.value for k in calls[0].keywords if k.arg is not None}


def no_cuda_message(probe: Mapping[str, Any] | None, why: str = "") -> str | None:
    """The one line to stop on when there is no CUDA device (None when there is one).

    >>> no_cuda_message({"cuda": False, "torch": "2.13.0+cpu"})
    'gpu_quickstart: no CUDA device is available (torch 2.13.0+cpu); this benchmark needs an NVIDIA GPU: run it on the device machine (--from-report tables a saved report without one)'
    >>> no_cuda_message({"cuda": True, "name": "NVIDIA H100 80GB HBM3"}) is None
    True
    """
    if probe is None:
        return f"gpu_quickstart: cannot start torch to look for a GPU ({why or 'no answer'})"
    if probe.get("cuda"):
        return None
    where = f" (torch {probe['torch']})" if probe.get("torch") else ""
    return (f"gpu_quickstart: no CUDA device is available{where}; this benchmark needs an NVIDIA GPU: run it on the "
            "device machine (--from-report tables a saved report without one)")


def _attempts(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [a for a in report.get("attempts") or [] if isinstance(a, Mapping)]


def final_knobs(report: Mapping[str, Any]) -> dict[str, Any]:
    """The config the run ended with: ``stable``, else the last attempt's knobs (a run cut short)."""
    stable = report.get("stable")
    if isinstance(stable, Mapping):
        return dict(stable)
    attempts = _attempts(report)
    return dict(attempts[-1].get("knobs") or {}) if attempts else {}


def stable_attempt(report: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The attempt that measured the final config: see :func:`stable_peak`."""
    final = final_knobs(report)
    ok = [a for a in _attempts(report) if a.get("outcome") == "ok" and isinstance(a.get("peak_bytes"), int)]
    same = [a for a in ok if dict(a.get("knobs") or {}) == final]
    return (same or ok)[-1] if (same or ok) else None


def stable_peak(report: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The allocated peak of the final config and the kind of attempt that measured it: the last successful attempt
    with exactly the final knobs (the real run when it finished; a probe or minimize trial when the run was cut
    short), else the last successful attempt.

    >>> stable_peak({"stable": {"C": 1}, "attempts": [{"outcome": "ok", "knobs": {"C": 1}, "peak_bytes": 5,
    ...              "kind": "probe"}, {"outcome": "ok", "knobs": {"C": 1}, "peak_bytes": 7, "kind": "run"}]})
    (7, 'run')
    >>> stable_peak({"attempts": [{"outcome": "ok", "knobs": {"C": 2}, "peak_bytes": 5, "kind": "minimize"},
    ...              {"outcome": "interrupted", "knobs": {"C": 2}, "peak_bytes": None, "kind": "run"}]})
    (5, 'minimize')
    """
    pick = stable_attempt(report)
    return (pick["peak_bytes"], pick.get("kind")) if pick else (None, None)


def kept_cell(report: Mapping[str, Any]) -> str:
    """Whether the completion length and the generations per prompt were kept: "yes (C=512, G=8)" or what changed.

    >>> kept_cell({"original": {"max_completion_length": 512, "num_generations": 8},
    ...            "stable": {"max_completion_length": 256, "num_generations": 8}})
    'no: C 512→256'
    >>> kept_cell({"original": {"max_completion_length": 512, "num_generations": 8},
    ...            "stable": {"max_completion_length": 512, "num_generations": 8}})
    'yes (C=512, G=8)'
    """
    original = report.get("original") or {}
    final = final_knobs(report)
    changed = []
    for knob, short in (("max_completion_length", "C"), ("num_generations", "G")):
        a, b = original.get(knob), final.get(knob)
        if a != b:
            changed.append(f"{short} {a}→{b}")
    if changed:
        return "no: " + ", ".join(changed)
    return f"yes (C={original.get('max_completion_length')}, G={original.get('num_generations')})"


def minimal_from_attempts(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """For each remedy in the diff, what the run's own attempts prove about it: the final config with that remedy's
    knobs set back to the user's values, run as an attempt (a probe, the first attempt, a ``--minimize`` trial).
    ``result``: "oom" (needed), "fits" (needless), "predicted" (a pre-flight stop: no measurement) or "unchecked".

    >>> rep = {"original": {"C": 512, "lora_r": 0}, "stable": {"C": 512, "lora_r": 16},
    ...        "diff": [{"knob": "lora_r", "from": 0, "to": 16, "remedy": "lora"}],
    ...        "attempts": [{"index": 1, "knobs": {"C": 512, "lora_r": 0}, "outcome": "oom"},
    ...                     {"index": 2, "knobs": {"C": 512, "lora_r": 16}, "outcome": "ok"}]}
    >>> minimal_from_attempts(rep)
    [{'remedy': 'lora', 'knobs': ['lora_r'], 'result': 'oom', 'attempt': 1}]
    """
    final = final_knobs(report)
    diff = [r for r in report.get("diff") or [] if isinstance(r, Mapping)]
    attempts = _attempts(report)
    checks = []
    for remedy, rows in undo_groups(diff):
        undone = dict(final)
        for r in rows:
            undone[str(r.get("knob"))] = r.get("from")
        seen = [a for a in attempts if dict(a.get("knobs") or {}) == undone]
        measured = [a for a in seen if a.get("outcome") in ("ok", "oom")]
        pick = (measured or seen)[-1] if (measured or seen) else None
        result = {"ok": "fits", "oom": "oom", "predicted": "predicted"}.get(str(pick.get("outcome"))) if pick else None
        checks.append({"remedy": remedy, "knobs": [str(r.get("knob")) for r in rows], "result": result or "unchecked",
                       "attempt": pick.get("index") if pick and result else None})
    return checks


def minimal_cell(checks: Sequence[Mapping[str, Any]] | None) -> str:
    """bench/scenarios' verdict ("yes", "no: X needless"), with remedies no attempt proved needed counted instead of
    listed one by one.

    >>> minimal_cell([{"remedy": "lora", "result": "oom"}, {"remedy": "optimizer_8bit", "result": "unchecked"},
    ...               {"remedy": "empty_cache", "result": "predicted"}])
    '? 2 of 3 unproven: optimizer_8bit, empty_cache'
    >>> minimal_cell([{"remedy": "lora", "result": "fits"}, {"remedy": "bf16_load", "result": "unchecked"}])
    'no: lora needless'
    """
    if checks is None:
        return ""
    verdict = minimal_verdict(checks)
    if not verdict.startswith("unknown"):
        return verdict
    open_ = [str(c.get("remedy")) for c in checks if c.get("result") not in ("oom", "invalid", "fits")]
    return f"? {len(open_)} of {len(checks)} unproven: {', '.join(open_)}"


def _iso_seconds(text: Any) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(str(text)[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def summarise_run(report: Mapping[str, Any] | None, capacity: int, *, strategy: str = "default",
                  wall: float | None = None, checks: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One table row from a RunReport; ``wall`` defaults to the report's started..finished.

    >>> row = summarise_run({"status": "stable", "started": "2026-11-22T12:23:19+0000",
    ...     "finished": "2026-11-22T12:26:47+0000", "original": {"max_completion_length": 512, "num_generations": 8,
    ...     "lora_r": 0}, "stable": {"max_completion_length": 512, "num_generations": 8, "lora_r": 16},
    ...     "diff": [{"knob": "lora_r", "from": 0, "to": 16, "remedy": "lora"}],
    ...     "attempts": [{"index": 1, "outcome": "oom", "kind": "probe", "knobs": {"max_completion_length": 512,
    ...     "num_generations": 8, "lora_r": 0}}, {"index": 2, "outcome": "ok", "kind": "run", "peak_bytes": 12 * GiB,
    ...     "knobs": {"max_completion_length": 512, "num_generations": 8, "lora_r": 16}}]}, 24 * GiB)
    >>> row["launches"], row["ooms"], row["wall"], row["diff"], row["peak_fraction"], row["minimal"], row["misses"]
    (2, 1, 208.0, 'lora_r=16', 0.5, 'yes', '')
    """
    rep: Mapping[str, Any] = report if isinstance(report, Mapping) else {}
    attempts = _attempts(rep)
    outcomes = [a.get("outcome") for a in attempts]
    if wall is None:
        a, b = _iso_seconds(rep.get("started")), _iso_seconds(rep.get("finished"))
        wall = b - a if a is not None and b is not None else None
    peak, peak_kind = stable_peak(rep) if rep else (None, None)
    own = minimal_from_attempts(rep) if rep.get("diff") is not None else None
    merged = own
    if own is not None and checks:  # probes run by --check-minimal fill in what the run itself left unchecked
        extra = {c.get("remedy"): c for c in checks}
        merged = [dict(extra[c["remedy"]]) if c["result"] in ("unchecked", "predicted") and c["remedy"] in extra
                  else c for c in own]
    row: dict[str, Any] = {
        "strategy": strategy,
        "status": rep.get("status") or "no report",
        "launches": len(attempts) if rep else None,
        "ooms": outcomes.count("oom") if rep else None,
        "predicted": outcomes.count("predicted") if rep else None,
        "first_predicted": bool(outcomes) and outcomes[0] == "predicted",
        "wall": round(wall, 1) if wall is not None else None,
        "diff": compact_diff(rep.get("diff") or []) if rep else None,
        "peak_bytes": peak,
        "peak_kind": peak_kind,
        "peak_reserved_bytes": (stable_attempt(rep) or {}).get("peak_reserved_bytes") if rep else None,
        "peak_fraction": round(peak / capacity, 3) if peak and capacity else None,
        "kept": kept_cell(rep) if rep else None,
        "checks": merged,
        "minimal": minimal_cell(merged),
    }
    row["misses"] = missed_targets({**row, "minimal": minimal_verdict(merged) if merged is not None else ""})
    return row


COLUMNS = (("strategy", "strategy"), ("status", "status"), ("launches", "launches"), ("real OOMs", "ooms"),
           ("pre-flight stops", "predicted"), ("wall", "wall"), ("final diff", "diff"), ("stable peak", "peak"),
           ("C/G kept", "kept"), ("minimal", "minimal"), ("misses", "misses"))
RIGHT = {"launches", "ooms", "predicted", "wall", "peak"}


def _cell(key: str, row: Mapping[str, Any]) -> str:
    if key == "peak":
        if not row.get("peak_bytes"):
            return ""
        kind = "" if row.get("peak_kind") in (None, "run") else f" ({row['peak_kind']})"
        frac = f", {100 * row['peak_fraction']:.0f}%" if row.get("peak_fraction") else ""
        return f"{row['peak_bytes'] / GiB:.2f} GiB{frac}{kind}"
    v = row.get(key)
    if v is None:
        return ""
    if key == "wall":
        return f"{v:.0f} s"
    return str(v).replace("|", "\\|")


def format_table(rows: Sequence[Mapping[str, Any]], capacity: int) -> str:
    """A markdown table of the runs; the peak column is the stable peak and its share of the cap.

    >>> print(format_table([{"strategy": "default", "status": "stable", "launches": 3, "ooms": 0, "predicted": 1,
    ...     "wall": 201.4, "diff": "lora_r=16", "peak_bytes": 12 * GiB, "peak_fraction": 0.5, "peak_kind": "run",
    ...     "kept": "yes (C=512, G=8)", "minimal": "yes", "misses": ""}], 24 * GiB))
    | strategy | status | launches | real OOMs | pre-flight stops | wall | final diff | stable peak of 24.00 GiB | C/G kept | minimal | misses |
    |---|---|---:|---:|---:|---:|---|---:|---|---|---|
    | default | stable | 3 | 0 | 1 | 201 s | lora_r=16 | 12.00 GiB, 50% | yes (C=512, G=8) | yes |  |
    """
    head = [f"stable peak of {capacity / GiB:.2f} GiB" if k == "peak" else h for h, k in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if k in RIGHT else "---" for _, k in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(k, r) for _, k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def oomguard_command(strategy: str, client: Path, out: Path, work: Path, gpu_memory: str,
                     max_time: float | None = None, python: str = sys.executable) -> list[str]:
    """The `oomguard run` line for one strategy (report into OUT, lock and attempt records into the work dir).

    >>> cmd = oomguard_command("minimize", Path("/w/client.py"), Path("/o"), Path("/w"), "24GiB", python="python")
    >>> " ".join(cmd)
    'python -m oomguard run --gpu-memory 24GiB --report /o/quickstart-minimize.json --lock /w/minimize/oomguard.lock.json --workdir /w/minimize/runs --minimize -- python /w/client.py'
    """
    flags = list(STRATEGIES[strategy])
    if max_time is not None:
        flags += ["--max-time", f"{max_time:.0f}"]
    return [python, "-m", "oomguard", "run", "--gpu-memory", gpu_memory,
            "--report", str(out / f"quickstart-{strategy}.json"),
            "--lock", str(work / strategy / "oomguard.lock.json"), "--workdir", str(work / strategy / "runs"),
            *flags, "--", python, str(client)]


# ---------------------------------------------------------------------------------------------------------------
# Running (needs the GPU)


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float,
               cwd: Path | None = None) -> tuple[int | None, float, bool]:
    """Run ``cmd`` in ``cwd``, all its output into ``log`` and oomguard's own lines echoed; past ``timeout``, SIGINT
    (oomguard stops the attempt's process group and writes its report), then SIGTERM, then SIGKILL. Returns (exit
    code, wall seconds, whether it was cut short).

    ``python -m oomguard`` puts its working directory first on sys.path, so it runs outside the repository root: the
    installed oomguard, not the checkout's, is the one measured."""
    t0 = time.monotonic()
    with log.open("w", encoding="utf-8", errors="replace") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                errors="replace", bufsize=1, cwd=cwd)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if line.startswith("oomguard"):
                    print("  " + line.rstrip()[:300], flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        cut = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            cut = True
            print(f"  timed out after {timeout:.0f} s: interrupting oomguard (it writes its report)", flush=True)
            for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
    return proc.returncode, time.monotonic() - t0, cut


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               OOMGUARD_CACHE_DIR=str(cache))
    for var in ("OOMGUARD_PLAN", "OOMGUARD_SIMULATE_GPU"):
        env.pop(var, None)
    return env


def check_minimal(strategy: str, lock: Mapping[str, Any], checks: list[dict[str, Any]], client: Path, work: Path,
                  gpu_memory: str, deadline: float) -> list[dict[str, Any]]:
    """Replay the stable lock without each remedy the run left unproven (a 1-step probe each, while time lasts)."""
    from oomguard.vocab.knobs import KNOB_NAMES

    diff = [r for r in lock.get("diff") or [] if isinstance(r, Mapping)]
    groups = dict(undo_groups(diff))
    done = []
    for c in checks:
        if c["result"] not in ("unchecked", "predicted") or c["remedy"] not in groups:
            continue
        left = deadline - time.monotonic()
        if left < 150:
            done.append({**c, "result": "unchecked", "note": "no time left"})
            continue
        edited = undo_lock(lock, groups[c["remedy"]], frozenset(KNOB_NAMES))
        if edited is None:
            continue
        d = work / strategy / f"undo-{c['remedy']}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "undo.lock.json").write_text(json.dumps(edited, indent=1))
        cmd = [sys.executable, "-m", "oomguard", "run", "--gpu-memory", gpu_memory, "--config",
               str(d / "undo.lock.json"), "--probe-steps", "1", "--max-attempts", "1", "--no-predict",
               "--report", str(d / "report.json"), "--lock", str(d / "lock.json"), "--workdir", str(d / "runs"),
               "--", sys.executable, str(client)]
        print(f"check: is {c['remedy']} needed? replaying the lock without it (1-step probe)", flush=True)
        rc, wall, _ = run_logged(cmd, _env(d / "cache"), d / "log.txt", left - 50, cwd=d)
        rep = read_json_object(d / "report.json") or {}
        attempts = _attempts(rep)
        outcome = attempts[-1].get("outcome") if attempts else None
        result = {"ok": "fits", "oom": "oom", "predicted": "predicted"}.get(str(outcome),
                                                                            "invalid" if rc == 2 else "error")
        done.append({**c, "result": result, "attempt": None, "seconds": round(wall, 1),
                     "peak_bytes": attempts[-1].get("peak_bytes") if attempts else None})
        print(f"  {c['remedy']}: {result} ({wall:.0f} s)", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-quickstart-out", help="where reports, logs and the summary go ($OUT)")
    p.add_argument("--gpu-memory", default="24GiB", help="the per-process cap oomguard sets (default 24GiB)")
    p.add_argument("--workdir", default=str(ROOT / ".oomguard" / "gpu-quickstart"),
                   help="the model, the client script, locks and attempt records (default: .oomguard/gpu-quickstart "
                        "in the repository, ignored by git)")
    p.add_argument("--skip-build", action="store_true", help="reuse the model already built in the work dir")
    p.add_argument("--strategy", action="append", choices=list(STRATEGIES),
                   help="the strategies to run, repeatable (default: default)")
    p.add_argument("--minimize", action="store_true", help="also run `oomguard run --minimize` (about 5 more minutes)")
    p.add_argument("--check-minimal", action="store_true",
                   help="replay the stable lock without each remedy the run did not prove needed (1 probe each)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds for one `oomguard run` (default 480)")
    p.add_argument("--deadline", type=float, default=570.0,
                   help="seconds for the whole script (default 570: one 10-minute device call); no run starts "
                        "without 120 s left, and a run is interrupted at the deadline")
    p.add_argument("--from-report", action="append", metavar="PATH",
                   help="only print the table of saved RunReport(s); needs no GPU")
    a = p.parse_args(argv)
    from oomguard.vocab.sizes import SizeError, parse_size

    try:
        capacity = parse_size(a.gpu_memory)
    except SizeError as e:
        return _fail(f"gpu_quickstart: --gpu-memory {a.gpu_memory!r}: {e}")

    if a.from_report:
        rows = []
        for path in a.from_report:
            rep = read_json_object(Path(path))
            if rep is None:
                return _fail(f"gpu_quickstart: {path}: not a readable RunReport")
            rows.append(summarise_run(rep, capacity, strategy=Path(path).stem))
        print(format_table(rows, capacity))
        return 0

    start = time.monotonic()
    deadline = start + a.deadline
    strategies = list(dict.fromkeys(a.strategy or ["default"]))
    if a.minimize and "minimize" not in strategies:
        strategies.append("minimize")

    import gpu_calibrate

    info, why = gpu_calibrate.child(["--probe"], 300)
    message = no_cuda_message(info, why)
    if message:
        return _fail(message)
    assert info is not None
    out, work = Path(a.out).resolve(), Path(a.workdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    print(f"device: {info['name']}, {info['total'] / GiB:.1f} GiB, torch {info['torch']}; cap {a.gpu_memory}",
          flush=True)
    model = work / ARCH
    t = time.monotonic()
    if a.skip_build:
        if not (model / "config.json").exists():
            return _fail(f"gpu_quickstart: --skip-build, but {model} holds no model; run once without --skip-build")
    elif not (model / "config.json").exists():
        print(f"building random {ARCH} (Qwen2.5-3B shape) in {model} ...", flush=True)
        res, why = gpu_calibrate.child(["--build", ARCH, str(model)], max(60.0, deadline - time.monotonic() - 240))
        if res is None:
            return _fail(f"gpu_quickstart: building the model failed: {why[:300]}")
    build_seconds = time.monotonic() - t
    client = work / "client.py"
    client.write_text(client_source(str(model), str(work / "trainer-output")))

    rows, runs = [], []
    for strategy in strategies:
        left = deadline - time.monotonic()
        if left < 120:
            print(f"{strategy}: skipped, {left:.0f} s left of --deadline", flush=True)
            rows.append({"strategy": strategy, "status": "skipped (deadline)"})
            continue
        budget = min(a.timeout, left - 50)  # an interrupted run takes up to 45 s more to stop
        cache = work / strategy / "cache"
        shutil.rmtree(cache, ignore_errors=True)  # a first run on this machine: the built-in calibration
        report_path = out / f"quickstart-{strategy}.json"
        cmd = oomguard_command(strategy, client, out, work, a.gpu_memory, max_time=max(60.0, budget - 90))
        print(f"{strategy}: {' '.join(cmd)}", flush=True)
        rc, wall, cut = run_logged(cmd, _env(cache), out / f"quickstart-{strategy}.log", budget, cwd=work)
        report = read_json_object(report_path)
        lock = read_json_object(work / strategy / "oomguard.lock.json")
        checks: list[dict[str, Any]] = []
        row = summarise_run(report, capacity, strategy=strategy, wall=wall)
        if a.check_minimal and report and report.get("status") == "stable" and lock and row.get("checks"):
            checks = check_minimal(strategy, lock, row["checks"], client, work, a.gpu_memory, deadline)
            row = summarise_run(report, capacity, strategy=strategy, wall=wall, checks=checks)
        row.update(exit_code=rc, cut_short=cut)
        rows.append(row)
        runs.append({"strategy": strategy, "command": cmd, "exit_code": rc, "wall": round(wall, 1), "cut_short": cut,
                     "report": str(report_path) if report else None})
    print()
    print(format_table(rows, capacity))
    print("\nC max_completion_length, G num_generations, bs per_device_train_batch_size, ES expandable_segments, "
          "split_mb max_split_size_mb, lora_mod lora_target_modules. minimal: each remedy proved needed by an attempt "
          "without it that ran out of memory. misses: the targets missed (stable; at most 1 real OOM, none after a "
          "pre-flight stop; at most 3 launches; a minimal diff)")
    summary = {"device": info, "gpu_memory": a.gpu_memory, "capacity": capacity, "model": str(model),
               "build_seconds": round(build_seconds, 1), "client": client.read_text(), "runs": runs, "rows": rows,
               "total_seconds": round(time.monotonic() - start, 1)}
    (out / "quickstart-summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwrote {out}/quickstart-*.json, *.log and quickstart-summary.json; total {summary['total_seconds']:.0f} s")
    return 0 if all(r.get("status") == "stable" for r in rows) else 1


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
