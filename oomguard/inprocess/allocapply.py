"""The allocator settings a guarded attempt runs under, brought to the live allocator.

:mod:`oomguard.vocab.allocconf` is the text: which variable torch reads and how an option is merged into it. This module
acts on it between guarded attempts. The options that rungs add (``expandable_segments``, ``max_split_size_mb``) go,
in this order of preference: to the simulated device; to torch's in-process setter once CUDA is in use (given the
user's settings plus the rung's, since the setter resets what it is not given); into the environment before CUDA's
first use; or into an isolated attempt's fresh process (:func:`isolated_env`). The user's own options are kept.

>>> from oomguard.decide.climb import Climb
>>> from oomguard.vocab.knobs import Knobs
>>> from oomguard.decide.ladder import load_ladder
>>> climb = Climb(load_ladder("default"))
>>> options(Knobs(expandable_segments=True), climb)
{'expandable_segments': 'True'}
"""

from __future__ import annotations

import os
from typing import Any

from ..decide.climb import Climb
from ..vocab import allocconf
from ..vocab.knobs import Knobs
from .release import cuda_in_use, loaded_torch


def options(knobs: Knobs, climb: Climb) -> dict[str, str]:
    """The allocator options the climbed rungs add to the user's own settings (none when the user set them already).

    >>> from oomguard.decide.climb import Climb
    >>> from oomguard.vocab.knobs import Knobs
    >>> from oomguard.decide.ladder import load_ladder
    >>> options(Knobs(max_split_size_mb=128), Climb(load_ladder("default"), env_knobs={"max_split_size_mb": 128}))
    {}
    """
    original = climb.original()
    return allocconf.added(knobs.expandable_segments, knobs.max_split_size_mb,
                           had_expandable=original.expandable_segments, had_max_split=original.max_split_size_mb)


def apply(knobs: Knobs, climb: Climb, isolate: bool) -> str | None:
    """Bring the rungs' allocator options to this attempt; returns the attempt's note saying where they went.

    Merged into the variable torch reads, never replacing the user's options; set in-process where torch allows
    it, on the simulated device, or for an isolated attempt's fresh process (:func:`isolated_env` puts them in its
    environment).

    >>> from oomguard.decide.climb import Climb
    >>> from oomguard.vocab.knobs import Knobs
    >>> from oomguard.decide.ladder import load_ladder
    >>> apply(Knobs(), Climb(load_ladder("default")), isolate=False) is None  # no rung touched the allocator
    True
    """
    opts = options(knobs, climb)
    if not opts:
        return None
    text = allocconf.format_options(opts)
    if isolate:
        return f"allocator settings {text} merged into {_written(opts)} of the attempt's fresh process"
    from ..child import simulate

    dev = simulate.device()
    if dev is not None:
        if "max_split_size_mb" in opts:
            dev.set_max_split(int(opts["max_split_size_mb"]) << 20)
        if "expandable_segments" in opts:
            dev.set_expandable(True)
        return f"allocator settings {text} applied in-process (simulated device)"
    torch = loaded_torch()
    if torch is not None and cuda_in_use():
        setter = _setter(torch)
        if setter is None:
            return f"allocator settings {text} need a fresh process on this torch: use isolate=True"
        # parseArgs resets the options it is not given (max_split_size_mb among them): pass the whole settings
        setter(allocconf.format_options({**allocconf.in_force(os.environ), **opts}))
        return f"allocator settings {text} applied in-process"
    written = allocconf.merge(os.environ, opts)
    return f"allocator settings {text} merged into {', '.join(written)} for CUDA's first use"


def isolated_env(knobs: Knobs, climb: Climb) -> dict[str, str]:
    """The allocator variables an isolated attempt's process gets: the user's settings with the rungs' options merged
    in (this process's environment is left as it is).

    >>> from oomguard.decide.climb import Climb
    >>> from oomguard.vocab.knobs import Knobs
    >>> from oomguard.decide.ladder import load_ladder
    >>> env = isolated_env(Knobs(expandable_segments=True), Climb(load_ladder("default")))
    >>> any("expandable_segments:True" in v for v in env.values())
    True
    """
    merged = dict(os.environ)
    return {var: merged[var] for var in allocconf.merge(merged, options(knobs, climb))}


def can_apply_here(remedy: str, isolate: bool) -> bool:
    """Whether ``remedy`` takes effect in this process (``expandable_segments`` needs torch's setter once CUDA runs).

    >>> can_apply_here("micro_batch", isolate=False)
    True
    """
    if remedy != "expandable_segments" or isolate:
        return True
    torch = loaded_torch()
    return torch is None or not cuda_in_use() or _setter(torch) is not None


def _written(opts: dict[str, str]) -> str:
    """The variables :func:`allocconf.merge` writes ``opts`` into, given this process's environment."""
    return ", ".join(allocconf.merge(dict(os.environ), opts))


def _setter(torch: Any) -> Any:
    """torch's in-process setter of the allocator settings (2.9+ names it in torch._C; older, in torch.cuda.memory)."""
    return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            or getattr(torch.cuda.memory, "_set_allocator_settings", None))
