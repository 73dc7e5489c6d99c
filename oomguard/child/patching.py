"""The patching mechanism the training process's patches share: attributes set on TRL's and transformers' classes
and taken back (``remove``), values read off them, the run's rank count, the optional packages it has, and how an
error in oomguard's own overrides is reported. Everything a construction point's patch (``config``, ``trainer``,
``load``) or a stack adapter (``stacks/``) needs from another is public here or in those modules.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import socket
from collections.abc import Callable, Collection, Iterator
from importlib import metadata
from typing import Any

from ..vocab.events import OverrideFailed
from ..vocab.knobtable import OPTIONAL_PACKAGES
from .runtime import Runtime

UNDO: list[Callable[[], None]] = []

def set_attr(owner: Any, name: str, value: Any) -> None:
    if name in owner.__dict__:
        old = owner.__dict__[name]
        UNDO.append(lambda: setattr(owner, name, old))
    else:  # inherited: removing ours restores the base class's
        UNDO.append(lambda: delattr(owner, name))
    setattr(owner, name, value)

def remove() -> None:
    """Restore every patched attribute (last patched first)."""
    while UNDO:
        UNDO.pop()()

def plain(v: Any) -> Any:
    value = getattr(v, "value", v)  # enums such as OptimizerNames
    if value is not None and not isinstance(value, (bool, int, float, str, list, tuple)):
        return str(value)
    return value

def dtype_name(d: Any) -> str | None:
    if d is None:
        return None
    s = str(d)
    return s.split(".", 1)[1] if s.startswith("torch.") else s

def world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def missing_packages() -> list[str]:
    """The optional packages this training environment lacks (of those the knob table names, ``OPTIONAL_PACKAGES``):
    installed (a distribution, as transformers checks for DeepSpeed) and findable, without importing them."""
    out = []
    for name in OPTIONAL_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None and bool(metadata.version(name))
        except (ImportError, ValueError, metadata.PackageNotFoundError):
            found = False
        if not found:
            out.append(name)
    return out

# Errors no knob can cause: a rendezvous's port taken by another job (torch.distributed's DistNetworkError, or the
# socket's own error), a peer that cannot be reached. They pass through as the script's failure, never "taken back".
_DIST_NETWORK_ERRORS = frozenset({"DistNetworkError", "DistStoreError"})  # torch's, matched by name
_NETWORK_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EHOSTUNREACH, errno.ENETUNREACH})


def _is_network(e: BaseException) -> bool:
    return (isinstance(e, (ConnectionError, TimeoutError, socket.gaierror))
            or (isinstance(e, OSError) and e.errno in _NETWORK_ERRNOS)
            or any(c.__name__ in _DIST_NETWORK_ERRORS for c in type(e).__mro__))


def network_error(e: BaseException) -> bool:
    """Whether ``e``, or an error in its chain, is the network's, not the config's (a port in use, a peer
    unreachable).

    >>> network_error(OSError(errno.EADDRINUSE, "Address already in use"))
    True
    >>> network_error(ValueError("num_generations must divide the batch"))
    False
    """
    from ..oom.parse import first_in_chain

    return first_in_chain(e, _is_network) is not None


@contextlib.contextmanager
def overrides_reported(rt: Runtime, where: str, knobs: Collection[str] | None = None) -> Iterator[None]:
    """An error raised while oomguard's overrides are applied is reported (event ``override_error``) before it
    propagates: the supervisor then takes back the rung that set them instead of passing the failure through. An
    OOM is the climb's, and a network error (:func:`network_error`) is the machine's: neither is reported.
    ``knobs``: the overrides this point applies (a front-end's loader takes its dtype and 4-bit load): reported only
    where one of them is in force, and named as the ones that broke it (None: every override in force)."""
    try:
        yield
    except Exception as e:
        ours = sorted(k for k in rt.overrides.to_dict(only_set=True) if knobs is None or k in knobs)
        if ours and not rt.crashed and not network_error(e) and not getattr(e, "_oomguard_reported", False):
            from ..oom.parse import is_oom

            if not is_oom(e):
                rt.emit(OverrideFailed(where=where, error=f"{type(e).__name__}: {e}"[:2000], overrides=tuple(ours)))
                with contextlib.suppress(AttributeError, TypeError):
                    e._oomguard_reported = True  # type: ignore[attr-defined]  # once, by the innermost point
        raise

def evaluates(cfg: Any) -> bool:
    """Whether a TrainingArguments (before or after its ``__post_init__``) asks for evaluation during training."""
    return str(plain(getattr(cfg, "eval_strategy", None)) or "no").lower() not in ("no", "none")

def saves(cfg: Any) -> bool:
    """Whether a TrainingArguments asks for checkpoints during training."""
    return str(plain(getattr(cfg, "save_strategy", None)) or "no").lower() not in ("no", "none")
