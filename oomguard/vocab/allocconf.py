"""PyTorch's allocator settings: which variable torch reads, what it says, and how to add an option to it.

Three environment variables configure the caching allocator: ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``
and ``PYTORCH_ALLOC_CONF``. Torch reads **one** of them, the first one set in that order, and ignores the others
(they are not merged). That is torch 2.12 and later: ``AcceleratorAllocatorConfig::instance()`` in
``c10/core/AllocatorConfig.cpp`` and ``CUDAAllocatorConfig::instance()`` in ``c10/cuda/CUDAAllocatorConfig.h``;
checked on torch 2.13, where ``PYTORCH_ALLOC_CONF=max_split_size_mb:64 PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128``
gives ``torch._C._accelerator_getAllocatorSettings() == 'max_split_size_mb:128'``. Torch 2.8 to 2.11 read
``PYTORCH_ALLOC_CONF`` first for the shared options but their CUDA allocator still read ``PYTORCH_CUDA_ALLOC_CONF``
first (pytorch #183387), and torch before 2.8 knows only the CUDA and HIP names.

So oomguard writes an option into **every** one of these variables that is set, keeping the options already there
(whichever one this torch reads then carries it), and into ``PYTORCH_CUDA_ALLOC_CONF`` when none is set (every
torch version reads that one). What the user set is read from the variable torch 2.12+ reads.

This module is pure and torch-free: the supervisor, the simulated device and ``guard`` all use it.

>>> env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256"}
>>> merge(env, {"expandable_segments": "True"})
['PYTORCH_ALLOC_CONF']
>>> env
{'PYTORCH_ALLOC_CONF': 'max_split_size_mb:256,expandable_segments:True'}
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# The order torch (2.12 and later) reads them in: the first one set is the only one read.
VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Written when the user set none: every torch version's CUDA allocator reads it.
DEFAULT_VAR = "PYTORCH_CUDA_ALLOC_CONF"


def parse(text: str) -> dict[str, str]:
    """The options in one variable's value, in order; list values (``[...]``) stay whole, spaces are dropped.

    >>> parse("expandable_segments:True, max_split_size_mb:128")
    {'expandable_segments': 'True', 'max_split_size_mb': '128'}
    >>> parse("roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6")
    {'roundup_power2_divisions': '[256:1,512:2,>:4]', 'garbage_collection_threshold': '0.6'}
    >>> parse("")
    {}
    """
    out: dict[str, str] = {}
    depth, item = 0, ""
    for ch in "".join(text.split()) + ",":  # torch ignores whitespace anywhere
        if ch == "," and depth == 0:
            key, _, value = item.partition(":")
            if key:
                out[key] = value
            item = ""
            continue
        depth += ch == "["
        depth -= ch == "]" and depth > 0
        item += ch
    return out


def format_options(options: Mapping[str, str]) -> str:
    """The inverse of :func:`parse`.

    >>> format_options({"expandable_segments": "True", "max_split_size_mb": "128"})
    'expandable_segments:True,max_split_size_mb:128'
    """
    return ",".join(f"{k}:{v}" for k, v in options.items())


def variable_read(env: Mapping[str, str]) -> str | None:
    """The variable torch reads: the first one set, or None.

    >>> variable_read({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"})
    'PYTORCH_CUDA_ALLOC_CONF'
    >>> variable_read({}) is None
    True
    """
    return next((v for v in VARS if v in env), None)


def in_force(env: Mapping[str, str]) -> dict[str, str]:
    """The options torch would use: those of the variable it reads (the others are ignored, not merged).

    >>> in_force({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    {'max_split_size_mb': '64'}
    """
    var = variable_read(env)
    return parse(env[var]) if var else {}


def merge(env: MutableMapping[str, str], options: Mapping[str, str]) -> list[str]:
    """Set ``options`` in every allocator variable ``env`` sets (or in PYTORCH_CUDA_ALLOC_CONF when it sets none),
    keeping the options already there. Returns the variables written, the one torch reads first.

    >>> env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"}
    >>> merge(env, {"expandable_segments": "True"}), env["PYTORCH_CUDA_ALLOC_CONF"]
    (['PYTORCH_CUDA_ALLOC_CONF'], 'max_split_size_mb:128,expandable_segments:True')
    >>> env = {}
    >>> merge(env, {"expandable_segments": "True"}), env
    (['PYTORCH_CUDA_ALLOC_CONF'], {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'})
    >>> merge(env, {})
    []
    """
    if not options:
        return []
    written = [v for v in VARS if v in env] or [DEFAULT_VAR]
    for var in written:
        env[var] = format_options({**parse(env.get(var, "")), **options})
    return written


@dataclass(frozen=True)
class UserSettings:
    """What the user set for the options oomguard changes, read from the variable torch reads."""

    variable: str | None = None  # the variable torch reads, if any is set
    text: str | None = None  # its value
    expandable_segments: bool | None = None  # None: not set
    max_split_size_mb: int | None = None

    def locked_text(self) -> str | None:
        """``VAR=value`` when the user turned expandable segments off themselves (oomguard keeps that choice)."""
        return f"{self.variable}={self.text}" if self.expandable_segments is False else None


def added(expandable_segments: bool | None, max_split_size_mb: int | None, *, had_expandable: bool | None,
          had_max_split: int | None) -> dict[str, str]:
    """The options a config adds to those its baseline already has (the user's own settings): nothing it shares.

    >>> added(True, 128, had_expandable=False, had_max_split=128)
    {'expandable_segments': 'True'}
    """
    opts: dict[str, str] = {}
    if expandable_segments and not had_expandable:
        opts["expandable_segments"] = "True"
    if max_split_size_mb is not None and max_split_size_mb != had_max_split:
        opts["max_split_size_mb"] = str(max_split_size_mb)
    return opts


def user_settings(env: Mapping[str, str]) -> UserSettings:
    """Read the user's own allocator settings from ``env``.

    >>> user_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}).locked_text()
    'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False'
    >>> user_settings({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}).max_split_size_mb
    128
    >>> user_settings({})
    UserSettings(variable=None, text=None, expandable_segments=None, max_split_size_mb=None)
    """
    var = variable_read(env)
    if var is None:
        return UserSettings()
    opts = parse(env[var])
    es = opts.get("expandable_segments")
    return UserSettings(variable=var, text=env[var], expandable_segments=None if es is None else es == "True",
                        max_split_size_mb=_int(opts.get("max_split_size_mb")))


def expandable(env: Mapping[str, str]) -> bool:
    """Whether the settings in force turn expandable segments on (torch accepts exactly ``True``).

    >>> expandable({"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"})
    True
    """
    return in_force(env).get("expandable_segments") == "True"


def max_split_bytes(env: Mapping[str, str]) -> int | None:
    """``max_split_size_mb`` of the settings in force, in bytes.

    >>> max_split_bytes({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    67108864
    """
    mb = _int(in_force(env).get("max_split_size_mb"))
    return mb << 20 if mb is not None else None


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v else None
    except ValueError:
        return None


__all__ = ["DEFAULT_VAR", "VARS", "UserSettings", "expandable", "format_options", "in_force", "max_split_bytes",
           "merge", "parse", "user_settings", "variable_read"]
