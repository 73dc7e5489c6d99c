"""Byte sizes as people and allocators write them.

PyTorch prints sizes with binary units and two decimals ("1.90 GiB", "0 bytes"); users type "24GiB", "80GB" or
plain bytes on the command line. Both directions live here so that every part of oomguard agrees on them.

>>> parse_size("1.90 GiB")
2040109466
>>> format_size(2040109465)
'1.90 GiB'
>>> parse_size("80GB")
80000000000
"""

from __future__ import annotations

import math
import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Binary (IEC) units, decimal (SI) units, and the one-letter forms that Slurm, Docker and `ls -h` treat as binary.
_UNITS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": TiB,
}

_SIZE_RE = re.compile(r"^\s*(?P<num>[+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A size that cannot be read; the message says what was expected."""


def parse_size(text: str | int, *, si_is_binary: bool = False) -> int:
    """Read a size such as ``24GiB``, ``15.73GiB``, ``80GB``, ``300M`` or ``1073741824`` into bytes.

    ``GiB``/``MiB``/``KiB`` and one-letter ``G``/``M``/``K`` are binary; ``GB``/``MB``/``KB`` are decimal, as in
    accelerate and most GPU spec sheets. Old MPS messages label binary values with ``GB``: pass
    ``si_is_binary=True`` to read them that way.

    >>> parse_size("300MiB"), parse_size("1.5G"), parse_size(512)
    (314572800, 1610612736, 512)
    >>> parse_size("2 GB", si_is_binary=True) == 2 * GiB
    True
    """
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"a size cannot be negative: {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise SizeError(f"not a size: {text!r} (expected e.g. 24GiB, 15.73GiB, 80GB, 300MiB or plain bytes)")
    unit = m.group("unit").lower()
    if unit not in _UNITS:
        raise SizeError(f"unknown unit {m.group('unit')!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")
    factor = _UNITS[unit]
    if si_is_binary and unit in ("kb", "mb", "gb", "tb"):
        factor = _UNITS[unit[0] + "ib"]
    value = float(m.group("num")) * factor
    if not math.isfinite(value) or value > 2**80:
        raise SizeError(f"size out of range: {text!r}")
    return round(value)


def parse_size_arg(text: str, option: str) -> int:
    """Read a SIZE given on the command line (``--gpu``, ``--simulate-gpu``, ...): a positive size of at least 1 MiB.

    A bare number is bytes, so ``--gpu 8`` would plan for an 8-byte GPU: a bare number below 1 MiB is refused with
    the size the user most likely meant (GiB for a small number, MiB for a larger one). A number with a unit is
    taken as written.

    >>> parse_size_arg("300MiB", "--simulate-gpu")
    314572800
    >>> parse_size_arg("8", "--gpu")
    Traceback (most recent call last):
    ...
    oomguard.vocab.sizes.SizeError: --gpu 8 means 8 bytes; did you mean 8GiB? (give a unit: GiB, MiB, GB, ...)
    """
    value = parse_size(text)
    if value <= 0:
        raise SizeError(f"{option} must be more than 0 bytes, not {str(text).strip()!r}")
    m = _SIZE_RE.match(str(text))
    if m is not None and not m.group("unit") and value < MiB:
        num = m.group("num")
        unit = "GiB" if float(num) <= 256 else "MiB"  # GPUs hold up to a few hundred GiB
        raise SizeError(f"{option} {num} means {value} bytes; did you mean {num}{unit}? "
                        "(give a unit: GiB, MiB, GB, ...)")
    return value


def format_size(n: int | float | None) -> str:
    """Write bytes the way PyTorch's caching allocator does (``format_size`` in CUDACachingAllocator.cpp).

    Up to 1 KiB: whole bytes; then KiB, MiB, GiB with two decimals.

    >>> [format_size(x) for x in (0, 1024, 1025, 20 * MiB, 3 * GiB // 2)]
    ['0 bytes', '1024 bytes', '1.00 KiB', '20.00 MiB', '1.50 GiB']
    """
    if n is None:
        return "unknown"
    n = int(n)
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a <= 1024:
        return f"{sign}{a} bytes"
    if a <= MiB:
        return f"{sign}{a / KiB:.2f} KiB"
    if a <= GiB:
        return f"{sign}{a / MiB:.2f} MiB"
    return f"{sign}{a / GiB:.2f} GiB"
