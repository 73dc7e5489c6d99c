"""Switched on by OOMGUARD_PLAN in every Python process of a run: install the patches lazily.

Nothing heavy is imported here. The patches wait for ``torch``, ``trl`` and ``transformers`` to be imported by the
script itself, so a launcher or a helper process that never trains pays almost nothing.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from .hooks import when_imported
from .runtime import EXIT_OOM, PLAN_ENV, SIMULATE_ENV, Plan, Runtime, runtime, set_runtime

LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "torch.distributed.run", "torch.distributed.launch",
             "accelerate.commands.launch", "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner",
             "deepspeed.launcher.launch")


def is_launcher(argv: list[str] | None = None) -> bool:
    """True in a process that only starts workers (torchrun, accelerate launch, deepspeed): it must stay clean."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv) if argv is None else argv
    for i, a in enumerate(argv[:4]):
        base = os.path.basename(a)
        if base in ("torchrun", "accelerate", "deepspeed"):
            return True
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] in LAUNCHERS:
            return True
        if a.replace("\\", "/").endswith(("torch/distributed/run.py", "torch/distributed/launch.py")):
            return True
    return False


def install() -> Runtime | None:
    path = os.environ.get(PLAN_ENV)
    if not path or runtime() is not None:
        return runtime()
    if is_launcher():
        return None
    try:
        plan = Plan.load(path)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"oomguard: cannot read the plan {path} ({e}); running without oomguard's patches\n")
        return None
    if plan.simulate_gpu is None and os.environ.get(SIMULATE_ENV):
        from ..sizes import parse_size

        plan.simulate_gpu = parse_size(os.environ[SIMULATE_ENV])
    rt = Runtime(plan)
    set_runtime(rt)
    install_hooks(rt)
    install_excepthooks(rt)
    rt.emit("start", argv=list(sys.argv), executable=sys.executable)
    return rt


def install_hooks(rt: Runtime) -> None:
    from . import patches

    when_imported("torch", lambda m: on_torch(rt, m))
    when_imported("trl.trainer.grpo_config", lambda m: patches.patch_grpo_config(rt, m))
    when_imported("trl.trainer.grpo_trainer", lambda m: patches.patch_grpo_trainer(rt, m))
    when_imported("transformers.modeling_utils", lambda m: patches.patch_from_pretrained(rt, m))


def on_torch(rt: Runtime, torch: Any) -> None:
    plan = rt.plan
    if plan.simulate_gpu:
        from . import simulate

        simulate.start(int(plan.simulate_gpu))
        orig_empty = torch.cuda.empty_cache

        def empty_cache() -> None:
            orig_empty()
            dev = simulate.device()
            if dev is not None:
                dev.release_cached()

        torch.cuda.empty_cache = empty_cache
        when_imported("transformers.trainer", lambda m: _sim_clear_cache(m, rt))
    if plan.gpu_memory:
        size = int(plan.gpu_memory)

        def cap() -> None:
            for i in range(torch.cuda.device_count()):
                total = torch.cuda.get_device_properties(i).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, size / total), i)

        torch.cuda._lazy_call(cap)


def _sim_clear_cache(module: Any, rt: Runtime) -> None:
    inner = getattr(module, "clear_device_cache", None)
    if inner is None:
        return

    def clear_device_cache(*a: Any, **kw: Any) -> Any:
        rt.empty_cache()
        return inner(*a, **kw)

    module.clear_device_cache = clear_device_cache


def install_excepthooks(rt: Runtime) -> None:
    """An uncaught OOM writes the CrashRecord, prints the traceback as usual, and exits with EXIT_OOM."""
    from ..oom import is_oom

    prev = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if not is_oom(value):
            prev(tp, value, tb)
            return
        rt.record_crash(value)
        prev(tp, value, tb)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(EXIT_OOM)

    sys.excepthook = excepthook
    prev_thread = threading.excepthook

    def thread_excepthook(args: Any) -> None:
        if args.exc_value is not None and is_oom(args.exc_value):
            rt.record_crash(args.exc_value)
        prev_thread(args)

    threading.excepthook = thread_excepthook
