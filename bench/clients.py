"""Does the default choice keep the experiment? Four client styles and the README's demo, at half their own peak.

Each client is a GRPO script as users write it (tests/scripts/clients/): TRL's quick start (the model given by name,
GRPOConfig's defaults), an open-r1-style script with a YAML recipe read by TrlParser, a two-rank `accelerate launch`
script, and `trl grpo --config`; plus the README's demo (examples/grpo_gsm8k.py). For each:

1. its own peak: the client run as it is on a roomy simulated device (`--no-preflight --no-probe`);
2. `oomguard run --simulate-gpu HALF` with default options (or the `--ladder` given), as a new user runs it.

Columns: the peak and the budget; launches, real OOMs and pre-flight stops; whether the stable config kept the
number of generations (G), the completion length (C), the prompts per optimizer step (P) and a full fine-tune (FT);
the diff; and the predicted peak of the last attempt against what it measured.

    python bench/clients.py [--only NAME]... [--ladder NAME] [--fraction 0.5] [--json rows.json] [--models DIR]

Run on 2 shared cores: about 15-25 minutes for the five clients (each: a roomy run, then a pre-flight stop, a probe
and the run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / "tests" / "scripts" / "clients"
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))

from scenarios import ENV, compact_diff  # noqa: E402

MiB = 2**20
PY = sys.executable
BIN = os.path.dirname(sys.executable)


@dataclass(frozen=True)
class Client:
    name: str
    command: Callable[[str, Path], list[str]]  # (model dir, scratch dir) -> the command
    world_size: int = 1


def _data(tmp: Path) -> str:
    """A local dataset directory for `trl grpo --dataset_name` (no hub here)."""
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    with open(data / "train.jsonl", "w", encoding="utf-8") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i}: tell me about the number {i}"}]}) + "\n")
    return str(data)


CLIENT_LIST = (
    Client("quickstart", lambda m, t: [PY, str(CLIENTS / "quickstart.py"), m, str(t / "out")]),
    Client("open-r1", lambda m, t: [PY, str(CLIENTS / "openr1.py"), "--config", str(CLIENTS / "openr1.yaml"),
                                    "--model_name_or_path", m, "--output_dir", str(t / "out")]),
    Client("accelerate-2", lambda m, t: [PY, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                         "--main_process_port", str(_port()), str(CLIENTS / "multi_rank.py"), m,
                                         str(t / "out")], world_size=2),
    Client("trl-grpo", lambda m, t: [os.path.join(BIN, "trl"), "grpo", "--config", str(CLIENTS / "trl_grpo.yaml"),
                                     "--model_name_or_path", m, "--dataset_name", _data(t), "--output_dir",
                                     str(t / "out")]),
    Client("demo", lambda m, t: [PY, str(ROOT / "examples" / "grpo_gsm8k.py")]),
)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oomguard(args: list[str], command: list[str], tmp: Path, tag: str) -> tuple[dict[str, Any] | None, float]:
    report = tmp / f"{tag}.json"
    cmd = [PY, "-m", "oomguard", "run", "--quiet", "--report", str(report), "--lock", str(tmp / f"{tag}.lock.json"),
           "--workdir", str(tmp / f"wd-{tag}"), *args, "--", *command]
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(CLIENTS), ENV.get("PYTHONPATH")])),
           "OOMGUARD_CACHE_DIR": str(tmp / "cache")}
    start = time.time()
    subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    data = json.loads(report.read_text()) if report.exists() else None
    return data, time.time() - start


def kept(report: Mapping[str, Any], world_size: int) -> dict[str, bool]:
    """Whether the stable config kept generations, completion length, prompts per step and a full fine-tune.

    >>> o = {"num_generations": 8, "max_completion_length": 256, "per_device_train_batch_size": 8,
    ...      "gradient_accumulation_steps": 1, "lora_r": 0}
    >>> kept({"original": o, "stable": {**o, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}}, 1)
    {'G': True, 'C': True, 'P': True, 'FT': True}
    """
    from oomguard.vocab.knobs import TRL_DEFAULTS, Knobs

    o = TRL_DEFAULTS.merged(Knobs.from_dict(report.get("original") or {}))
    s = TRL_DEFAULTS.merged(Knobs.from_dict(report.get("stable") or report.get("original") or {}))
    return {"G": s.num_generations == o.num_generations, "C": s.max_completion_length == o.max_completion_length,
            "P": abs(s.prompts_per_step(world_size) - o.prompts_per_step(world_size)) < 1e-9,
            "FT": bool(o.lora_r) or not (s.lora_r or s.load_in_4bit)}


def run_client(c: Client, model: str, ladder: str, fraction: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="oomguard-clients-") as d:
        tmp = Path(d)
        roomy, _ = oomguard(["--simulate-gpu", "8GiB", "--simulate-context", "0", "--no-preflight", "--no-probe"],
                            c.command(model, tmp), tmp, "roomy")
        peak = ((roomy or {}).get("attempts") or [{}])[-1].get("peak_bytes")
        row: dict[str, Any] = {"client": c.name, "peak": peak}
        if not peak:
            row["status"] = f"the roomy run did not finish: {(roomy or {}).get('message')}"
            return row
        budget = int(peak * fraction)
        rep, wall = oomguard(["--simulate-gpu", f"{budget // MiB}MiB", "--ladder", ladder], c.command(model, tmp), tmp,
                             "half")
        rep = rep or {}
        attempts = rep.get("attempts") or []
        last = attempts[-1] if attempts else {}
        row.update(budget=budget, status=rep.get("status"), launches=len(attempts), wall=round(wall),
                   ooms=sum(a.get("outcome") == "oom" for a in attempts),
                   stops=sum(a.get("outcome") == "predicted" for a in attempts),
                   kept=kept(rep, c.world_size) if rep.get("stable") else None,
                   diff=compact_diff(rep.get("diff") or []), predicted=last.get("predicted_bytes"),
                   measured=last.get("peak_bytes"), experiment=rep.get("experiment"),
                   alternatives=len(rep.get("alternatives") or []))
        return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| client | own peak | budget | status | launches | OOMs | stops | kept G/C/P/FT | predicted / measured "
            "| wall | diff |\n|---|---:|---:|---|---:|---:|---:|---|---|---:|---|")
    out = [head]
    for r in rows:
        k = r.get("kept")
        kept_cell = "/".join("y" if k[x] else "N" for x in ("G", "C", "P", "FT")) if k else ""
        pm = (f"{r['predicted'] / MiB:.0f} / {r['measured'] / MiB:.0f} MiB"
              if r.get("predicted") and r.get("measured") else "")
        out.append(f"| {r['client']} | {(r.get('peak') or 0) / MiB:.0f} MiB | {(r.get('budget') or 0) / MiB:.0f} MiB "
                   f"| {r.get('status')} | {r.get('launches', '')} | {r.get('ooms', '')} | {r.get('stops', '')} "
                   f"| {kept_cell} | {pm} | {r.get('wall', '')} s | {r.get('diff', '')} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=[c.name for c in CLIENT_LIST])
    p.add_argument("--ladder", default="default")
    p.add_argument("--fraction", type=float, default=0.5, help="the budget as a share of the client's own peak")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--models", default=None, help="build (or reuse) the tiny model in this directory")
    a = p.parse_args()
    from build_tiny_model import VARIANTS, build, key_of

    models = Path(a.models) if a.models else Path(tempfile.mkdtemp(prefix="oomguard-models-"))
    model = models / key_of(**VARIANTS["tiny"])
    if not (model / "oomguard-build.json").exists():
        build(str(model), **VARIANTS["tiny"])
    rows = []
    try:
        for c in CLIENT_LIST:
            if a.only and c.name not in a.only:
                continue
            rows.append(run_client(c, str(model), a.ladder, a.fraction))
            print(f"{c.name}: {rows[-1].get('status')}", file=sys.stderr, flush=True)
    finally:
        if not a.models:
            import shutil

            shutil.rmtree(models, ignore_errors=True)
    print(table(rows))
    for r in rows:
        for line in ((r.get("experiment") or {}) and _experiment(r["experiment"])):
            print(f"{r['client']}: {line}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


def _experiment(e: Mapping[str, Any]) -> list[str]:
    from oomguard.decide.experiment import experiment_lines

    return experiment_lines(e)


if __name__ == "__main__":
    main()
