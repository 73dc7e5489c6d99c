"""The TrainerCallback that reports progress and peak memory to the supervisor, and oomguard's facts to the log."""

from __future__ import annotations

import os
from typing import Any

from ..vocab.events import CheckpointSaved, Evaluated, StepDone, TrainBegin
from .runtime import Runtime


def make_callback(rt: Runtime) -> Any:
    from transformers import TrainerCallback

    class OOMGuardCallback(TrainerCallback):
        """Reports each step and its peak memory; empties the cache at step ends when the empty_cache rung is on."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rt.emit(TrainBegin(step=state.global_step, max_steps=state.max_steps,
                    save_steps=getattr(args, "save_steps", None), save_strategy=str(getattr(args, "save_strategy", "")),
                    output_dir=args.output_dir))
            if rt.plan.trace and rt.memwatch is None:
                from .memwatch import MemWatch

                # each step's peak is oomguard's own (child/peaks.py): transformers' memory metrics and the user's
                # own reads of the peak counters see what they would without oomguard
                rt.memwatch = MemWatch(rt, host_limit=rt.plan.host_limit, census_after=rt.plan.census_after)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if rt.memwatch is not None:
                traced(rt, lambda w: w.step_begin())

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # Before the first step allocates the long-lived optimizer state: without this, that state is carved
            # out of cached generation- and activation-sized segments and pins them (fragmentation).
            if rt.overrides.torch_empty_cache_steps == 1:
                rt.empty_cache()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rt.emit(StepDone(step=state.global_step, peak=rt.peak_bytes(), reserved=rt.peak_reserved_bytes()))
            if (added := saving(rt)) is not None:
                added.step_end(args, state, control)
            if rt.memwatch is not None:
                for ev in traced(rt, lambda w: w.step_end(state.global_step, rt.trainer)) or []:
                    rt.emit(ev)
            while rt.after_first_step:
                rt.after_first_step.pop(0)()
            if rt.overrides.torch_empty_cache_steps == 1:
                rt.empty_cache()

        def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # an evaluation pass runs after the step's end: its peak is the process's peak so far
            rt.emit(Evaluated(step=state.global_step, peak=rt.peak_bytes(), reserved=rt.peak_reserved_bytes(),
                    host_peak=host_peak()))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if (added := saving(rt)) is not None:
                added.saved(args, state)
            rt.emit(CheckpointSaved(step=state.global_step,
                    path=os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), peak=rt.peak_bytes(),
                    host_peak=host_peak()))

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if (added := saving(rt)) is not None:
                added.ended(args, state)
            rt.emit(StepDone(final=True, step=state.global_step, peak=rt.peak_bytes(), reserved=rt.peak_reserved_bytes()))

    return OOMGuardCallback()


def saving(rt: Runtime) -> Any:
    """The checkpoints oomguard's saving adds (child/saves.py), in a real run only: a probe saves in a scratch
    directory the supervisor deletes."""
    return rt.added if rt.added is not None and not rt.probing() else None


def traced(rt: Runtime, call: Any) -> Any:
    """``call(rt.memwatch)``; the trace must never break a run: a failure turns it off for the process, said once."""
    try:
        return call(rt.memwatch)
    except Exception as e:
        import sys

        rt.memwatch = None
        sys.stderr.write(f"oomguard: the memory trace stopped ({type(e).__name__}: {e}); the run goes on without it\n")
        return None


def host_peak() -> int | None:
    """This process's peak resident host memory so far, in bytes (a save serialises the state dicts in host RAM)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kilobytes on Linux
    except (ImportError, OSError, ValueError):
        return None


def wrap_log(rt: Runtime, trainer: Any) -> None:
    """Add oomguard's facts to every ``trainer.log()`` call, so W&B and TensorBoard show them beside the loss."""
    inner = trainer.log

    def log(logs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(logs, dict) and "loss" in logs:
            logs["oomguard/attempt"] = rt.plan.attempt
            logs["oomguard/remedies"] = len(rt.plan.remedies)
            peak = rt.peak_bytes()
            if peak is not None:
                logs["oomguard/peak_gib"] = round(peak / 2**30, 4)
        return inner(logs, *args, **kwargs)

    trainer.log = log
