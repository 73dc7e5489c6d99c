"""The `oomguard` command. It never imports torch: every heavy import happens inside the command that needs it."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import __version__
from .vocab.knobtable import KNOB_MEANINGS as KNOB_TABLE_MEANINGS
from .vocab.knobtable import describe as describe_knobs

EXIT_USAGE = 2
# `oomguard plan`'s exit code follows the verdict `oomguard run` acts on; one list for `plan --help`, and the plan
# how-to's table states the same (a test checks both)
PLAN_EXIT = {"run": 0, "probe": 4, "stop": 3}
PLAN_EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "sure to fit: `oomguard run` starts the real run at once, no probe (with --fit: a value fits every card)"),
    ("4", "probe first: it may fit, but it is within the memory model's error of the edge, or the model cannot be "
          "sure of it (a TRL newer than tested, a family measured on CPU only): `oomguard run` probes it first"),
    ("3", "predicted not to fit: `oomguard run`'s pre-flight stops it and runs the choice printed (with --fit: no "
          "value fits some card)"),
    ("2", "usage errors (an unknown knob, a bad size or model config, a hub id whose config is neither cached nor "
          "reachable)"),
)

# The exit codes of `oomguard run`: one list for `run --help`, and the README states the same (a test checks both).
RUN_EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("N", "the command's own code when it succeeds, or when it fails for a reason other than an OOM (passed "
          "through at once, no retry)"),
    ("75", "the ladder or the budget (--max-attempts, --max-time) is used up"),
    ("76", "the run leaks memory and stopped at it (--no-leak-restart, too fast to get past a checkpoint, or the "
           "budget spent on restarts); a leaking run that finished every step through restarts exits 0, status leaked"),
    ("130/143", "interrupted (SIGINT/SIGTERM)"),
    ("2", "usage errors (an option, a size, a ladder or a lock file that cannot be used; a replayed lock whose "
          "value the training process does not run, stopped before it trains)"),
    ("126", "the command is not executable"),
    ("127", "the command is not found"),
    ("70", "an internal error of oomguard (a bug: its traceback is kept in the run's directory, the report and a "
           "stable attempt's lock are still written): please report it"),
)


def _exit_codes_epilog(codes: tuple[tuple[str, str], ...] = RUN_EXIT_CODES) -> str:
    return "\b\nExit codes:\n" + "\n".join(f"  {code:<8} {text}" for code, text in codes)


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return ["run", "analyze", "plan", "knobs", "ladders"]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="oomguard")
def main() -> None:
    """Keep GRPO fine-tuning alive through GPU out-of-memory errors.

    \b
      oomguard run train.py ARGS...         run, recover from OOMs, log what changed
      oomguard analyze LOG|RECORD|SNAPSHOT  explain an OOM after the fact
      oomguard plan --model DIR --gpu 24GiB predict memory before anything runs
      oomguard knobs                        list the knobs oomguard may change
      oomguard ladders                      list the remedy ladders
    """


# ----------------------------------------------------------------------------------------------------------------
@main.command()
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON ({\"findings\": [...]}).")
@click.option("--max-bytes", default="64GiB", show_default=True, metavar="SIZE",
              help="Read at most this much of each log.")
@click.option("--html", "html_path", default=None, metavar="PATH", help="Also write a self-contained HTML report.")
@click.option("--all", "show_all", is_flag=True,
              help="List every remedy for each OOM (without it, the top 3-5; --json always has them all, ranked).")
def analyze(paths: tuple[str, ...], as_json: bool, max_bytes: str, html_path: str | None, show_all: bool) -> None:
    """Explain the OOMs in logs, crash records, run reports and memory snapshots (files or directories)."""
    from .display.render import console, findings, note, snapshots, trends
    from .oom.analyze import analyze_paths, for_terminal
    from .vocab.sizes import SizeError, parse_size

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
        for i, f in enumerate(result.findings):
            shown, hidden = for_terminal(f, show_all=show_all)
            if i:
                out.print()
            findings(out, [shown])
            if hidden:
                out.print(f"   … and {hidden} more (--all lists them)", style="dim")
        if not result.findings and result.files_read:
            out.print(f"No out-of-memory error found in {result.files_read} file(s).")
        snapshots(out, result.snapshots)
        trends(out, result.trends)
    if html_path:
        from .display.html import write_analyze_html

        write_analyze_html(html_path, result)
    if result.files_read == 0:
        sys.exit(EXIT_USAGE)


# ----------------------------------------------------------------------------------------------------------------
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
              epilog=_exit_codes_epilog())
@click.option("--ladder", default=None, metavar="NAME|PATH",
              help="The remedy ladder: a shipped name (see `oomguard ladders`) or a TOML file [default: multi-gpu "
                   "for a distributed command (several ranks, DeepSpeed, FSDP), else default].")
@click.option("--max-attempts", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Stop after this many launches.")
@click.option("--max-time", default=None, metavar="SECONDS", type=click.FloatRange(min=0, min_open=True),
              help="Start no new attempt after this many seconds.")
@click.option("--simulate-gpu", default=None, metavar="SIZE",
              help="Rehearse on CPU: give the training process a memory budget of SIZE (e.g. 300MiB) that raises "
                   "real OOMs. A test device, not a GPU.")
@click.option("--simulate-context", default=None, metavar="SIZE",
              help="With --simulate-gpu: memory the simulated device holds outside the allocator, as a CUDA context "
                   "does. Default: 800MiB for a budget of 4GiB or more (a card), 0 below (a test rig).")
@click.option("--gpu-memory", default=None, metavar="SIZE",
              help="On a real GPU, rehearse a card of SIZE (e.g. 16GiB): the allocator gets SIZE minus the CUDA "
                   "context the training process really holds.")
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
                   "no checkpoints. A config the memory model is sure fits (predicted clearly under the device, "
                   "with its measured error) starts the real run directly; after any OOM every config is probed.")
@click.option("--no-probe", is_flag=True, help="Skip the probe (same as --probe-steps 0).")
@click.option("--always-probe", is_flag=True,
              help="Probe every config before its real run, even one the memory model is sure fits (two launches "
                   "where one would do).")
@click.option("--no-predict", is_flag=True,
              help="Climb one rung per OOM, keeping every rung climbed, instead of letting the memory model choose "
                   "(skip rungs predicted not to be enough, drop those not needed, relax graded knobs).")
@click.option("--preflight-margin", type=click.FloatRange(min=0), default=None, metavar="F",
              help="Stop a config before it loads or generates when the memory model predicts it more than F (a "
                   "fraction) over the device. Default: the model's measured error (8.4% on a GPU from the H100 "
                   "rows, or this machine's recorded runs; 11.7% on the simulated device), printed with each stop.")
@click.option("--no-preflight", is_flag=True, help="Never stop a config on prediction alone; run it and see.")
@click.option("--minimize", is_flag=True,
              help="After the memory model's choice, also prove it: drop each remaining rung in turn, costliest "
                   "first, and keep it only if a probe without it runs out of memory.")
@click.option("--no-refine", is_flag=True,
              help="Once the chosen config's probe fits, go straight to the run: do not choose again with what the "
                   "probe measured, nor probe the changes the memory model is unsure of (fewer launches; the "
                   "config may keep a change memory did not demand).")
@click.option("--checkpoint-every", type=click.IntRange(1), default=None, metavar="N",
              help="Add a checkpoint every N steps beside the script's own, so an OOM late in training loses at most "
                   "N steps (oomguard continues from the newest; it deletes those it added, all but the newest).")
@click.option("--no-leak-restart", is_flag=True,
              help="Stop at the first OOM the memory trace shows is a leak (memory kept step after step), instead "
                   "of resuming from the last checkpoint with the same config (exit 76; restarts count as attempts).")
@click.option("--no-trace", is_flag=True,
              help="Do not sample memory at each training step (no leak, long-sample or fragmentation diagnosis).")
@click.option("--html", "html_path", default=None, metavar="PATH",
              help="Also write a self-contained HTML report (charts of peak against capacity, breakdown, timeline).")
@click.option("--quiet", "-q", is_flag=True, help="Only the OOMs, the rungs climbed and the result.")
@click.option("--json-log", is_flag=True, help="Progress as JSON lines on stderr, for CI and other programs.")
@click.option("--group", "group_dir", default=None, metavar="DIR",
              help="A job on several nodes: the directory (on a filesystem every node shares) where the nodes' "
                   "oomguards meet [default: $OOMGUARD_GROUP, else WORKDIR/group].")
@click.option("--node-rank", type=click.IntRange(0), default=None, metavar="N",
              help="This node's rank in the job [default: the launcher's --node_rank/--machine_rank, or Slurm's].")
@click.option("--nodes", type=click.IntRange(1), default=None, metavar="N",
              help="How many nodes run the job [default: the launcher's --nnodes/--num_machines, or Slurm's].")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="COMMAND...")
def run(command: tuple[str, ...], ladder: str | None, max_attempts: int, max_time: float | None, simulate_gpu: str | None,
        simulate_context: str | None, gpu_memory: str | None, report_path: str, lock_path: str, config_path: str | None, workdir: str,
        probe_steps: int, no_probe: bool, always_probe: bool, no_predict: bool, preflight_margin: float | None, no_preflight: bool,
        minimize: bool, no_refine: bool, checkpoint_every: int | None, no_leak_restart: bool, no_trace: bool,
        html_path: str | None, quiet: bool, json_log: bool, group_dir: str | None, node_rank: int | None,
        nodes: int | None) -> None:
    """Run COMMAND; on a GPU out-of-memory error, climb the remedy ladder and relaunch until it fits.

    \b
      oomguard run train.py --epochs 1
      oomguard run -- python train.py
      oomguard run -m mypkg.train
      oomguard run -- trl grpo --config grpo.yaml
      oomguard run --simulate-gpu 300MiB examples/grpo_gsm8k.py
    """

    from .decide.conductor import Policy
    from .decide.ladder import LadderBug, LadderError, load_ladder
    from .display.ui import ConsoleReporter, JsonLogReporter
    from .run.command import (
        EXIT_BUG,
        InternalError,
        UsageError,
        load_lock,
        output_file,
        resolve_command,
        trl_support,
        work_dir,
    )
    from .run.group import GroupError, membership_of
    from .run.options import rank_grace
    from .run.supervisor import RunOptions, Supervisor
    from .vocab.sizes import SizeError, parse_size_arg

    args = list(command)
    if args and args[0] == "--":
        args = args[1:]
    # what a printed "run it" line repeats: the command in the user's words, with the options that set its device
    device_options = [w for opt, value in (("--simulate-gpu", simulate_gpu), ("--simulate-context", simulate_context),
                                           ("--gpu-memory", gpu_memory)) if value is not None for w in (opt, value)]
    try:
        import os

        from .decide.ladder import MULTI_GPU
        from .run.launch import distributed_reason

        sim_option = "--simulate-gpu"
        if not simulate_gpu and os.environ.get("OOMGUARD_SIMULATE_GPU"):
            simulate_gpu, sim_option = os.environ["OOMGUARD_SIMULATE_GPU"], "OOMGUARD_SIMULATE_GPU"
        sim = parse_size_arg(simulate_gpu, sim_option) if simulate_gpu else None
        cap = parse_size_arg(gpu_memory, "--gpu-memory") if gpu_memory else None
        sim_ctx = None
        if simulate_context is not None:
            if not sim:
                raise UsageError("--simulate-context needs --simulate-gpu SIZE: it is part of the simulated device",
                                 2)
            sim_ctx = 0 if simulate_context.strip() == "0" else parse_size_arg(simulate_context, "--simulate-context")
            if sim_ctx >= sim:
                raise UsageError(f"--simulate-context {simulate_context} leaves nothing of --simulate-gpu "
                                 f"{simulate_gpu} for tensors: make it smaller than the device", 2)
        replay = load_lock(config_path) if config_path else None
        # where the results go, checked before anything runs: a run must never end stable without its report and lock
        report_file = output_file(report_path, "oomguard-report.json", "--report")
        lock_file = output_file(lock_path, "oomguard.lock.json", "--lock")
        html_file = output_file(html_path, "oomguard-report.html", "--html") if html_path else None
        workdir_path = work_dir(workdir)
        argv = resolve_command(args)
        trl = trl_support(argv)
        if trl.refused:  # below the floor: one line before anything launches
            raise UsageError(str(trl.message), 2)
        # no --ladder: a command that is distributed gets the rungs only such runs have (decided again with the
        # training process's own report, in the supervisor)
        why = distributed_reason(argv, os.environ) if ladder is None else None
        lad = load_ladder(ladder or (MULTI_GPU if why else "default"))
        membership = membership_of(argv, os.environ, group=group_dir, node=node_rank, nodes=nodes, workdir=workdir)
        try:
            oom_grace = rank_grace(os.environ)
        except ValueError as e:
            raise UsageError(str(e), 2) from None
    except GroupError as e:
        _exit(str(e), 2)
    except (UsageError, LadderError, SizeError) as e:
        _usage(str(e)) if not isinstance(e, UsageError) else _exit(str(e), e.code)
    policy = Policy(max_attempts=1 if replay else max_attempts, max_time=max_time,
                    probe_steps=0 if (no_probe or replay) else probe_steps, always_probe=always_probe,
                    minimize=minimize, refine=not no_refine, preflight=not (no_preflight or no_predict),
                    preflight_margin=preflight_margin, ladder_auto=ladder is None and not replay,
                    leak_restart=not no_leak_restart)
    options = RunOptions(ladder=lad, policy=policy, simulate_gpu=sim, gpu_memory=cap, report_path=report_file,
                         lock_path=lock_file, workdir=workdir_path, replay=replay, predict=not no_predict,
                         simulate_context=sim_ctx, checkpoint_every=checkpoint_every, html_path=html_file,
                         membership=membership, trl=trl, ladder_reason=why, oom_grace=oom_grace, trace=not no_trace)
    reporter = JsonLogReporter() if json_log else ConsoleReporter(quiet=quiet, lock=config_path, command=args,
                                                                  options=device_options)
    try:
        code = Supervisor(argv, options, reporter).run()
    except (UsageError, InternalError) as e:
        _exit(str(e), e.code)
    except LadderBug as e:
        _exit(f"internal error, please report it: {e}", EXIT_BUG)
    sys.exit(code)


# ----------------------------------------------------------------------------------------------------------------
@main.command(epilog=_exit_codes_epilog(PLAN_EXIT_CODES))
@click.option("--model", "model_path", required=True, metavar="PATH|ORG/NAME",
              help="A model directory, its config.json, or a hub id (only its config.json is read, from the Hugging "
                   "Face cache; fetched once where the hub can be reached). No weights are read.")
@click.option("--gpu", "gpu_size", required=True, metavar="SIZE[,SIZE...]",
              help="The device memory, e.g. 24GiB, 15.73GiB, 80GB; several sizes print one row per card "
                   "(--gpu 8GiB,16GiB,24GiB,80GiB).")
@click.option("--fit", "fit_knob", default=None, metavar="KNOB",
              help="Also answer the largest value of KNOB that fits each card at the other settings: "
                   "max_completion_length, num_generations, per_device_train_batch_size, generation_batch_size, "
                   "lora_r or per_device_eval_batch_size; vllm_gpu_memory_utilization (the range of vLLM's shares "
                   "where vLLM and training both fit) or vllm_max_model_length (the longest context at the share).")
@click.option("--ladder", default=None, metavar="NAME|PATH",
              help="The ladder whose rungs are suggested, in its order [default: multi-gpu with --world-size above 1 "
                   "or a zero_stage, else default].")
@click.option("--prompt-tokens", type=click.IntRange(1), default=None, metavar="N",
              help="Padded prompt length (default 256).")
@click.option("--world-size", type=click.IntRange(1), default=1, show_default=True, help="Number of ranks.")
@click.option("--images-per-prompt", type=click.IntRange(0), default=None, metavar="N",
              help="A vision-language model's images in each prompt (default 1; 0: text only). Their tokens are "
                   "added to --prompt-tokens, which counts the text only.")
@click.option("--image-size", default=None, metavar="HxW",
              help="The largest image's size in pixels, e.g. 1080x1920 (default: as large as the processor's pixel "
                   "budget, max_pixels=N, or the model directory's preprocessor_config.json, allows).")
@click.option("--trl-version", default=None, metavar="X.Y[.Z]",
              help="The TRL release whose defaults fill the knobs left out and whose LM head is modelled, 0.14 on "
                   "[default: the installed TRL].")
@click.option("--stack", type=click.Choice(["trl", "unsloth"]), default="trl", show_default=True,
              help="The trainer around TRL: unsloth is judged as `oomguard run` judges Unsloth's generated trainer "
                   "(a probe first), and what it does that the model does not count is said.")
@click.option("--padding-free", is_flag=True,
              help="The batches are packed or padding-free (ms-swift's --padding_free): not modelled, so a probe first.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.argument("knobs", nargs=-1, metavar="[KNOB=VALUE]...")
def plan(model_path: str, gpu_size: str, fit_knob: str | None, ladder: str | None, prompt_tokens: int | None,
         world_size: int, images_per_prompt: int | None, image_size: str | None, trl_version: str | None,
         stack: str, padding_free: bool, as_json: bool, knobs: tuple[str, ...]) -> None:
    """Predict the peak memory of a GRPO configuration (the installed TRL's) and the cheapest rungs that make it fit.

    \b
      oomguard plan --model ./Llama-3.2-1B-Instruct --gpu 16GiB dtype=bfloat16 max_completion_length=786
      oomguard plan --model config.json --gpu 24GiB lora_r=32 load_in_4bit=true --json
      oomguard plan --model ./model --gpu 24GiB num_generations=4 && python train.py
      oomguard plan --model Qwen/Qwen2.5-1.5B-Instruct --gpu 16GiB,24GiB,80GiB --fit max_completion_length
      oomguard plan --model ./Qwen2.5-VL-3B-Instruct --gpu 24GiB --images-per-prompt 2 --image-size 1080x1920
      oomguard plan --model ./Qwen3-1.7B --gpu 80GiB --trl-version 0.17 per_device_train_batch_size=4

    KNOB=VALUE sets one knob (`oomguard knobs` lists them); unset knobs take the installed TRL's defaults, or
    --trl-version's. The verdict is the one `oomguard run` acts on (sure to fit, probe first, predicted not to fit),
    with the margin that decides it; with several cards, the least favourable card's sets the exit code.
    """
    from .decide.fit import FitError, check_knob
    from .decide.ladder import LadderError, load_ladder
    from .decide.plan import make_plan, plan_images
    from .decide.planconfig import planned
    from .memory.estimate import EstimateError, load_model_spec
    from .memory.hubconfig import HubConfigError, config_path
    from .run.command import trl_support
    from .vocab.knobs import parse_knob
    from .vocab.sizes import SizeError, parse_size_arg
    from .vocab.trlreleases import OLDEST, release

    try:
        sizes = [t.strip() for t in gpu_size.split(",") if t.strip()]
        if not sizes:
            raise SizeError("--gpu needs a size, e.g. 24GiB")
        capacities = [parse_size_arg(t, "--gpu") for t in sizes]
        capacity = capacities[0]
        values: dict[str, Any] = {}
        for item in knobs:
            name, sep, text = item.partition("=")
            if not sep:
                raise ValueError(f"expected KNOB=VALUE, not {item!r}")
            values[name.strip()] = parse_knob(name.strip(), text)
        if trl_version is not None and release(trl_version) is None:
            raise ValueError(f"--trl-version takes a TRL release from {OLDEST} on (e.g. 0.17.0), not {trl_version!r}")
        # the knobs a config leaves out are the defaults of the TRL that runs it: --trl-version's, else the installed
        trl = trl_version or trl_support([sys.executable]).version
        asked = planned(values, trl_version=trl, given=trl_version is not None, world_size=world_size, stack=stack,
                        padding_free=padding_free)
        if fit_knob is not None:
            check_knob(fit_knob, asked.knobs)
        spec = load_model_spec(config_path(model_path))
        image_facts, k = plan_images(spec, asked.knobs, config_path(model_path), images_per_prompt, image_size)
        lad = load_ladder(ladder or ("multi-gpu" if world_size > 1 or k.zero_stage else "default"))
    except KeyError as e:
        _usage(str(e.args[0]))
    except (SizeError, ValueError, EstimateError, LadderError, HubConfigError, FitError) as e:
        _usage(str(e))
    from .memory.device import gpu_name
    from .memory.estimate import Coefficients, not_modelled

    # the LM head of that TRL (0.14-1.14 materialise the logits, 1.15 on fuse the head), what the run does that the
    # model does not count, and the images
    facts = asked.facts.replace(**image_facts)
    if len(capacities) > 1 or fit_knob is not None:
        _plan_cards(spec, k, values, capacities, sizes, model_path, fit_knob, lad, facts, prompt_tokens, world_size,
                    as_json, asked.lines)
    # judged as `oomguard run` judges, with what earlier probes of this model on this machine learned
    # (OOMGUARD_CACHE_DIR points the store elsewhere), else the built-in fit
    p = make_plan(spec, k, capacity, ladder=lad, facts=facts, prompt_tokens=prompt_tokens,
                  device_name=gpu_name() or "unknown GPU")
    cal = p.judge.calibration if p.judge is not None else None
    calibration = ({"source": "machine", "key": cal.key, "runs": cal.runs, "description": cal.describe()} if cal
                   else {"source": "built-in", "description": p.judge.describe() if p.judge else ""})
    alts = [a.to_dict() for a in p.alternatives()]
    from .decide.experiment import precision_warning

    warning = precision_warning(k, facts)
    context = Coefficients().m_ctx
    device = {"context_bytes": context, "context": "the memory model's figure for a CUDA process; `oomguard run "
              "--gpu-memory` measures the training process's own"}
    if as_json:
        import json

        click.echo(json.dumps({**p.to_dict(), "images": image_facts or None, "calibration": calibration, "device": device, "alternatives": alts,
                               "trl": {"version": facts.trl_version, "head": facts.trl_head, "lines": list(asked.lines)},
                               "not_modelled": not_modelled(p.estimate.unmodelled),
                               "warnings": [warning] if warning else []}, indent=2))
    else:
        from .display.render import console, plan_table
        from .display.ui import alternatives_lines
        from .vocab.sizes import format_size

        for line in asked.lines:
            click.echo(line)
        plan_table(console(), p, model_path)
        for line in not_modelled(p.estimate.unmodelled):
            click.echo(f"not modelled: {line}")
        click.echo(f"calibration: {calibration['description']}")
        click.echo(f"context: {format_size(context)} outside the allocator, counted in the peak: {device['context']}")
        for line in alternatives_lines(alts):
            click.echo(line)
        if warning:
            click.echo(f"warning: {warning}")
    sys.exit(PLAN_EXIT[p.first])


def _plan_cards(spec: Any, k: Any, given: dict[str, Any], capacities: list[int], sizes: list[str], model: str, fit: str | None, lad: Any,
                facts: Any, prompt_tokens: int | None, world_size: int, as_json: bool, lines: Any = ()) -> None:
    """``oomguard plan`` with several cards or ``--fit``: one row per card, judged as ``run`` judges; the TRL
    ``lines`` (whose defaults fill the config) and what the model does not count, as the one-card answer says them."""
    from .decide.plan import card_rows
    from .memory.device import gpu_name

    rows, worst = card_rows(spec, k, list(zip(sizes, capacities, strict=True)), fit, ladder=lad, facts=facts,
                            prompt_tokens=prompt_tokens, world_size=world_size, device_name=gpu_name() or "unknown GPU")
    if as_json:
        import json

        click.echo(json.dumps({"model": model, "knobs": given, "cards": rows}, indent=2, default=list))
    else:
        from .display.render import cards_table, console

        cards_table(console(), rows, model, fit, lines)
    sys.exit(PLAN_EXIT[worst])


# ----------------------------------------------------------------------------------------------------------------
# One line per knob for `oomguard knobs`: the knob table's (oomguard/vocab/knobtable.py)
KNOB_MEANINGS: dict[str, str] = dict(KNOB_TABLE_MEANINGS)


@main.command("knobs")
@click.option("--json", "as_json", is_flag=True, help="Print the knobs as JSON.")
def knobs_command(as_json: bool) -> None:
    """List every knob oomguard may change: its type, TRL 1.16's default, where it reaches the training process
    (the environment, GRPOConfig, GRPOTrainer or from_pretrained) and what it means.

    Use them as KNOB=VALUE with `oomguard plan`; they are the keys of a lock file's overrides.
    """
    data = describe_knobs()
    if as_json:
        import json

        click.echo(json.dumps(data, indent=2))
        return
    from .display.listings import print_knobs

    print_knobs(data)


# ----------------------------------------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the ladders as JSON.")
def ladders(as_json: bool) -> None:
    """List the remedy ladders shipped with oomguard and their rungs, in order."""
    from .decide.ladder import available_ladders, describe, load_ladder

    data = describe([load_ladder(name) for name in available_ladders()])
    if as_json:
        import json

        click.echo(json.dumps(data, indent=2))
        return
    from .display.listings import print_ladders

    print_ladders(data)


def _usage(message: str) -> Any:
    _exit(message, EXIT_USAGE)


def _exit(message: str, code: int) -> Any:
    click.echo(f"oomguard: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
