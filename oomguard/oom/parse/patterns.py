"""The building blocks of every recogniser: words that match across any line wrap, sizes, and the Head record.

Each module of this package that knows a source of OOM text (``allocators``, ``runtimes``, ``vllm``, ``host``,
``cluster``) builds its patterns from these and lists its heads; ``heads`` puts them in the order they are tried.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...vocab.sizes import parse_size

# NVML reports 2^64-1 bytes when a value is not available; anything this large is not a measurement.
_NVML_GARBAGE = 2**60

# Patterns. `GAP` is "optional whitespace", used between every word so that hard-wrapped text still matches.
# Continuation lines are joined without a separator (a wrap can fall inside a number), so a word-wrap that dropped
# its blank glues words together ("GiBof which", "GPU 0has"): no pattern may rely on a word boundary after a unit or
# a number.

GAP = r"\s*"
NUM = r"(\d[\d,]*(?:\.\d+)?)"
UNIT = r"(bytes|byte|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)"
SIZE = NUM + GAP + UNIT

# The CUDA allocator refuses any request of 2^60 bytes or more up front: "Tried to allocate more than 1EB memory."
ONE_EB = 2**60
CASELESS = re.IGNORECASE


def words(text: str) -> str:
    """'out of memory' -> r'out\\s*of\\s*memory'."""
    return GAP.join(re.escape(w) for w in text.split())


def size_of(num: str, unit: str, *, binary_si: bool = False) -> int | None:
    try:
        value = parse_size(num.replace(",", "") + unit, si_is_binary=binary_si)
    except ValueError:
        return None
    return None if value >= _NVML_GARBAGE else value


def first_size(p: re.Pattern[str], text: str, *, binary_si: bool = False) -> int | None:
    m = p.search(text)
    return size_of(m.group(1), m.group(2), binary_si=binary_si) if m else None


def either(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class Head:
    """A recogniser: the regex that starts a message, its origin, and how to tell the message is complete."""

    origin: str
    pattern: re.Pattern[str]
    backend: str | None = None  # None: taken from the `dev` group
    complete: re.Pattern[str] | None = None  # None: one line is the whole message
    requires: re.Pattern[str] | None = None  # checked on the joined message, from the head on
    # A line a few lines further on (blank lines between) that belongs to the message: NCCL reports the size it failed
    # to allocate in its next WARN line.
    follow: re.Pattern[str] | None = None
    # A first report of a failure whose proper message follows: THC printed "THCudaCheck FAIL" before raising the
    # RuntimeError that carries the traceback. When the same origin and backend are recognised within
    # MAX_CONTINUATION lines, the later message is the finding.
    precursor: bool = False
    # Reads the figures into OOMReport fields: (the message from the head on, the whole joined text) -> values.
    figures: Callable[[str, str], dict[str, Any]] | None = None
