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
@click.option("--quiet", "-q", is_flag=True, help="Only the OOMs, the rungs climbed and the result.")
@click.option("--json-log", is_flag=True, help="Progress as JSON lines on stderr, for CI and other programs.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="COMMAND...")
def run(command: tuple[str, ...], ladder: str, max_attempts: int, max_time: float | None, simulate_gpu: str | None,
        gpu_memory: str | None, report_path: str, lock_path: str, config_path: str | None, workdir: str,
        quiet: bool, json_log: bool) -> None:
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
                         workdir=Path(workdir), replay=replay)
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
