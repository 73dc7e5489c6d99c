"""The `oomguard` command. It never imports torch: every heavy import happens inside the command that needs it."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import __version__

EXIT_USAGE = 2


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return ["run", "analyze", "plan", "ladders"]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="oomguard")
def main() -> None:
    """Keep GRPO fine-tuning alive through GPU out-of-memory errors.

    \b
      oomguard run train.py ARGS...         run, recover from OOMs, log what changed
      oomguard analyze LOG|RECORD|SNAPSHOT  explain an OOM after the fact
      oomguard plan --model DIR --gpu 24GiB predict memory before anything runs
      oomguard ladders                      list the remedy ladders
    """


# ----------------------------------------------------------------------------------------------------------------
@main.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON ({\"findings\": [...]}).")
@click.option("--max-bytes", default="64GiB", show_default=True, metavar="SIZE",
              help="Read at most this much of each log.")
@click.option("--html", "html_path", default=None, metavar="PATH", help="Also write a self-contained HTML report.")
def analyze(paths: tuple[str, ...], as_json: bool, max_bytes: str, html_path: str | None) -> None:
    """Explain the OOMs in logs, crash records, run reports and memory snapshots (files or directories)."""
    from .analyze import analyze_paths
    from .render import console, findings, note, snapshots
    from .sizes import SizeError, parse_size

    try:
        limit = parse_size(max_bytes)
    except SizeError as e:
        _usage(str(e))
    result = analyze_paths(list(paths), max_bytes=limit, progress=note)
    for n in result.notes:
        note(n)
    if as_json:
        import json

        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        out = console()
        if result.findings:
            findings(out, result.findings)
        elif result.files_read:
            out.print(f"No out-of-memory error found in {result.files_read} file(s).")
        snapshots(out, result.snapshots)
    if html_path:
        from .html import write_analyze_html

        write_analyze_html(html_path, result)
    if result.files_read == 0:
        sys.exit(EXIT_USAGE)


# ----------------------------------------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--ladder", default="default", show_default=True, metavar="NAME|PATH",
              help="The remedy ladder: a shipped name (see `oomguard ladders`) or a TOML file.")
@click.option("--max-attempts", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Stop after this many launches.")
@click.option("--max-time", default=None, metavar="SECONDS", type=click.FloatRange(min=0, min_open=True),
              help="Start no new attempt after this many seconds.")
@click.option("--simulate-gpu", default=None, metavar="SIZE",
              help="Rehearse on CPU: give the training process a memory budget of SIZE (e.g. 300MiB) that raises "
                   "real OOMs. A test device, not a GPU.")
@click.option("--gpu-memory", default=None, metavar="SIZE",
              help="On a real GPU, cap the process at SIZE (e.g. 16GiB) to rehearse a smaller card.")
@click.option("--report", "report_path", default="oomguard-report.json", show_default=True, metavar="PATH",
              help="Where to write the RunReport JSON.")
@click.option("--lock", "lock_path", default="oomguard.lock.json", show_default=True, metavar="PATH",
              help="Where to write the stable config (replay it with --config).")
@click.option("--config", "config_path", default=None, metavar="LOCK",
              help="Replay a lock file's stable config without climbing.")
@click.option("--workdir", default=".oomguard", show_default=True, metavar="DIR",
              help="Where plans, events and crash records of each attempt are kept.")
@click.option("--probe-steps", default=2, show_default=True, type=click.IntRange(0), metavar="K",
              help="Before the real run, a K-step worst-case probe: the longest prompts, full-length completions, "
                   "no checkpoints. A config is stable once its probe passes.")
@click.option("--no-probe", is_flag=True, help="Skip the probe (same as --probe-steps 0).")
@click.option("--no-predict", is_flag=True,
              help="Climb one rung per OOM instead of letting the memory model skip rungs predicted not to be enough.")
@click.option("--minimize", is_flag=True,
              help="Once a config fits, try dropping the costliest rungs one at a time (with probes) and keep only "
                   "those that are needed.")
@click.option("--checkpoint-every", type=click.IntRange(1), default=None, metavar="N",
              help="Make the script save a checkpoint every N steps, so an OOM late in training loses at most N "
                   "steps (oomguard continues from the newest checkpoint).")
@click.option("--html", "html_path", default=None, metavar="PATH",
              help="Also write a self-contained HTML report (charts of peak against capacity, breakdown, timeline).")
@click.option("--quiet", "-q", is_flag=True, help="Only the OOMs, the rungs climbed and the result.")
@click.option("--json-log", is_flag=True, help="Progress as JSON lines on stderr, for CI and other programs.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="COMMAND...")
def run(command: tuple[str, ...], ladder: str, max_attempts: int, max_time: float | None, simulate_gpu: str | None,
        gpu_memory: str | None, report_path: str, lock_path: str, config_path: str | None, workdir: str,
        probe_steps: int, no_probe: bool, no_predict: bool, minimize: bool, checkpoint_every: int | None,
        html_path: str | None, quiet: bool, json_log: bool) -> None:
    """Run COMMAND; on a GPU out-of-memory error, climb the remedy ladder and relaunch until it fits.

    \b
      oomguard run train.py --epochs 1
      oomguard run -- python train.py
      oomguard run -m mypkg.train
      oomguard run -- trl grpo --config grpo.yaml
      oomguard run --simulate-gpu 300MiB examples/grpo_gsm8k.py

    Exit codes: the command's own code when it succeeds or fails for another reason; 75 when the ladder or the
    budget is used up; 130/143 when interrupted; 2 for usage errors.
    """
    from pathlib import Path

    from .ladder import LadderBug, LadderError, load_ladder
    from .sizes import SizeError, parse_size
    from .supervisor import EXIT_BUG, RunOptions, Supervisor, UsageError, load_lock, resolve_command
    from .ui import ConsoleReporter, JsonLogReporter

    args = list(command)
    if args and args[0] == "--":
        args = args[1:]
    try:
        lad = load_ladder(ladder)
        import os

        simulate_gpu = simulate_gpu or os.environ.get("OOMGUARD_SIMULATE_GPU") or None
        sim = parse_size(simulate_gpu) if simulate_gpu else None
        cap = parse_size(gpu_memory) if gpu_memory else None
        if (sim is not None and sim <= 0) or (cap is not None and cap <= 0):
            raise UsageError("a memory size must be more than 0 bytes")
        replay = load_lock(config_path) if config_path else None
        argv = resolve_command(args)
    except (UsageError, LadderError, SizeError) as e:
        _usage(str(e)) if not isinstance(e, UsageError) else _exit(str(e), e.code)
    options = RunOptions(ladder=lad, max_attempts=1 if replay else max_attempts, max_time=max_time,
                         simulate_gpu=sim, gpu_memory=cap, report_path=Path(report_path), lock_path=Path(lock_path),
                         workdir=Path(workdir), replay=replay, predict=not no_predict,
                         probe_steps=0 if (no_probe or replay) else probe_steps, minimize=minimize,
                         checkpoint_every=checkpoint_every, html_path=Path(html_path) if html_path else None)
    reporter = JsonLogReporter() if json_log else ConsoleReporter(quiet=quiet)
    try:
        code = Supervisor(argv, options, reporter).run()
    except UsageError as e:
        _exit(str(e), e.code)
    except LadderBug as e:
        _exit(f"internal error, please report it: {e}", EXIT_BUG)
    sys.exit(code)


# ----------------------------------------------------------------------------------------------------------------
@main.command()
@click.option("--model", "model_path", required=True, metavar="PATH",
              help="A model directory or its config.json (no weights are read).")
@click.option("--gpu", "gpu_size", required=True, metavar="SIZE", help="The device memory, e.g. 24GiB, 15.73GiB, 80GB.")
@click.option("--ladder", default="default", show_default=True, metavar="NAME|PATH",
              help="The ladder whose rungs are suggested, in its order.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=None, metavar="N",
              help="Padded prompt length (default 256).")
@click.option("--world-size", type=click.IntRange(1), default=1, show_default=True, help="Number of ranks.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.argument("knobs", nargs=-1, metavar="[KNOB=VALUE]...")
def plan(model_path: str, gpu_size: str, ladder: str, prompt_tokens: int | None, world_size: int,
         as_json: bool, knobs: tuple[str, ...]) -> None:
    """Predict the peak memory of a GRPO configuration (TRL 1.16) and the cheapest rungs that make it fit.

    \b
      oomguard plan --model ./Llama-3.2-1B-Instruct --gpu 16GiB dtype=bfloat16 max_completion_length=786
      oomguard plan --model config.json --gpu 24GiB lora_r=32 load_in_4bit=true --json

    Knobs are the Knobs fields (see `oomguard ladders` and the README); unset knobs take TRL 1.16's defaults.
    """
    from .estimate import EstimateError, load_model_spec
    from .knobs import TRL_DEFAULTS, RunFacts, parse_knob
    from .ladder import LadderError, load_ladder
    from .plan import make_plan
    from .sizes import SizeError, parse_size

    try:
        capacity = parse_size(gpu_size)
        if capacity <= 0:
            raise SizeError(f"--gpu must be more than 0 bytes, not {gpu_size!r}")
        values: dict[str, Any] = {}
        for item in knobs:
            name, sep, text = item.partition("=")
            if not sep:
                raise ValueError(f"expected KNOB=VALUE, not {item!r}")
            values[name.strip()] = parse_knob(name.strip(), text)
        k = TRL_DEFAULTS.merged(values)
        problems = k.validate(world_size)
        if problems:
            raise ValueError(f"these knobs break GRPO's rules: {'; '.join(problems)}")
        spec = load_model_spec(model_path)
        lad = load_ladder(ladder)
    except KeyError as e:
        _usage(str(e.args[0]))
    except (SizeError, ValueError, EstimateError, LadderError) as e:
        _usage(str(e))
    from .calibration import builtin_description, load_calibration, machine_key
    from .device import gpu_name
    from .estimate import Coefficients

    # what earlier runs on this machine learned (OOMGUARD_CACHE_DIR points the store elsewhere), else the built-in fit
    cal = load_calibration(machine_key(gpu_name(), simulated=False))
    calibration = ({"source": "machine", "key": cal.key, "runs": cal.runs, "description": cal.describe()} if cal
                   else {"source": "built-in", "description": builtin_description()})
    p = make_plan(spec, k, capacity, ladder=lad, facts=RunFacts(world_size=world_size), prompt_tokens=prompt_tokens,
                  coefficients=cal.apply(Coefficients()) if cal else None)
    if as_json:
        import json

        click.echo(json.dumps({**p.to_dict(), "calibration": calibration}, indent=2))
        return
    from .render import console, plan_table

    plan_table(console(), p, model_path)
    click.echo(f"calibration: {calibration['description']}")


# ----------------------------------------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the ladders as JSON.")
def ladders(as_json: bool) -> None:
    """List the remedy ladders shipped with oomguard and their rungs, in order."""
    from .ladder import available_ladders, describe, load_ladder

    data = describe([load_ladder(name) for name in available_ladders()])
    if as_json:
        import json

        click.echo(json.dumps(data, indent=2))
        return
    from .render import console

    out = console()
    for lad in data:
        out.print(f"[bold]{lad['name']}[/]  {lad['description']}")
        for i, r in enumerate(lad["rungs"], 1):
            graded = " (graded)" if r["graded"] else ""
            out.print(f"  {i:>2}. [cyan]{r['remedy']}[/]{graded}  trades {r['trades']}, "
                      f"checkpoint: {r['resume']}  [dim]{r['summary']}[/]", soft_wrap=True)
        if lad["host_rungs"]:
            out.print(f"      host RAM: {', '.join(lad['host_rungs'])}")
        out.print()


def _usage(message: str) -> Any:
    _exit(message, EXIT_USAGE)


def _exit(message: str, code: int) -> Any:
    click.echo(f"oomguard: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
