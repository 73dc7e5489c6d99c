"""Host memory: the kernel's OOM killer, a shell's "Killed" line and Python's ``MemoryError`` (numpy's included).

Slurm's and Ray's reports of the same kills are in ``cluster``; the scanner counts a kill reported by both once.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import CASELESS, GAP, SIZE, Head, first_size, words

_P_RSS = re.compile(r"anon-rss:" + GAP + r"(\d[\d,]*)" + GAP + r"kB", CASELESS)
_P_NP_REQ = re.compile(words("Unable to allocate") + GAP + SIZE, CASELESS)


def _rss_figures(core: str, text: str) -> dict[str, Any]:
    """The killed process's resident memory (anon-rss)."""
    kw: dict[str, Any] = {}
    m = _P_RSS.search(text)
    kw["process"] = int(m.group(1).replace(",", "")) * 1024 if m else None
    return kw


def _python_figures(core: str, text: str) -> dict[str, Any]:
    """numpy's request ("Unable to allocate 8.00 GiB")."""
    kw: dict[str, Any] = {}
    kw["requested"] = first_size(_P_NP_REQ, text)
    return kw


# The kernel's OOM killer.
KILLER: tuple[Head, ...] = (
    Head(
        "oom-killer",
        re.compile(r"(?:Memory" + GAP + r"cgroup" + GAP + r")?" + words("out of memory:") + GAP + r"Kill(?:ed)?" + GAP
                   + r"process" + GAP + r"(?P<pid>\d+)", re.IGNORECASE),
        backend="host",
        figures=_rss_figures,
    ),
)

# A shell reporting its child killed.
SHELL: tuple[Head, ...] = (
    Head("shell", re.compile(r"\bline\s+\d+:\s+(?P<pid>\d+)\s+Killed\s+\S"), backend="host", figures=_rss_figures),
)

# Python's MemoryError, tried last: any other head on the same line is the better finding.
PYTHON: tuple[Head, ...] = (
    Head("python", re.compile(r"^(?:[\w.]+\.)?(?:_Array)?MemoryError(?::|\s*$)"), backend="host",
          figures=_python_figures),
)
