"""Write the parts of the documentation whose source is the code, so that they cannot drift from it.

A page marks a generated part with two comments; everything between them is replaced by what the code says now:

    <!-- generated: knobs -->
    ...
    <!-- end generated -->

``python docs/generate.py`` rewrites every such part in ``docs/**/*.md`` and ``README.md``; ``--check`` only says which
files are out of date (exit 1). ``tests/test_docs.py`` runs the check, so a renamed option, a new knob, remedy, report
field or log event, or a changed version range fails the suite until the pages are regenerated.

The parts (the name after ``generated:``, and the code each one is read from):

- ``cli COMMAND``: a command's usage, its help and every option as ``--help`` prints it (click, ``oomguard/cli.py``)
- ``exit-codes``: the exit codes of every command (``oomguard/cli.py`` RUN_EXIT_CODES and PLAN_EXIT_CODES,
  ``oomguard/vocab/protocol.py``)
- ``knobs``: every knob, its type, TRL's default, its values, where it reaches the training process (``oomguard knobs
  --json``, the knob table ``oomguard/vocab/knobtable.py``)
- ``stack-spellings``: the knobs ms-swift and an Unsloth notebook spell in their own words (``oomguard.vocab.stacks``)
- ``remedies``: every remedy, its trade, its checkpoint policy, its ladder parameters (``oomguard.strategies.REGISTRY``)
- ``ladders``: the shipped ladders and their rungs in order (``oomguard ladders --json``)
- ``report-fields``, ``attempt-fields``, ``lock-fields``: the keys of the RunReport, an attempt and a lock, as
  ``oomguard/vocab/records.py`` and the supervisor write them (a key without a description here fails the generator)
- ``json-log``: the events of ``oomguard run --json-log`` and their keys, read by running the reporter
- ``versions``: the supported Python and package versions (``pyproject.toml``: the one place that states them)

Why committed pages and a check, not a build-time hook: the pages read the same on GitHub, in an editor and in the
built site; a change to an option shows up in review as a change to its page; and ``mkdocs build`` needs nothing
but the Markdown.

>>> render("a\\n<!-- generated: exit-codes -->\\nold\\n<!-- end generated -->\\nb\\n").count("**75**")
1
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+)(?: (?P<arg>[\w-]+))? -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.S)


def _cell(text: Any) -> str:
    """One Markdown table cell: no pipes or newlines of its own."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _code(text: str) -> str:
    """Inline code that may hold a pipe (a code span cannot escape one in every Markdown: GitHub, Python-Markdown),
    kept on one line in a table."""
    import html

    return '<code style="white-space:nowrap">' + html.escape(text).replace("|", "&#124;") + "</code>"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- the commands ---------------------------------------------------------------------------------------------------
def cli(name: str) -> str:
    """One command as ``oomguard NAME --help`` shows it: usage, help text, options (with defaults and ranges)."""
    import click

    from oomguard.cli import main

    top = click.Context(main, info_name="oomguard")
    cmd = main if name == "oomguard" else main.get_command(top, name)
    assert cmd is not None, f"no command {name!r}"
    ctx = top if name == "oomguard" else click.Context(cmd, info_name=name, parent=top)
    usage = " ".join(["oomguard", *([] if name == "oomguard" else [name]), *cmd.collect_usage_pieces(ctx)])
    out = [f"```text\n{usage}\n```\n", _help_text(cmd.help or "")]
    rows = []
    for p in cmd.get_params(ctx):
        record = p.get_help_record(ctx) if isinstance(p, click.Option) else None
        if record is None:  # an argument: the usage line names it
            continue
        opts, help_ = record
        rows.append([_code(opts), help_])
    out.append(_table(["option", "meaning"], rows))
    if cmd.epilog:
        out.append("\n" + _help_text(cmd.epilog))
    return "\n".join(out)


def _help_text(text: str) -> str:
    """click's help text as Markdown: a paragraph click prints as it is (marked ``\\b``) becomes a code block, the
    others stay prose."""
    import inspect
    import textwrap

    md = []
    for p in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        if p.startswith("\b"):
            md.append("```text\n" + textwrap.dedent(p[1:].strip("\n")) + "\n```\n")
        elif p.strip():
            md.append(" ".join(line.strip() for line in p.splitlines()) + "\n")
    return "\n".join(md)


def exit_codes(_: str | None = None) -> str:
    from oomguard.cli import EXIT_USAGE, PLAN_EXIT_CODES, RUN_EXIT_CODES
    from oomguard.vocab.protocol import EXIT_LOCK_UNMET, EXIT_OOM, EXIT_PREDICTED

    rows = [["run", code, text] for code, text in RUN_EXIT_CODES]
    rows += [["plan", code, text] for code, text in PLAN_EXIT_CODES]
    rows += [["analyze", "0", "at least one file was read (whether or not it held an OOM)"],
             ["analyze", str(EXIT_USAGE), "nothing could be read (each unreadable path gets a one-line note)"],
             ["knobs, ladders", "0", "always"],
             ["(training process)", str(EXIT_OOM), "a training process that ran out of memory, after writing its "
                                                  "CrashRecord: read by oomguard, never passed to you"],
             ["(training process)", str(EXIT_PREDICTED), "a training process stopped by the pre-flight check: read "
                                                        "by oomguard, never passed to you"],
             ["(training process)", str(EXIT_LOCK_UNMET), "a training process of a replay that does not run a value "
                                                         "the lock pins, stopped before it trained: `oomguard run` "
                                                         "exits 2 too"]]
    return _table(["command", "code", "meaning"], [[f"`{c}`" if not c.startswith("(") else c, f"**{code}**", t]
                                                  for c, code, t in rows])


# -- knobs, remedies, ladders ---------------------------------------------------------------------------------------
def knobs(_: str | None = None) -> str:
    from oomguard.vocab.knobtable import TABLE, describe

    rows = []
    for r in describe():
        d = r["default"]
        default = "unset" if d is None else ",".join(map(str, d)) if isinstance(d, list) else str(d)
        rows.append([f"`{r['name']}`", f"`{r['type']}`", f"`{default}`", TABLE[r["name"]].range_text(),
                     ", ".join(r["reaches"]), r["meaning"]])
    return _table(["knob", "type", "TRL default", "values", "reaches", "meaning"], rows)


def stack_spellings(_: str | None = None) -> str:
    """The knobs a stack around TRL spells in its own words (``oomguard.vocab.stacks``), each stack a column; the
    GRPOConfig fields they take under TRL's names are left out (a sentence on the page says so)."""
    from oomguard.vocab.stacks import STACKS

    names = [k for t in STACKS.values() for s in t.spellings if not s.trl_name for k in s.knobs]
    rows = []
    for knob in dict.fromkeys(names):
        cells = []
        for name, table in STACKS.items():
            s = table.spelling(knob)
            if s is None:
                cells.append("")
                continue
            together = [k for k in s.knobs if k != knob]
            args = (" ".join(f"`--{a}`" for a in s.args) if name == "swift"
                    else f"`{s.point}(" + ", ".join(s.args) + ")`")
            cells.append(args + (f" (with {', '.join(f'`{k}`' for k in together)})" if together else "")
                         + "".join(f" (with `{n}=True`)" for n in s.needs))
        rows.append([f"`{knob}`", *cells])
    return _table(["knob", *(f"{'ms-swift' if n == 'swift' else 'Unsloth'}" for n in STACKS)], rows)


def remedies(_: str | None = None) -> str:
    """One section per remedy (a table of seven columns would not fit a page)."""
    from oomguard.strategies import REGISTRY

    out = []
    for name in sorted(REGISTRY):
        r = REGISTRY[name]
        params = "; ".join(f"`{k} = {json.dumps(v.default)}` ({v.takes()}: {v.text})" for k, v in r.params.items())
        trade = f"**{r.cost}**" + (f": {r.trade_note}" if r.trade_note else "")
        lines = [f"### `{name}`", "", r.summary, "",
                 f"- costs {trade}",
                 f"- checkpoint after it: `{r.resume}`",
                 "- writes " + (", ".join(f"`{k}`" for k in r.changes) or "no knob"),
                 f"- ladder parameters: {params or 'none'}"]
        weighed = _weighed(r)
        if weighed:
            share = "a step's time" if r.cost == "speed" else "what GRPO learns from"
            lines.append(f"- weighed within {r.cost}, as a share of {share}: {weighed}")
        if r.graded:
            lines.append("- graded: it steps again on later passes, down to its floor")
        if r.requires:
            lines.append("- needs " + ", ".join(f"`{p}`" for p in r.requires) + " in the training environment")
        if r.addresses != "gpu":
            lines.append(f"- used for {r.addresses} OOMs only")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def _weighed(r: Any) -> str:
    """What a rung of a weighed class (speed, signal) costs within it, as declared: on the remedy, or on each knob it
    writes (the knob table's ``speed_cost``/``signal_cost``)."""
    from oomguard.strategies import WEIGHED
    from oomguard.vocab.knobtable import TABLE

    attr = WEIGHED.get(r.cost)
    if attr is None:
        return ""
    own = getattr(r, attr)
    parts = [own.text()] if own is not None else []  # a quantity read from several knobs
    parts += [f"`{k}`: {c.text()}" for k in r.changes if k not in r.follows and (c := getattr(TABLE[k], attr))
              is not None]
    return "; ".join(parts)


def ladders(_: str | None = None) -> str:
    from oomguard.decide.ladder import available_ladders, describe, load_ladder

    out = []
    for lad in describe([load_ladder(name) for name in available_ladders()]):
        rungs = ", ".join(f"`{r['remedy']}`" for r in lad["rungs"])
        host = ", ".join(f"`{r}`" for r in lad["host_rungs"])
        out.append(f"- **`{lad['name']}`**: {lad['description']} Rungs in order: {rungs}"
                   + (f"; host RAM: {host}." if host else "."))
    return "\n".join(out) + "\n"


# -- records --------------------------------------------------------------------------------------------------------
REPORT_KEYS = {
    "schema": "`oomguard.report/1`; a reader refuses another major version",
    "status": "`stable`, `leaked` (the run leaks memory: it finished every step through restarts from its "
              "checkpoints with your config, or stopped at the leak: [late OOMs](../how-to/late-ooms.md)), "
              "`exhausted`, `failed` or `interrupted`",
    "message": "the one-line verdict the terminal printed",
    "exit_code": "the code oomguard exited with",
    "command": "the command as launched (the interpreter resolved to its path)",
    "ladder": "the ladder's name",
    "started": "when the run started (ISO 8601)",
    "finished": "when it ended",
    "device": "the device the run judged against: `capacity`, `simulate_gpu`, `simulate_context`, `gpu_memory`, "
              "`context` (the CUDA context measured under `--gpu-memory`: `context_bytes`, `measured_bytes`, `how`, "
              "`allocator_bytes`), `preflight_margin` and `preflight_margin_source`, `calibration` (which fit of the "
              "memory model was used)",
    "attempts": "one object per launch, in order (the table below)",
    "original": "TRL's defaults overlaid with what your script set (recorded where it passes them: its `GRPOConfig`, "
                "its trainer's arguments, a front-end's loader and LoRA); null for a knob it never said (`unseen`)",
    "unseen": "only when the command stopped before it said some of its values (a load stopped before its "
                  "`GRPOConfig` exists): those knobs, null in `original` and marked `unseen` in the diff, never "
                  "TRL's defaults",
    "stable": "the knobs of the config that held, as its training process reported it ran them (its own `ran` "
              "events: your script's values, oomguard's overrides, and any change made after them), or null",
    "diff": "rows `{knob, from, to, remedy}` (and `action` where a rung did something narrower than its name, e.g. "
            "`fewer_prompts_per_step`); when the run did not become stable, what was tried. `remedy` is a rung's name, "
            "`lock` for a replayed lock's override, or `adaptation` for a change made so that the command runs where "
            "it is launched or can resume, not for memory (`use_cpu=True` on a machine without a GPU; "
            "`checkpoint_every`, the checkpoints a leak's restarts or `--checkpoint-every` add)",
    "facts": "what the training process reported about the run: model shape, prompt lengths, world size, packages, "
             "where its DeepSpeed config comes from (`deepspeed`: `GRPOConfig` or `accelerate`), the installed TRL "
             "(`trl_version`, `trl_head`: `fused` or `logits`, `trl_lacks`: the knobs it has no way to take), the "
             "generation engine (`generation_engine`: `generate`, `continuous_batching`, `vllm_colocate`, "
             "`vllm_server`, `unsloth_fast_inference` or `rollout_func`), and what oomguard could not observe of the "
             "run (`unobserved`, one line each: the model is never sure of such a run)",
    "alternatives": "configs predicted to fit that trade differently: `avoids` (the cost classes of the choice each "
                    "leaves as you had them), `keeps`, `trades` (its own changes, each with its cost class), "
                    "`predicted_bytes`, `versus_choice` (predicted step time against the choice's: -0.2 is 20% "
                    "faster), `overrides`, `lock`, `experiment`",
    "experiment": "only when stable: what the stable config kept of your experiment and what it changed, "
                  "`{kept: [...], changed: [{remedy, cost, change, slowdown}]}` (`slowdown`: a speed change's "
                  "predicted extra time per step)",
    "group": "only in a job on several nodes: `{node, nodes, leader, session, source}`",
    "kept_at": "only in the top-level copy (`--report`): the run's own file it copies",
}
ATTEMPT_KEYS = {
    "index": "1-based launch number",
    "kind": "`probe`, `run` or `minimize` (a probe without one change)",
    "knobs": "the knobs of this launch as its training process reported it ran them (the climb's where it reported "
             "none)",
    "remedies": "the rungs in force",
    "outcome": "`ok`, `oom`, `predicted` (a pre-flight stop), `failed` or `interrupted`",
    "exit_code": "the command's exit code",
    "seconds": "wall time of the launch",
    "peak_bytes": "the trainer's peak allocated bytes",
    "peak_reserved_bytes": "the peak reserved by the allocator",
    "predicted_bytes": "what the memory model predicted for this config",
    "oom": "the diagnosis of its OOM, an `analyze` finding (see [JSON output](json-output.md)), or null",
    "step": "the last training step reached",
    "climbed": "the rungs climbed after this attempt (`a+b`)",
    "skipped": "rungs passed over after it, `[{remedy, reason}]`",
    "resume": "how this attempt continued from a checkpoint, if it did",
    "note": "what a `minimize` probe left out, and whether it is needed",
    "memory": "`guard` only: live bytes before the call and after a failed one was released",
    "generated": "configs oomguard generated for this attempt (a DeepSpeed config: `path`, `replaces`)",
    "choice": "after this attempt, what the memory model chose: `rungs`, `dropped` (with "
              "`predicted_bytes_without`), `relaxed` (`knob`, `climbed`, `chosen`), `after: probe` when refining",
    "override_error": "applying oomguard's overrides failed: where, and the error",
    "unmet": "only when a replay stopped before training: the lock's value its training process did not run, `{knob, "
             "locked, ran, where}` ([replay a lock](../how-to/replay-a-lock.md#a-replay-runs-every-value-of-the-lock))",
    "probe_decision": "launched as a probe unless the memory model is sure of its config: what the training process "
                      "decided (`decided`: `run` or `probe`), `why`, the `predicted_bytes` and the `limit` it is sure "
                      "up to ([one launch when the model is sure](../concepts/preflight-and-probes.md))",
    "trace": "only when the training process sent one: its main process's memory per step (thinned), `[{step, kept, "
             "peak, reserved, host_rss, prompt_tokens, completion_tokens}]` ([late OOMs](../how-to/late-ooms.md))",
    "miss": "only where its measured peak was far from the memory model's prediction (beyond twice the model's "
            "measured error): `predicted_bytes`, `measured_bytes` (`at_least` after an OOM: what was live plus the "
            "request), `factor`, the `term` that missed most (`state`, `activations` or `generation buffers`) with "
            "`term_predicted_bytes` and `term_measured_bytes`, and the `phase` "
            "([a model proven wrong](../concepts/preflight-and-probes.md#a-model-proven-wrong-is-unsure))",
    "trend": "only after an OOM the trace explains: its `verdicts` (`kind`: `leak`, `host-leak`, `fragmentation-growth` or "
             "`long-sample`, with their numbers and `evidence`, the sentence the terminal printed), `used`, `skipped`",
}
LOCK_KEYS = {
    "schema": "`oomguard.lock/1`",
    "created": "when it was written",
    "command": "the command as launched",
    "ladder": "the ladder's name",
    "overrides": "the knobs `--config` applies on top of your script's own values, each whatever TRL's default or "
                 "your script's value is: the part that is replayed, and checked in the training process",
    "original": "your config (as in the report)",
    "stable": "the config that held",
    "world_size": "the ranks the config was checked for",
    "diff": "as in the report",
    "kept_at": "only in the top-level copy (`--lock`): the run's own file it copies",
}


def _keys_table(keys: list[str], described: dict[str, str], what: str) -> str:
    missing = [k for k in keys if k not in described]
    if missing:
        raise SystemExit(f"docs/generate.py: describe the {what} key(s) {', '.join(missing)} (in {what.upper()}_KEYS)")
    return _table(["key", "meaning"], [[f"`{k}`", described[k]] for k in described if k in keys])


def report_fields(_: str | None = None) -> str:
    from oomguard.vocab.records import RunReport

    keys = [*RunReport("stable", [], {}, None, [], group={}, experiment={}, unseen=["lora_r"]).to_dict(), "kept_at"]
    return _keys_table(keys, REPORT_KEYS, "report")


def attempt_fields(_: str | None = None) -> str:
    from oomguard.vocab.records import Attempt

    return _keys_table(list(Attempt(1, {}, [], "ok", 0, 1.0, trace=[{}], trend={}, miss={}).to_dict()), ATTEMPT_KEYS,
                       "attempt")


def lock_fields(_: str | None = None) -> str:
    from oomguard.decide.ladder import load_ladder
    from oomguard.display.ui import JsonLogReporter
    from oomguard.run.supervisor import RunOptions, Supervisor
    from oomguard.vocab.knobs import TRL_DEFAULTS

    sup = Supervisor(["python", "train.py"], RunOptions(ladder=load_ladder("default"),
                                                        workdir=Path("/nonexistent")), JsonLogReporter())
    return _keys_table([*sup.writer.lock(TRL_DEFAULTS, {}, {}, []).to_dict(), "kept_at"], LOCK_KEYS, "lock")


# -- the JSON log ---------------------------------------------------------------------------------------------------
EVENTS = {
    "attempt_start": "a launch begins: its index, kind, the rungs and overrides in force",
    "progress": "at most every 5 s while an attempt runs, and at once when an attempt or a trainer starts (a script "
                "that builds several trainers counts each one's steps against its own `max_steps`)",
    "attempt_end": "a launch ended, and how",
    "climb": "the climb decided: the rungs climbed together, the knobs changed, the rungs skipped and why",
    "message": "any other line the terminal would print (a fallback, a note)",
    "finish": "the run ended: status, message, the diff, where the report and lock are",
}


def json_log(_: str | None = None) -> str:
    from oomguard.display.ui import JsonLogReporter, Progress
    from oomguard.vocab.records import Attempt, RunReport

    stream = io.StringIO()
    rep = JsonLogReporter()
    rep.stream = stream
    rep.attempt_start(1, 8, [], {}, "probe")
    rep.progress(Progress(index=1, max_attempts=8))
    rep.attempt_end(Attempt(1, {}, [], "ok", 0, 1.0), None)
    rep.decision([], None, {})
    rep.message("text")
    rep.finish(RunReport("stable", [], {}, {}, []), Path("oomguard-report.json"), Path("oomguard.lock.json"))
    seen = [json.loads(line) for line in stream.getvalue().splitlines()]
    missing = [e["oomguard"] for e in seen if e["oomguard"] not in EVENTS]
    if missing:
        raise SystemExit(f"docs/generate.py: describe the --json-log event(s) {', '.join(missing)} (in EVENTS)")
    rows = []
    for e in seen:
        keys = [k for k in e if k != "oomguard"]
        shown = "every key of an [attempt](report.md#attempts)" if e["oomguard"] == "attempt_end" else ", ".join(f"`{k}`" for k in keys)
        rows.append([f"`{e['oomguard']}`", EVENTS[e["oomguard"]], shown])
    return _table(["`oomguard`", "when", "keys"], rows)


# -- versions -------------------------------------------------------------------------------------------------------
VERSIONED = ("trl", "transformers", "torch", "accelerate", "peft", "bitsandbytes", "datasets", "deepspeed")


def versions(_: str | None = None) -> str:
    """The supported versions, read from pyproject.toml (the one place that states them)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {}
    for spec in [*project["dependencies"], *project["optional-dependencies"].get("test", [])]:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*([^;]*)", spec)
        if m and m.group(1).lower() in VERSIONED:
            reqs.setdefault(m.group(1).lower(), m.group(2).strip())
    rows = [["Python", project["requires-python"]]]
    rows += [[("DeepSpeed (optional: the ZeRO rungs; the tests pin it)" if name == "deepspeed" else name),
              ", ".join(p.strip() for p in reqs[name].split(","))] for name in VERSIONED if name in reqs]
    return _table(["package", "versions"], [[n, f"`{v}`"] for n, v in rows])


GENERATORS: dict[str, Callable[[str | None], str]] = {
    "cli": cli, "exit-codes": exit_codes, "knobs": knobs, "stack-spellings": stack_spellings, "remedies": remedies,
    "ladders": ladders,
    "report-fields": report_fields, "attempt-fields": attempt_fields, "lock-fields": lock_fields,
    "json-log": json_log, "versions": versions,
}


def render(text: str) -> str:
    """``text`` with every generated part written anew."""
    def part(m: re.Match[str]) -> str:
        try:
            make = GENERATORS[m.group("name")]
        except KeyError:
            raise SystemExit(f"docs/generate.py: no generator named {m.group('name')!r}") from None
        return m.group(1) + make(m.group("arg")) + m.group(5)

    return BLOCK.sub(part, text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def stale() -> list[Path]:
    """The pages whose generated parts differ from what the code says now."""
    return [p for p in pages() if render(text := p.read_text(encoding="utf-8")) != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only list the pages that are out of date (exit 1 if any)")
    args = ap.parse_args(argv)
    if args.check:
        old = stale()
        for p in old:
            print(f"out of date: {p.relative_to(ROOT)} (run: python docs/generate.py)")
        return 1 if old else 0
    for p in pages():
        text = p.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            p.write_text(new, encoding="utf-8")
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
