"""Switched on by OOMGUARD_PLAN in every Python process of a run: install the patches lazily.

Nothing heavy is imported here. The patches wait for ``torch``, ``trl`` and ``transformers`` to be imported by the
script itself, so a launcher or a helper process that never trains pays almost nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Any

from ..vocab.events import PatchFailed, ProcessStarted
from ..vocab.launchers import by_module, by_script
from ..vocab.protocol import END_ERROR, END_OOM, EXIT_OOM, PLAN_ENV, SIMULATE_ENV, Plan, oom_line, whereabouts
from .hooks import when_imported
from .runtime import Runtime, is_helper, runtime, set_runtime


def program_of(orig_argv: list[str]) -> tuple[str, str]:
    """What the interpreter of ``orig_argv`` (``sys.orig_argv``: the interpreter, its options, then the program)
    runs: ``("module", name)`` for ``-m``, ``("script", path)``, ``("code", "")`` for ``-c``, or ``("none", "")``.

    >>> program_of(["/venv/bin/python", "-u", "-X", "dev", "-m", "torch.distributed.run", "train.py"])
    ('module', 'torch.distributed.run')
    >>> program_of(["/venv/bin/python3", "/venv/bin/trl", "grpo"]), program_of(["python", "-c", "pass"])
    (('script', '/venv/bin/trl'), ('code', ''))
    """
    i = 1
    while i < len(orig_argv):
        a = orig_argv[i]
        if a == "-m":
            return ("module", orig_argv[i + 1]) if i + 1 < len(orig_argv) else ("none", "")
        if a == "-c" or (a.startswith("-c") and not a.startswith("--")):
            return "code", ""
        if a.startswith("-m") and len(a) > 2:
            return "module", a[2:]
        if a in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if a == "--" or not a.startswith("-") or a == "-":
            j = i + 1 if a == "--" else i
            return ("script", orig_argv[j]) if j < len(orig_argv) else ("none", "")
        i += 1
    return "none", ""


def is_launcher(orig_argv: list[str] | None = None) -> bool:
    """True in a process that only starts workers (torchrun, accelerate launch, deepspeed, TRL's and ms-swift's CLIs:
    ``vocab/launchers.py``): it must stay clean, and it records nothing, so how an attempt ended is read from the
    workers it starts. Only the program is looked at, never its arguments (``python train.py --output_dir trl``
    trains).

    >>> is_launcher(["/venv/bin/python", "/venv/bin/trl", "grpo", "--config", "grpo.yaml"])
    True
    >>> is_launcher(["python", "train.py", "--output_dir", "trl"]), is_launcher(["python", "-m", "accelerate.commands.launch"])
    (False, True)
    """
    if orig_argv is None:
        orig_argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    kind, what = program_of(orig_argv)
    if kind == "module":
        return by_module(what) is not None
    if kind == "script":
        return by_script(what) is not None
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
        from ..vocab.sizes import parse_size

        plan.simulate_gpu = parse_size(os.environ[SIMULATE_ENV])
    rt = Runtime(plan)
    set_runtime(rt)
    install_hooks(rt)
    install_excepthooks(rt)
    install_exit_records(rt)
    rt.emit(ProcessStarted(argv=tuple(sys.argv), executable=sys.executable, where=whereabouts(),
            helper=is_helper(list(getattr(sys, "orig_argv", None) or sys.argv))))
    return rt


def install_exit_records(rt: Runtime) -> None:
    """Every way this process can end leaves an ``end`` event: ``sys.exit`` (and ``exit()``) note their code, and an
    ``atexit`` handler (run at interpreter shutdown, after a clean end, ``sys.exit`` or an uncaught exception) writes
    it. The excepthooks and the pre-flight check write theirs first; a process killed by a signal writes none. A
    ``raise SystemExit(code)`` of the script's own is not seen here: the supervisor reads that code from the exit
    status where no launcher sits between (``oomguard.run.classify``)."""
    def noting(orig: Any) -> Any:
        def exit(code: Any = None) -> Any:
            if threading.current_thread() is threading.main_thread():  # another thread's sys.exit ends only it
                rt.exit_code = code
            return orig(code)

        exit.__doc__ = getattr(orig, "__doc__", None)
        return exit

    sys.exit = noting(sys.exit)
    import builtins

    for name in ("exit", "quit"):  # site's exit()/quit() raise SystemExit without sys.exit
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, noting(getattr(builtins, name)))
    atexit.register(rt.at_exit)


def install_hooks(rt: Runtime) -> None:
    """The patches load with the first module they patch: a process that never imports TRL or transformers (a
    launcher's helper, a data-preparation step) never pays for them."""
    def patching(name: str) -> Any:
        def patch(m: Any) -> None:
            from . import patches

            getattr(patches, name)(rt, m)

        return reported(rt, name, patch)

    when_imported("torch", reported(rt, "on_torch", lambda m: on_torch(rt, m)))
    if rt.plan.trace:  # the per-step peak's marks leave the peak counters the user reads whole (child/peaks.py)
        from . import peaks

        when_imported("torch.cuda.memory", reported(rt, "peaks", peaks.install))
    when_imported("trl", lambda m: _check_trl(rt, m))
    when_imported("trl.trainer.grpo_config", patching("patch_grpo_config"))
    when_imported("trl.trainer.grpo_trainer", patching("patch_grpo_trainer"))
    when_imported("transformers.modeling_utils", patching("patch_from_pretrained"))
    # the stacks around TRL, each an adapter module (child/stacks/) that names its own trigger modules
    import importlib

    from .stacks import ADAPTERS

    for name in ADAPTERS:
        adapter = importlib.import_module(f"{__package__}.stacks.{name}")
        triggers = {**adapter.TRIGGERS, **(adapter.SIMULATED_TRIGGERS if rt.plan.simulate_gpu else {})}
        for module, function in triggers.items():
            when_imported(module, stack(rt, name, function))
        if rt.plan.simulate_gpu:
            for k, v in adapter.SIMULATED_ENVIRONMENT.items():
                os.environ.setdefault(k, v)


def stack(rt: Runtime, name: str, function: str) -> Any:
    """``function`` of the stack adapter ``child/stacks/<name>.py``, loaded when the module it patches is imported."""
    def patch(m: Any) -> None:
        import importlib

        getattr(importlib.import_module(f"{__package__}.stacks.{name}"), function)(rt, m)

    return reported(rt, f"{name}.{function}", patch)


def reported(rt: Runtime, name: str, patch: Any) -> Any:
    """``patch`` that, when it fails, tells the supervisor which patch failed and why (event ``patch_failed``) and
    says so in one line, instead of breaking the user's import: the run goes on unpatched, and its report says what
    oomguard could not reach, rather than that the command builds no GRPOConfig."""
    def run(m: Any) -> None:
        try:
            patch(m)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:2000]
            rt.emit(PatchFailed(module=getattr(m, "__name__", "?"), patch=name, error=error))
            sys.stderr.write(f"oomguard: could not patch {getattr(m, '__name__', '?')} ({name}): {error}\n")

    return run


def _check_trl(rt: Runtime, trl: Any) -> None:
    from .trlcompat import refuse_if_too_old

    refuse_if_too_old(rt, trl)


def on_torch(rt: Runtime, torch: Any) -> None:
    plan = rt.plan
    if plan.simulate_gpu:
        from ..memory.allocmodel import context_for
        from . import simulate

        given = plan.simulate_context
        if given is None and os.environ.get(simulate.CONTEXT_ENV):
            from ..vocab.sizes import parse_size

            given = parse_size(os.environ[simulate.CONTEXT_ENV])  # "800MiB", or bytes
        simulate.start(int(plan.simulate_gpu), context=context_for(int(plan.simulate_gpu), given))
        orig_empty = torch.cuda.empty_cache

        def empty_cache() -> None:
            orig_empty()
            dev = simulate.device()
            if dev is not None:
                dev.release_cached()

        torch.cuda.empty_cache = empty_cache
        when_imported("transformers.trainer", lambda m: _sim_clear_cache(m, rt))
    if plan.gpu_memory:
        from . import capped

        capped.install(rt, torch, int(plan.gpu_memory))


def _add_traceback(path: Any, text: str) -> None:
    """Put the full traceback into the CrashRecord just written (its ``traceback`` field)."""
    from ..vocab.files import read_json, write_json_atomic

    try:
        data = read_json(path)
        data["traceback"] = text
        write_json_atomic(path, data)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"oomguard: could not add the traceback to {path}: {e}\n")


def _sim_clear_cache(module: Any, rt: Runtime) -> None:
    inner = getattr(module, "clear_device_cache", None)
    if inner is None:
        return

    def clear_device_cache(*a: Any, **kw: Any) -> Any:
        rt.empty_cache()
        return inner(*a, **kw)

    module.clear_device_cache = clear_device_cache


KEEP_FRAMES = 6  # frames of an OOM's traceback shown on the terminal; the CrashRecord keeps all of them


def format_trimmed(value: BaseException, record: Any, keep: int = KEEP_FRAMES) -> str:
    """The traceback of an OOM as the terminal shows it: the last ``keep`` frames of each exception in the chain and
    the messages, then oomguard's line (``oom_line``) saying how many frames were hidden and which crash record keeps
    them all. The line comes last: behind a launcher, what is printed after it is the launcher's (``run.proc.Aside``).

    A TRL OOM is about 40 frames deep and every attempt prints one, so the full form would bury the run's output.

    >>> def f(n):
    ...     if n == 0:
    ...         raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    ...     f(n - 1)
    >>> try:
    ...     f(20)
    ... except RuntimeError as e:
    ...     text = format_trimmed(e, "crash-1.json")
    >>> print(text.splitlines()[-1])
    oomguard: out of memory; the last 6 of 22 frames are above; crash-1.json keeps the full traceback
    >>> text.count('File "') <= 6, text.splitlines()[-2]
    (True, 'RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB.')
    """
    te = traceback.TracebackException.from_exception(value)
    total, seen, todo = 0, set(), [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        total = max(total, len(t.stack))
        if len(t.stack) > keep:
            t.stack = traceback.StackSummary.from_list(list(t.stack)[-keep:])
        todo += [x for x in (t.__cause__, t.__context__) if x is not None]
    return "".join(te.format(chain=True)) + oom_line(record, f"the last {min(keep, total)} of {total} frames are above")


def _console() -> Any:
    """Where a process that is about to ``os._exit`` says its last words: ``sys.stderr``, unless that is a buffer
    which a wrapper of the excepthook prints only once the hook returns (torch.distributed's, which prefixes each
    line with the rank): the hook never returns, so the real stderr."""
    err = sys.stderr
    try:
        err.fileno()
        return err
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return sys.__stderr__ or err


def install_excepthooks(rt: Runtime) -> None:
    """An uncaught OOM writes the CrashRecord (with the full traceback), prints the last frames of the traceback and
    the line naming the record, and exits with EXIT_OOM. A traceback handler of the script's own (rich, IPython) is
    left to print as it does, the line after it. All of it goes to the real stderr (``_console``)."""
    prev = sys.excepthook

    def is_oom(e: BaseException) -> bool:  # the parsers load only when an exception reaches here
        from ..oom.parse import is_oom

        return is_oom(e)

    def excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if not is_oom(value):
            rt.end(END_ERROR, error=f"{tp.__name__}: {value}"[:500])
            prev(tp, value, tb)
            return
        path = rt.record_crash(value)
        rt.end(END_OOM, path=str(path) if path else None)
        full = "".join(traceback.format_exception(tp, value, tb))
        if path is not None:
            _add_traceback(path, full)
        try:
            sys.stderr = _console()
            if path is not None and prev is sys.__excepthook__:
                sys.stderr.write(format_trimmed(value, path))
            else:
                prev(tp, value, tb)
                sys.stderr.write(oom_line(path))
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
