"""Cluster managers: Slurm's report of an OOM kill in a job step, and Ray's memory monitor killing workers.

Ray writes decimal GB and kills at a threshold of the node's memory, which becomes the report's allowance. Its
raylet's summary gives the number of workers killed and the node, which become ``workers_killed`` and ``node``.
"""

from __future__ import annotations

import re
from typing import Any

from .patterns import CASELESS, GAP, SIZE, Head, size_of, words

# Ray: "... pid=548, memory used=12.18GB) was running was 21.91GB / 33.28GB (0.658192), which exceeds the memory usage
# threshold of 0.65." (Ray writes decimal GB.)
_P_RAY_NODE = re.compile(r"was" + GAP + SIZE + GAP + r"/" + GAP + SIZE + GAP + r"\(" + GAP + r"[\d.]+" + GAP + r"\)", CASELESS)
_P_RAY_THRESHOLD = re.compile(words("memory usage threshold of") + GAP + r"(\d+(?:\.\d+)?)", CASELESS)
_P_RAY_TASK = re.compile(r"\bpid" + GAP + r"=" + GAP + r"(\d+)" + GAP + r"," + GAP + r"(?:actual" + GAP + r")?"
                         + words("memory used") + GAP + r"=" + GAP + SIZE, CASELESS)


def _ray_figures(core: str, text: str) -> dict[str, Any]:
    """The node's use and total, the kill threshold, and the task's process."""
    kw: dict[str, Any] = {}
    m = _P_RAY_NODE.search(core)
    if m:
        used, total = size_of(m.group(1), m.group(2)), size_of(m.group(3), m.group(4))
        kw["capacity"] = total
        if used is not None and total is not None:
            kw["free"] = max(0, total - used)
        t = _P_RAY_THRESHOLD.search(core)
        if t and total is not None and 0 < float(t.group(1)) <= 1:
            kw["allowed"] = round(float(t.group(1)) * total)
    m = _P_RAY_TASK.search(core)
    if m:
        kw["pid"] = int(m.group(1))
        kw["process"] = size_of(m.group(2), m.group(3))
    return kw


# Slurm's reports of a step's OOM kill.
SLURM: tuple[Head, ...] = (
    Head("slurm", re.compile(r"Detected" + GAP + r"\d+" + GAP + r"oom[-_]kill" + GAP + r"event", re.IGNORECASE),
          backend="host"),
    Head("slurm", re.compile(words("killed by the cgroup out-of-memory handler"), re.IGNORECASE), backend="host"),
)

# The raylet's summary of the workers its memory monitor killed, printed to the driver (node_manager.cc, the same
# words since Ray 2.1): "(raylet) ... 1 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers
# crashed due to other reasons at node (ID: ..., IP: 172.31.183.172) over the last time period." The count must be
# on the line and above 0: a summary of crashes alone ("0 Workers ... (OOM), 1 Workers crashed") is not an OOM, nor
# documentation that quotes the words without one.
_RAYLET_COUNT = re.compile(r"^\s*[1-9]\d*" + GAP + r"Workers", CASELESS)
_RAYLET_FIGURES = re.compile(r"^\s*(\d+)" + GAP + r"Workers" + r"(?:.*?\bIP" + GAP + ":" + GAP + r"([\d.:a-fA-F]+))?",
                             CASELESS | re.DOTALL)


def _raylet_figures(core: str, text: str) -> dict[str, Any]:
    """How many workers the memory monitor killed, and on which node (its IP), from the summary's head on.

    >>> _raylet_figures("1 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers crashed due to "
    ...                 "other reasons at node (ID: 73fc, IP: 10.0.6.140) over the last time period.", "")
    {'workers_killed': 1, 'node': '10.0.6.140'}
    """
    m = _RAYLET_FIGURES.search(core)
    return {"workers_killed": int(m.group(1)), "node": m.group(2)} if m else {}


# Ray's memory monitor.
RAY: tuple[Head, ...] = (
    Head(
        "ray",
        re.compile(r"(?:(?<![\w.])\d+" + GAP + r")?Workers" + GAP + r"\(" + GAP + r"tasks" + GAP + "/" + GAP + r"actors"
                   + GAP + r"\)" + GAP + words("killed due to memory pressure"), CASELESS),
        backend="host",
        complete=re.compile(words("over the last time period"), CASELESS),
        requires=_RAYLET_COUNT,
        figures=_raylet_figures,
    ),
    # Ray's memory monitor kills workers when the node's RAM passes its threshold: "Task was killed due to the node
    # running low on memory." (Ray <= 2.54), "N worker(s) were killed due to ..." (2.55+).
    Head(
        "ray",
        re.compile(r"(?:\b(?:Task|Actor)" + GAP + r"was|worker\(s\)" + GAP + r"were)" + GAP
                   + words("killed due to the node running low on memory")),
        backend="host",
        complete=re.compile(words("memory usage threshold of") + GAP + r"\d", re.IGNORECASE),
        figures=_ray_figures,
    ),
)
