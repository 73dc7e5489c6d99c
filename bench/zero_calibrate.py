"""The memory model's per-rank prediction under DeepSpeed ZeRO against what the simulated device measures per rank,
overall and for the generation phase alone.

Each configuration is a real two-rank TRL GRPO run of tests/scripts/grpo_tiny.py under ``torchrun`` (gloo, CPU)
on the simulated device with a budget it cannot reach, so nothing runs out of memory: plain DDP (stage 0), ZeRO-2
and ZeRO-3 on the tests' tiny model (activations a large share of its peak), on the wide one-layer model
(weights, gradients and AdamW state about 95% of it) and on the deep one (16 thin layers). The DeepSpeed config takes
the forms users write: with its buffer sizes left to transformers ("auto", the ``-z2``/``-z3`` rows), the stage alone
so that DeepSpeed's own defaults size its buffers (``-stage``: a 500,000,000-element reduce bucket, ZeRO-3's prefetch
bucket and persistence threshold), a JSON file with ``overlap_comm`` (two buckets), a JSON file with ZeRO-3's prefetch
off (``-pf0``: ``stage3_prefetch_bucket_size`` 0), and the config accelerate's DeepSpeed plugin builds from an
``accelerate launch --config_file`` YAML with ``distributed_type: DEEPSPEED`` and ``zero_stage`` (``-yaml``, the
script without ``use_cpu`` as recipes are written). The ``-nogather`` rows set ``ds3_gather_for_generation=False``
(the ``zero3_gather`` rung); their twins keep TRL's default, the whole model gathered on every rank to generate.

The script runs under bench/_phase_rank.py, which resets the simulated device's peak at each phase boundary of the
GRPO step (bench/_phases.py) and records each phase's peak per rank. The measured figure is the larger of the two
ranks' peak allocated bytes (overall: the largest phase; the second table: the generation phase, from
``_generate_and_score_completions`` to the end of ``_generate``); the prediction is ``estimate(..., world_size=2,
simulated=True)`` for the knobs and prompt length the run itself reported (its RunReport's attempt and facts), its
``peak_alloc_bytes`` and its ``phases["generation"]``. (DeepSpeed steps the optimizer inside ``backward``, so the
measured ``forward_backward`` phase holds the optimizer step too.)

    python bench/zero_calibrate.py               # every configuration (about 30 min on 2 busy CPU cores)
    python bench/zero_calibrate.py --only wide-z2 --only tiny-z3
    python bench/zero_calibrate.py --json rows.json
    python bench/zero_calibrate.py --from-json tests/fixtures/deepspeed/zero-rows-simulated.json   # the tables again

Needs DeepSpeed (``pip install --no-build-isolation deepspeed==0.19.8 einops``); its first start builds its
shared-memory communication op (about 30 s, then cached in ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _phases import run_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
PHASED = ROOT / "bench" / "_phase_rank.py"  # runs the script with each phase's peak recorded per rank
for p in (ROOT, SCRIPTS):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


SGD_PF0 = ("--optim", "sgd", "--max-completion-length", "16", "--gradient-accumulation-steps", "4")
LORA = ("--lora-r", "8", "--max-completion-length", "16")


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a variant of tests/scripts/build_tiny_model.py
    stage: int  # 0: plain DDP
    args: tuple[str, ...] = ()
    form: str = "auto"  # auto: buffers "auto"; stage: the stage alone; overlap: JSON with overlap_comm; yaml


CONFIGS = [
    Config("tiny-ddp", "tiny", 0),
    Config("tiny-z2", "tiny", 2),
    Config("tiny-z3", "tiny", 3),
    Config("tiny-z2-c128", "tiny", 2, ("--max-completion-length", "128")),
    Config("wide-ddp", "wide", 0),
    Config("wide-z2", "wide", 2),
    Config("wide-z3", "wide", 3),
    Config("wide-z2-g8", "wide", 2, ("--num-generations", "8", "--per-device-train-batch-size", "8")),
    Config("tiny-z3-nogather", "tiny", 3, ("--no-ds3-gather",)),
    Config("wide-z3-nogather", "wide", 3, ("--no-ds3-gather",)),
    # 16 thin layers with SGD (no optimizer state): generating with the whole model gathered is as large as the
    # training step; without the gather, DeepSpeed's prefetcher still holds about half of the model at once
    Config("deep-z3-sgd", "deep", 3, ("--optim", "sgd")),
    Config("deep-z3-sgd-nogather", "deep", 3, ("--optim", "sgd", "--no-ds3-gather")),
    # tests/test_deepspeed.py's run: the same with DeepSpeed's prefetch off (stage3_prefetch_bucket_size 0),
    # 16-token completions and 4 micro-batches per generation (16 rows generated per rank): without the gather,
    # generation holds one submodule's parameters, and the optimizer step is the peak
    Config("deep-z3-sgd-pf0", "deep", 3, SGD_PF0, form="prefetch0"),
    Config("deep-z3-sgd-pf0-nogather", "deep", 3, (*SGD_PF0, "--no-ds3-gather"), form="prefetch0"),
    # LoRA (r 8 on every projection, 16-token completions), the prefetch off: generation with the whole model gathered
    # is the peak; without the gather DeepSpeed 0.19.8 keeps the frozen base gathered through the training step's
    # checkpointed backward instead, and that step runs about 50 times slower (not modelled)
    Config("deep-z3-lora-pf0", "deep", 3, LORA, form="prefetch0"),
    Config("deep-z3-lora-pf0-nogather", "deep", 3, (*LORA, "--no-ds3-gather"), form="prefetch0"),
    Config("tiny-z2-stage", "tiny", 2, form="stage"),
    Config("tiny-z3-stage", "tiny", 3, form="stage"),
    Config("wide-z2-stage", "wide", 2, form="stage"),
    Config("wide-z3-stage", "wide", 3, form="stage"),
    Config("tiny-z2-overlap", "tiny", 2, form="overlap"),
    Config("tiny-z2-yaml", "tiny", 2, form="yaml"),
    Config("tiny-z3-yaml", "tiny", 3, form="yaml"),
]

# ZeRO-3 with transformers' "auto" sizes but DeepSpeed's prefetch off (tests/test_deepspeed.py's config)
PREFETCH0 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 0,
                                   "stage3_param_persistence_threshold": "auto"},
             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
             "gradient_clipping": "auto"}

# accelerate's DeepSpeed YAML as TRL's examples/accelerate_configs and open-r1's recipes ship it (two processes)
YAML = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed" / "accelerate-deepspeed.yaml").read_text()


def launch(cfg: Config, tmp: Path, port: int) -> list[str]:
    """The launcher and the script's DeepSpeed arguments for ``cfg``'s form."""
    if cfg.form == "yaml":
        yaml = tmp / "accelerate.yaml"
        yaml.write_text(YAML.format(stage=cfg.stage, init=str(cfg.stage == 3).lower()))
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml), "--main_process_port",
                str(port), str(PHASED), str(SCRIPTS / "grpo_tiny.py"), "--no-use-cpu"]
    ds: list[str] = []
    if cfg.stage and cfg.form == "auto":
        ds = ["--deepspeed", str(cfg.stage)]
    elif cfg.stage and cfg.form == "stage":
        ds = ["--deepspeed", f"stage{cfg.stage}"]
    elif cfg.stage and cfg.form == "prefetch0":
        path = tmp / "ds_prefetch0.json"
        path.write_text(json.dumps(PREFETCH0))
        ds = ["--deepspeed", str(path)]
    elif cfg.stage and cfg.form == "overlap":
        path = tmp / "ds_overlap.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": cfg.stage, "overlap_comm": True},
                                    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                    "train_batch_size": "auto"}))
        ds = ["--deepspeed", str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            str(PHASED), str(SCRIPTS / "grpo_tiny.py"), *ds]


def measure(cfg: Config, model: str, work: Path, timeout: float) -> dict[str, Any]:
    """One run under oomguard (no probe, no prediction, no pre-flight: the config runs as it is)."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = work / cfg.name
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "oomguard", "run", "--simulate-gpu", "8GiB", "--simulate-context", "0",
           "--no-probe", "--no-predict", "--no-preflight", "--max-attempts", "1", "--report", str(tmp / "report.json"),
           "--workdir", str(tmp / "wd"), "--lock", str(tmp / "lock.json"), "--", *launch(cfg, tmp, port),
           "--model", model, "--output-dir", str(tmp / "out"), "--max-steps", "2", "--max-completion-length", "64",
           *cfg.args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOMGUARD_BENCH_PHASES": str(tmp / "phases")}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    t0 = time.monotonic()
    # its own session, so that a timeout ends the launcher and the ranks too, not oomguard alone
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{cfg.name}: no end after {timeout:.0f} s (--timeout)") from None
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    rep = json.loads((tmp / "report.json").read_text()) if (tmp / "report.json").exists() else None
    if rep is None or rep["status"] not in ("fits", "stable"):
        raise SystemExit(f"{cfg.name}: the run did not fit ({rep and rep['status']}):\n{out.stderr[-3000:]}")
    ranks = sorted((tmp / "phases").glob("rank*.json"))
    if len(ranks) != 2:
        raise SystemExit(f"{cfg.name}: {len(ranks)} ranks recorded their phases, not 2:\n{out.stderr[-3000:]}")
    phases = [json.loads(r.read_text())["phases"] for r in ranks]
    return {"name": cfg.name, "stage": cfg.stage, "form": cfg.form, "knobs": rep["attempts"][0]["knobs"],
            "facts": rep.get("facts") or {},
            # each rank's peak: the largest of its phases' (the peak is reset at every phase boundary)
            "peaks": [max(p.values()) for p in phases], "phases": phases,
            "seconds": round(time.monotonic() - t0, 1), "config": _config(model)}


def _config(model: str) -> dict[str, Any]:
    return json.loads((Path(model) / "config.json").read_text())


def predict(row: dict[str, Any]) -> Any:
    """The Estimate for the run's knobs and longest prompt, two ranks, the simulated device."""
    from oomguard.memory.estimate import ModelSpec, estimate
    from oomguard.vocab.knobs import Knobs

    spec = ModelSpec.from_config(row["config"])
    knobs = Knobs(**row["knobs"])
    prompt = row["facts"].get("prompt_tokens_max")
    return estimate(spec, knobs, world_size=2, prompt_tokens=prompt, simulated=True)


def generation_table(rows: list[dict[str, Any]]) -> list[float]:
    """The generation phase alone: each rank's peak while generating (from the start of
    ``_generate_and_score_completions`` to the end of ``_generate``, ZeRO-3's gather for generation included), the
    larger rank's, against ``Estimate.phases["generation"]``."""
    errors = []
    print("\n| config | stage | ds3_gather_for_generation | generation, measured per rank | measured (max rank) | "
          "predicted | error |\n|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        if not row.get("phases"):
            continue
        ranks = [p["generation"] for p in row["phases"]]
        measured, predicted = max(ranks), predict(row).phases["generation"]
        err = predicted / measured - 1
        errors.append(abs(err))
        gather = row["knobs"].get("ds3_gather_for_generation")
        gather = "" if row["stage"] != 3 else "False" if gather is False else "True (TRL's default)"
        print(f"| {row['name']} | {row['stage']} | {gather} | {' / '.join(f'{r / 2**20:.1f}' for r in ranks)} MiB | "
              f"{measured / 2**20:.1f} MiB | {predicted / 2**20:.1f} MiB | {err:+.1%} |")
    if errors:
        print(f"\ngeneration: median |error| {sorted(errors)[len(errors) // 2]:.1%}, max {max(errors):.1%} "
              f"({len(errors)} rows)")
    return errors


def main(argv: list[str] | None = None) -> int:
    a = run_args(__doc__.split("\n\n")[0], 1800.0).parse_args(argv)
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
    else:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            print("DeepSpeed is not installed: pip install --no-build-isolation deepspeed==0.19.8 einops")
            return 2
        from build_tiny_model import VARIANTS, build

        chosen = [c for c in CONFIGS if not a.only or c.name in a.only]
        work = Path(tempfile.mkdtemp(prefix="oomguard-zero-"))
        try:
            models = {v: str(build(work / "models" / v, **VARIANTS[v])) for v in sorted({c.model for c in chosen})}
            rows = []
            for c in chosen:
                rows.append(measure(c, models[c.model], work / "runs", a.timeout))
                print(f"measured {c.name}: {max(rows[-1]['peaks']) / 2**20:.1f} MiB in {rows[-1]['seconds']} s",
                      flush=True)
                if a.json:  # as they come: a configuration that fails later loses none of them
                    Path(a.json).write_text(json.dumps(rows, indent=1))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    errors = []
    print("\n| config | stage | measured (max rank) | predicted | error |\n|---|---:|---:|---:|---:|")
    for row in rows:
        measured, predicted = max(row["peaks"]), predict(row).peak_alloc_bytes
        err = predicted / measured - 1
        errors.append(abs(err))
        print(f"| {row['name']} | {row['stage']} | {measured / 2**20:.1f} MiB | {predicted / 2**20:.1f} MiB | "
              f"{err:+.1%} |")
    if errors:
        print(f"\nmedian |error| {sorted(errors)[len(errors) // 2]:.1%}, max {max(errors):.1%} ({len(errors)} rows)")
    generation_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
