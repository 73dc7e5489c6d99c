"""``guard(isolate=True)``: each attempt of a guarded function in a freshly spawned process.

Some OOMs leave the process unfit for another try: a ``CUDA error: out of memory`` can poison the CUDA context, and
allocator settings that torch cannot change in-process need a new process. A spawned process starts with neither.
It gets the Guarded object and its arguments by pickle (the function by reference, so it must be defined at the top
of an importable module), the allocator settings in its environment, and sends back a
:class:`~oomguard.inprocess.attempt.CallResult`. The climb stays in the calling process.

>>> lookup("oomguard.vocab.sizes", "parse_size")("1KiB")
1024
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from ..decide.climb import Climb
from ..vocab.knobs import Knobs
from . import allocapply
from .attempt import CallResult, call_once, start_simulation


class Isolatable(Protocol):
    """What an isolated attempt needs of the guarded function: a :class:`~oomguard.inprocess.guarded.Guarded`
    satisfies it. The object is pickled by reference; the new process calls ``fn`` (with knobs if ``takes_knobs``),
    on a simulated device of ``simulate_gpu`` bytes if that is set. Declared here, so that this module needs nothing
    of the decorator that uses it."""

    fn: Callable[..., Any]
    takes_knobs: bool
    simulate_gpu: int | None


def lookup(module: str, qualname: str) -> Any:
    """The object a module attribute path names: how a Guarded object is unpickled (by reference) in the new process.

    >>> lookup("oomguard.vocab.knobs", "Knobs.from_dict").__name__
    'from_dict'
    """
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def check_picklable(g: Isolatable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, with one line saying what to do, a function or arguments that cannot reach a new process.

    >>> import oomguard
    >>> def make():
    ...     def train(knobs):
    ...         return 1
    ...     return train
    >>> check_picklable(oomguard.guard(make(), isolate=True), (), {})
    Traceback (most recent call last):
    TypeError: guard(isolate=True) runs train in a new process, so it must be defined at the top of an importable module (not inside a function, a lambda or a notebook cell)
    """
    if "<locals>" in g.fn.__qualname__ or (g.fn.__module__ == "__main__" and not _main_is_importable()):
        raise TypeError(f"guard(isolate=True) runs {g.fn.__name__} in a new process, so it must be defined at the top "
                        "of an importable module (not inside a function, a lambda or a notebook cell)")
    try:
        pickle.dumps((g, args, kwargs))
    except Exception as e:
        raise TypeError(f"guard(isolate=True) sends the function and its arguments to a new process, and they cannot "
                        f"be pickled: {e}") from None


def run_isolated(g: Isolatable, knobs: Knobs, climb: Climb, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> CallResult:
    """One attempt in a spawned process; raises RuntimeError (with the child's traceback) if it failed otherwise.

    The climb's allocator options are merged into the new process's environment (:func:`allocapply.isolated_env`);
    this process's own settings are untouched. tests/scripts/guarded_fns.py shows a function guarded this way.
    """
    import multiprocessing as mp

    env = allocapply.isolated_env(knobs, climb)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    payload = pickle.dumps((g, knobs, climb.overrides(knobs), args, kwargs, g.simulate_gpu))
    proc = ctx.Process(target=_child, args=(child, payload, env))
    proc.start()
    child.close()
    try:
        out = parent.recv()
    except EOFError:
        out = {"error": f"the isolated attempt died with exit code {proc.exitcode} before reporting"}
    proc.join()
    if isinstance(out, dict):
        raise RuntimeError(f"{g.fn.__name__} failed in its isolated process: {out['error']}"
                           + (f"\n{out['traceback']}" if out.get("traceback") else ""))
    return out


def _child(conn: Any, payload: bytes, env: dict[str, str]) -> None:  # pragma: no cover - runs in a child
    """The spawned process: call once, send the CallResult back (or a dict with the error)."""
    os.environ.update(env)
    g, knobs, overrides, args, kwargs, simulate = pickle.loads(payload)
    if simulate:
        start_simulation(simulate)
    try:
        out: CallResult | dict[str, str] = call_once(g.fn, g.takes_knobs, knobs, overrides, set(), args, kwargs)
        if isinstance(out, CallResult) and out.ok:
            try:
                pickle.dumps(out.value)
            except Exception as e:
                out = {"error": f"the function's return value cannot be sent back: {e}"}
        conn.send(out)
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def _main_is_importable() -> bool:
    main = sys.modules.get("__main__")
    return bool(getattr(main, "__file__", None))
