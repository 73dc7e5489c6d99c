"""`oomguard plan` against what real GPUs did: the public GRPO reports of tests/fixtures/reports/corpus.json replayed.

    python bench/reports.py                 # the table and its summary (offline, a few seconds)
    python bench/reports.py --json rows.json
    python bench/reports.py --only trl-3456

Each report is replayed as a user would replay it with `oomguard plan`: the model's config.json (the report's
``model_fixture`` under tests/fixtures/models/), the card's ``total_capacity_gib``, the report's ranks, its config as
stated and its assumptions, and ``--trl-version`` the report's TRL release, whose defaults fill what neither states.
Nothing is tuned per report: the translation from a report to plan's inputs is the same rules for every report
(:func:`replay`). The verdict is the one `oomguard run` would act on (:func:`verdict_of`); it agrees with the report
when it says the config fits and the run worked, or says it does not fit and the run ran out of memory (or vLLM could
not start). A report whose outcome the model cannot judge (no model config, no card size, the OOM on a vLLM server's
own GPU, the host's memory, memory creeping up over hundreds of steps) is listed with why.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from oomguard.decide.ladder import load_ladder  # noqa: E402
from oomguard.decide.plan import Prediction, make_plan, plan_images  # noqa: E402
from oomguard.decide.planconfig import planned  # noqa: E402
from oomguard.memory.estimate import EstimateError, load_model_spec  # noqa: E402
from oomguard.vocab.knobs import TRL_DEFAULTS  # noqa: E402
from oomguard.vocab.knobtable import TABLE  # noqa: E402
from oomguard.vocab.sizes import format_size  # noqa: E402

CORPUS = ROOT / "tests" / "fixtures" / "reports" / "corpus.json"
MODELS = ROOT / "tests" / "fixtures" / "models"
GiB = 2**30
# What plan took before --trl-version: the installed TRL (the newest tested release)
INSTALLED = "1.16.0"

# The verdicts, as `oomguard run` acts on them
SURE, PROBE, STOP = "sure fits", "probe first", "predicted not to fit"
# How a verdict stands to a report's outcome
AGREE, OPTIMISTIC, PESSIMISTIC, REFUSED, FAILED, NOT_JUDGED = (
    "agree", "optimistic", "pessimistic", "refused", "failed", "not judged")

# The report's config keys that are knobs under another name
RENAMED = {"torch_dtype": "dtype", "vllm_max_model_len": "vllm_max_model_length"}
KNOBS = set(TRL_DEFAULTS.to_dict())


@dataclass
class Replay:
    """What `oomguard plan` is given for one report."""

    model: Path
    capacity: int
    world_size: int
    values: dict[str, Any]
    prompt_tokens: int | None
    trl_version: str | None
    images_per_prompt: int | None = None
    image_size: str | None = None
    prompt_tokens_images: bool = False
    freeze_vision: bool = False
    stack: str = "trl"
    completions_per_device: int | None = None  # what the report says each device ran (TRL 0.14: batch x G)


@dataclass
class Row:
    id: str
    model: str
    card: str
    outcome: str
    verdict: str = ""
    peak: int | None = None
    capacity: int | None = None
    phase: str = ""
    agreement: str = NOT_JUDGED
    reason: str = ""
    notes: list[str] = field(default_factory=list)


# -- reading a report's values -----------------------------------------------------------------------------------
def value_text(text: Any) -> Any:
    """An assumption's value: the text before its first ``;`` (the rest says why)."""
    return text.split(";", 1)[0].strip() if isinstance(text, str) else text


def number(text: Any) -> float | None:
    """The first number in a value (``~300``, ``0.50``, ``2 (TRL 0.14)``), or None (``unknown``, ``unset``)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return text
    m = re.match(r"\s*~?\s*(\d+(?:\.\d+)?(?:e-?\d+)?)", str(text))
    return float(m.group(1)) if m else None


def boolean(text: Any) -> bool | None:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    return True if t.startswith("true") else False if t.startswith("false") else None


DTYPE_WORDS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32", "fp8": "fp8"}


def dtype(text: Any) -> str | None:
    m = re.search(r"\b(bfloat16|bf16|float16|fp16|float32|fp32|fp8)\b", str(text))
    return DTYPE_WORDS[m.group(1)] if m else None


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_modules(text: Any) -> Any:
    """LoRA's targets as a report writes them: a list, ``all-linear``, ``q,k,v,o,gate,up,down`` or ``attention +
    MLP`` (the seven projections), or ``(q_proj, v_proj)``; None where the text names none (PEFT's default)."""
    if isinstance(text, list):
        return tuple(text)
    t = str(text)
    if "all-linear" in t:
        return "all-linear"
    named = re.findall(r"\b([a-z_]+_proj)\b", t)
    if named:
        return tuple(named)
    if re.search(r"\bq,\s*k,\s*v,\s*o,\s*gate,\s*up,\s*down\b", t) or "attention + MLP" in t:
        return PROJECTIONS
    return None


def knob_value(name: str, raw: Any) -> Any:
    """A report's value for knob ``name`` in the knob's type (the knob table's), or None where the report leaves it
    unknown."""
    v = value_text(raw)
    if isinstance(v, str) and v.lower().startswith(("unknown", "unset", "n/a", "not ")):
        return None
    if name == "dtype":
        return dtype(v)
    if name == "lora_target_modules":
        return target_modules(v)
    if name == "zero_stage" and str(v).lower().startswith("none"):
        return 0
    if name == "gradient_checkpointing" and str(v).lower().startswith("unsloth"):
        return True  # Unsloth's offloaded checkpointing: checkpointed, its inputs on the host (not modelled)
    kind = TABLE[name].kind
    if kind is bool:
        return boolean(v)
    if kind is int:
        n = number(v)
        return int(n) if n is not None else None
    if kind is float:
        return number(v)
    return str(v).split()[0] if v else None


def trl_release(report: dict[str, Any]) -> str | None:
    """The report's TRL release: the first version its ``trl_version`` names (``0.17-0.18`` is 0.17)."""
    m = re.search(r"\b(\d+\.\d+)(\.\d+)?", str(report.get("trl_version") or ""))
    if not m:
        return None
    return m.group(1) + (m.group(2) or ".0")


# -- a report as plan's inputs ------------------------------------------------------------------------------------
def not_judged(report: dict[str, Any]) -> str | None:
    """Why the memory model cannot judge this report's outcome, or None."""
    if not report.get("model_fixture"):
        return "no model config: the report's model has no config.json in tests/fixtures/models"
    if not (report.get("gpu") or {}).get("total_capacity_gib"):
        return "the card's memory is not stated"
    if report["config"].get("load_in_fp8"):
        return "FP8 weights (load_in_fp8): plan has no FP8 load"
    if report["outcome"] == "oom-host":
        return "the host's memory ran out, not the GPU's"
    phase = str(report.get("phase") or "")
    if report.get("vllm_server_gpus") and ("vLLM GPU" in phase or "server" in phase):
        return "the OOM was on the vLLM server's own GPU, which plan does not model"
    if re.search(r"\blate\b|grow", phase):
        return "memory crept up over many steps: a leak or a rare long sample, not one step's peak"
    return None


def replay(report: dict[str, Any]) -> Replay:
    """plan's inputs for ``report``: its config as stated, its assumptions for what it does not state (an
    ``X_effective`` assumption, what the run's own log showed, over X), the TRL release it implies."""
    config, assumed = report["config"], report["assumptions"]
    values: dict[str, Any] = {}
    for source in (assumed, config):  # the config's own values win
        for key, raw in source.items():
            name = RENAMED.get(key, key)
            if name in KNOBS:
                v = knob_value(name, raw)
                if v is not None:
                    values[name] = v
    for key, raw in assumed.items():
        if key.endswith("_effective") and key[:-len("_effective")] in KNOBS:
            v = knob_value(key[:-len("_effective")], raw)
            if v is not None:
                values[key[:-len("_effective")]] = v
    if config.get("train_type") == "full":
        values["lora_r"] = 0
    elif config.get("train_type") == "lora" and "lora_r" not in values:
        values["lora_r"] = 8  # ms-swift's default rank
    if report.get("vllm_server_gpus") and values.get("use_vllm"):
        values["vllm_mode"] = "server"
    stack = report.get("stack")
    if stack == "unsloth" and values.get("load_in_4bit") and "lora_r" not in values:
        values["lora_r"] = 16  # Unsloth's 4-bit load is for LoRA: get_peft_model's default rank
    # TRL 0.14 counts the batch in prompts: the release's reading (planconfig) must come to the report's own figure
    n = number(value_text(assumed.get("effective_completions_per_device")))
    completions = int(n) if n is not None else None
    if stack == "unsloth" and config.get("max_seq_length") and values.get("use_vllm"):
        values.setdefault("vllm_max_model_length", int(config["max_seq_length"]))
    images = config.get("images") or {}
    n_images = images.get("per_prompt") if isinstance(images, dict) else None
    if n_images is None and "images" in assumed:
        n = number(value_text(assumed["images"]))
        n_images = int(n) if n is not None else None
    size = None
    if isinstance(images, dict) and images.get("size"):
        m = re.match(r"(\d+)x(\d+)", images["size"])
        size = f"{m.group(1)}x{m.group(2)}" if m else None
    pt = number(value_text(assumed.get("prompt_tokens", config.get("prompt_tokens"))))
    prompt_tokens = int(pt) if pt is not None else None
    mpl = number(value_text(config.get("max_prompt_length", assumed.get("max_prompt_length"))))
    if mpl:  # TRL before 0.28 truncates prompts to max_prompt_length: the padded prompt is never longer
        values["max_prompt_tokens"] = int(mpl)
    values = {k: v for k, v in values.items() if v is not None}
    if stack == "swift" and "max_prompt_tokens" not in values:
        # ms-swift encodes prompts with its own template (bounded by max_length), not TRL's max_prompt_length
        values["max_prompt_tokens"] = None
    return Replay(model=MODELS / report["model_fixture"], capacity=int(report["gpu"]["total_capacity_gib"] * GiB),
                  world_size=int(report.get("world_size") or 1), values=values, prompt_tokens=prompt_tokens,
                  trl_version=trl_release(report), images_per_prompt=n_images, image_size=size,
                  prompt_tokens_images=bool(n_images), freeze_vision=config.get("freeze_vit", True) is not False
                  and config.get("train_type") == "full", stack="unsloth" if stack == "unsloth" else "trl",
                  completions_per_device=completions)


# -- the verdict, as `oomguard run` would act on it ---------------------------------------------------------------
def verdict_of(p: Prediction) -> str:
    """The verdict `oomguard run` acts on for plan's prediction (how its first launch starts): the one place this
    bench asks it."""
    return {"run": SURE, "probe": PROBE, "stopped": STOP, "stop": STOP}[p.launches()["first"]]


def fits(p: Prediction) -> bool:
    """Whether plan's figure says the config fits: the predicted peak within the card and a colocated vLLM able to
    start (what a report's outcome is compared with; the verdict says how sure plan is of it)."""
    return p.estimate.fits(p.capacity)


def predict(r: Replay, installed: bool = False) -> Prediction:
    """plan's prediction for ``r``, as `oomguard plan --trl-version` makes it (``installed``: as plan made it before
    it took a release, with the installed TRL's defaults and LM head, and TRL 0.14's batch of prompts given as the
    completions it meant)."""
    spec = load_model_spec(r.model)
    values = dict(r.values)
    if installed and r.completions_per_device:
        values["per_device_train_batch_size"] = r.completions_per_device
    asked = planned(values, trl_version=INSTALLED if installed else r.trl_version, given=not installed,
                    world_size=r.world_size, stack=None if installed else r.stack, freeze_vision=r.freeze_vision)
    image_facts, k = plan_images(spec, asked.knobs, r.model, r.images_per_prompt, r.image_size)
    if image_facts:
        image_facts["prompt_tokens_images"] = r.prompt_tokens_images
    facts = asked.facts.replace(**image_facts)
    lad = load_ladder("multi-gpu" if r.world_size > 1 or k.zero_stage else "default")
    # the built-in calibration (no device name): what a fresh machine's plan uses, never this machine's probes
    return make_plan(spec, k, r.capacity, ladder=lad, facts=facts, prompt_tokens=r.prompt_tokens)


def judge(report: dict[str, Any], installed: bool = False) -> Row:
    gpu = report.get("gpu") or {}
    row = Row(id=report["id"], model=str(report.get("model_fixture") or report.get("model")),
              card=f"{gpu.get('total_capacity_gib') or '?'} GiB x{report.get('world_size') or '?'}",
              outcome=report["outcome"])
    why = not_judged(report)
    if why:
        row.reason = why
        return row
    try:
        r = replay(report)
        p = predict(r, installed)
    except (ValueError, EstimateError, KeyError) as e:
        row.agreement, row.reason = REFUSED, str(e).splitlines()[0].replace(f"{ROOT}/", "")
        return row
    except Exception as e:  # a bench reports a crash as a row
        row.agreement, row.reason = FAILED, f"{type(e).__name__}: {e}".splitlines()[0]
        return row
    row.verdict, row.peak, row.capacity = verdict_of(p), p.estimate.peak_bytes, r.capacity
    row.phase = p.estimate.dominant_phase
    row.notes = list(p.estimate.notes)
    ok = report["outcome"] == "ok"
    said_fits = fits(p)
    row.agreement = AGREE if said_fits == ok else OPTIMISTIC if said_fits else PESSIMISTIC
    if row.agreement != AGREE:
        row.reason = miss_reason(report, p)
    return row


# Why a report the model still misses is missed, as far as the report tells: read from the report, never used to
# change what the bench replays (a miss stays in the table with its reason).
WHY_MISSED = {
    "trl-3124-vllm": "TRL 0.15 ran vLLM inside the trainer on a GPU of its own (plan: a server, so a probe first); the "
                     "same config without vLLM ran (trl-3124-novllm): the OOM came with vLLM, not with the step",
    "trl-3172": "the OOM was the script's own .to(\"cuda\") of the whole model before ZeRO-3 partitioned it, on each "
                "rank's current device: not a GRPO step",
    "swift-4311-qwen2.5-vl-3b-full": "a vision tower on a GPU is not measured (a probe first); the thread does not "
                                     "say where the memory went",
    "swift-4486-qwen2.5-3b-full-server": "a 3B full fine-tune under ZeRO-3 (and ZeRO-3 offload) on 96 GB cards ran "
                                         "out at the start: no term of one step comes near; the thread does not say "
                                         "where (a probe first)",
    "swift-3359-qwen2.5-7b-lora": "its prompts' length is not stated (HTML pages; plan's 256 assumed), and vLLM ran "
                                  "on a GPU of its own (a probe first)",
    "trl-3456-qwen3-1.7b": "TRL 0.17's defaults (no mixed precision, a reference model) are the date's guess: with "
                           "0.19's (bf16, no reference) plan predicts 80.0 GiB, and its 0.6B twin 47.9 GiB against "
                           "48.1 measured",
    "open-r1-59-zero3-offload": "4096-token completions without checkpointing, predicted over the card; the run "
                                "worked at 25 minutes a step: its completions rarely reached 4096 tokens, or it "
                                "checkpointed (not stated)",
    "unsloth-nb-gpt-oss-20b-t4": "Unsloth's 4-bit gpt-oss quantises its experts too; plan counts them in the compute "
                                 "dtype, as a 4-bit load of transformers leaves them",
}
UNSLOTH_MISS = ("Unsloth's vLLM shares the trainer's weights, its checkpointed inputs wait in host RAM and its loss is "
                "chunked: not modelled, so a probe first")


def miss_reason(report: dict[str, Any], p: Prediction) -> str:
    """The reason a miss is listed with: the one read from the report, else Unsloth's memory savings, else the three
    largest terms of the predicted peak."""
    if report["id"] in WHY_MISSED:
        return WHY_MISSED[report["id"]]
    if report.get("stack") == "unsloth":
        return UNSLOTH_MISS
    e = p.estimate
    big = sorted(((v, k) for k, v in e.breakdown.items() if v), reverse=True)[:3]
    return "largest terms: " + ", ".join(f"{k} {format_size(v)}" for v, k in big)


def rows(corpus: Path = CORPUS, only: str | None = None, installed: bool = False) -> list[Row]:
    data = json.loads(corpus.read_text())
    return [judge(r, installed) for r in data["reports"] if not only or only in r["id"]]


def summary(rs: list[Row]) -> dict[str, int]:
    c = Counter(r.agreement for r in rs)
    out = {k: c.get(k, 0) for k in (AGREE, OPTIMISTIC, PESSIMISTIC, REFUSED, FAILED, NOT_JUDGED)}
    out["optimistic sure on OOM reports"] = sum(1 for r in rs if r.agreement == OPTIMISTIC and r.verdict == SURE
                                                 and r.outcome != "ok")
    out["stopped on reports that ran"] = sum(1 for r in rs if r.outcome == "ok" and r.verdict == STOP)
    return out


def table(rs: list[Row]) -> list[str]:
    """The table's lines: one per report, then the summary."""
    head = (f"{'report':<37} {'model':<24} {'card':<14} {'verdict':<20} {'peak':>10} {'phase':<16} {'outcome':<8} "
            f"{'agrees':<11} reason")
    lines = [head, "-" * len(head)]
    for r in rs:
        peak = format_size(r.peak) if r.peak is not None else "-"
        lines.append(f"{r.id:<37} {r.model[:24]:<24} {r.card:<14} {r.verdict or '-':<20} {peak:>10} "
                     f"{r.phase.replace('forward_backward', 'forward/backward') or '-':<16} {r.outcome:<8} "
                     f"{r.agreement:<11} {r.reason}")
    s = summary(rs)
    lines += ["", f"{len(rs)} reports: " + ", ".join(f"{s[k]} {k}" for k in (AGREE, OPTIMISTIC, PESSIMISTIC, REFUSED,
                                                                               FAILED, NOT_JUDGED)),
              f"optimistic \"{SURE}\" on reports that ran out of memory: {s['optimistic sure on OOM reports']} "
              "(target 0)",
              f"\"{STOP}\" on reports that ran: {s['stopped on reports that ran']}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, metavar="ID", help="the reports whose id contains ID")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--installed", action="store_true",
                    help="replay as plan did before --trl-version: the installed TRL's defaults and LM head")
    a = ap.parse_args()
    rs = rows(only=a.only, installed=a.installed)
    print("\n".join(table(rs)))
    if a.json:
        a.json.write_text(json.dumps({"rows": [asdict(r) for r in rs], "summary": summary(rs)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
