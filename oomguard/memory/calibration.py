"""What the memory model learns across runs on one machine: a small per-machine calibration in the user's cache.

The built-in :class:`~oomguard.memory.estimate.Coefficients` are fitted to one H100 with torch 2.11 and TRL 1.16.
Another GPU, driver, torch or TRL version shifts the allocated peak by a few percent and the allocator's margin more. So
every probe that passes records what the built-in model predicted next to what the process measured, keyed by GPU
name + torch version + TRL version and by the model's shape (``model_key``), and later runs and ``oomguard plan`` of
the same model on the same machine start from the robust aggregate of the last :data:`KEEP` of them: the median of
measured/predicted (applied as ``scale``) and the median reserved/allocated margin (``f_frag``, or
``f_frag_expandable`` for runs with expandable segments).

Like is compared with like: a probe runs the worst case the prediction is for (full-length completions, the
longest prompts), where a real run's completions may stop early and its peak be lower than the worst case, which
would teach every later prediction to be too low. Another model's runs never scale this one's predictions, and the
spread of recorded runs replaces the pre-flight's built-in margin only above a floor (:data:`ERROR_FLOOR`).

One JSON file, ``calibration.json`` in ``$OOMGUARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomguard``, else
``~/.cache/oomguard``. Writes are atomic (a temporary file, then ``os.replace``) under an advisory lock, so two
runs finishing together both keep their entry. A file that cannot be read or parsed gives one warning line and is
renamed aside (``calibration.json.corrupt-<time>``), never deleted. Pure Python: versions come from
``importlib.metadata``, so neither torch nor TRL is imported.

>>> import tempfile, os
>>> os.environ["OOMGUARD_CACHE_DIR"] = tempfile.mkdtemp()
>>> key = machine_key("NVIDIA H100 80GB HBM3", simulated=False)
>>> load_calibration(key) is None
True
>>> cal = record_run(key, predicted_alloc=10 * 2**30, measured_alloc=9 * 2**30, measured_reserved=int(9.9 * 2**30))
>>> cal.runs, round(cal.alloc_ratio, 2), round(cal.frag, 2), round(cal.apply(Coefficients()).scale, 2)
(1, 0.9, 0.1, 0.9)
>>> load_calibration(key) == cal
True
>>> del os.environ["OOMGUARD_CACHE_DIR"]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..vocab.files import write_atomic
from .estimate import Coefficients

__all__ = ["ERROR_FLOOR", "KEEP", "Calibration", "builtin_description", "cache_dir", "calibration_path",
           "load_calibration", "machine_key", "model_key", "record_run"]

SCHEMA = "oomguard.calibration/1"
FILE_NAME = "calibration.json"
KEEP = 20  # runs kept per machine key: the median of the last KEEP is what applies
RATIO_BOUNDS = (0.5, 2.0)  # a measured/predicted outside these is a broken record, not a calibration
FRAG_BOUNDS = (0.0, 1.0)
SPREAD_RUNS = 3  # runs with a reserved peak before their own spread sets the pre-flight's margin
# The least over-prediction the recorded spread may claim for the pre-flight's margin: a few runs that happened to
# agree must not take the margin to nothing (the built-in fit's own error is 3.4% on the H100 rows).
ERROR_FLOOR = 0.02

Warn = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"oomguard: {line}", file=sys.stderr)


def builtin_description(*, simulated: bool = False) -> str:
    """What the built-in coefficients are, for ``oomguard plan`` and reports.

    >>> builtin_description()
    'built-in: fitted to H100 measurements, 2026-11-22'
    """
    if simulated:
        return "built-in: fitted on the simulated device (bench/cpu_calibrate.py)"
    return "built-in: fitted to H100 measurements, 2026-11-22"


def cache_dir() -> Path:
    """``$OOMGUARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomguard``, else ``~/.cache/oomguard`` (not created here)."""
    own = os.environ.get("OOMGUARD_CACHE_DIR")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "oomguard"


def calibration_path() -> Path:
    """The one calibration file of this user."""
    return cache_dir() / FILE_NAME


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def model_key(spec: Any) -> str:
    """The model's shape, which a calibration is also valid for: layers, widths, heads, vocabulary, tying.

    >>> from oomguard.memory.estimate import ModelSpec
    >>> model_key(ModelSpec(128256, 2048, 16, 32, 8, 64, 8192, True))
    'L16 h2048 i8192 a32/8x64 v128256 tied'

    Experts and a vision tower are part of the shape (a dense model's key is as before):
    ``... moe128x8i768/48`` (experts, per token, their width, MoE layers), ``... vision1280x32``.
    """
    key = (f"L{spec.num_layers} h{spec.hidden_size} i{spec.intermediate_size} a{spec.num_heads}/{spec.num_kv_heads}"
           f"x{spec.head_dim} v{spec.vocab_size}{' tied' if spec.tie_word_embeddings else ''}")
    moe = getattr(spec, "moe", None)
    if moe is not None:
        key += f" moe{moe.num_experts}x{moe.top_k}i{moe.expert_intermediate}/{moe.moe_layers}"
    vision = getattr(spec, "vision", None)
    if vision is not None:
        key += f" vision{vision.hidden}x{vision.depth}"
    return key


def machine_key(device_name: str | None, *, simulated: bool) -> str:
    """``"<GPU name>|torch <version>|trl <version>"``: what a calibration is valid for.

    ``device_name`` comes from :func:`oomguard.memory.device.gpu_name` (None: NVML cannot name the GPU); the simulated
    device has its own key, since its allocator is a model of CUDA's, not a GPU.

    >>> machine_key("NVIDIA H100 80GB HBM3", simulated=False).split("|")[0]
    'NVIDIA H100 80GB HBM3'
    >>> machine_key(None, simulated=True).split("|")[0], machine_key(None, simulated=False).split("|")[0]
    ('simulated', 'unknown GPU')
    """
    device = "simulated" if simulated else (" ".join(device_name.split()) if device_name else "unknown GPU")
    return f"{device}|torch {_version('torch')}|trl {_version('trl')}"


@dataclass(frozen=True)
class Calibration:
    """The last runs recorded under one machine key, and what they say about the built-in coefficients.

    Each entry of ``entries`` is ``{"predicted": int, "measured": int, "reserved": int | None, "expandable": bool,
    "time": float}``: the allocated peak the built-in model predicted (scale 1), the one measured, the reserved peak.
    """

    key: str
    entries: tuple[dict[str, Any], ...]

    @property
    def runs(self) -> int:
        return len(self.entries)

    @property
    def alloc_ratio(self) -> float:
        """Median measured/predicted allocated peak (1.0 without runs), bounded to :data:`RATIO_BOUNDS`."""
        ratios = [e["measured"] / e["predicted"] for e in self.entries]
        return _clamp(statistics.median(ratios), RATIO_BOUNDS) if ratios else 1.0

    def _frag(self, expandable: bool) -> float | None:
        margins = [e["reserved"] / e["measured"] - 1 for e in self.entries
                   if e.get("reserved") and bool(e.get("expandable")) == expandable]
        return _clamp(statistics.median(margins), FRAG_BOUNDS) if margins else None

    @property
    def frag(self) -> float | None:
        """Median reserved/allocated - 1 of the runs without expandable segments (None: no such run)."""
        return self._frag(False)

    @property
    def frag_expandable(self) -> float | None:
        """The same for runs with ``expandable_segments:True``."""
        return self._frag(True)

    def device_error(self) -> float | None:
        """How far this calibration's device-level prediction (allocated times the median ratio, times one plus the
        median margin) was above what a recorded run used, at most; None with fewer than :data:`SPREAD_RUNS` runs
        that recorded their reserved peak (too few to know the spread).

        >>> runs = tuple({"predicted": 100, "measured": m, "reserved": int(m * 1.1), "expandable": False}
        ...              for m in (95, 100, 105))
        >>> round(Calibration("k", runs).device_error(), 3), Calibration("k", runs[:2]).device_error() is None
        (0.053, True)
        >>> Calibration("k", runs[1:2] * 3).device_error() == ERROR_FLOOR  # three runs that agree: the floor
        True
        """
        used = [e for e in self.entries if e.get("reserved")]
        if len(used) < SPREAD_RUNS:
            return None
        worst = 0.0
        for e in used:
            frag = (self.frag_expandable if e.get("expandable") else self.frag) or 0.0
            predicted = e["predicted"] * self.alloc_ratio * (1 + frag)
            worst = max(worst, predicted / e["reserved"] - 1)
        return max(worst, ERROR_FLOOR)

    def apply(self, base: Coefficients) -> Coefficients:
        """``base`` corrected by these runs: ``scale`` times the median ratio, and the measured margins.

        >>> cal = Calibration("k", ({"predicted": 100, "measured": 110, "reserved": 121, "expandable": False},))
        >>> co = cal.apply(Coefficients())
        >>> round(co.scale, 2), round(co.f_frag, 2), co.f_frag_expandable == Coefficients().f_frag_expandable
        (1.1, 0.1, True)
        """
        if not self.entries:
            return base
        frag, frag_x = self.frag, self.frag_expandable
        return replace(base, scale=base.scale * self.alloc_ratio,
                       f_frag=base.f_frag if frag is None else frag,
                       f_frag_expandable=base.f_frag_expandable if frag_x is None else frag_x)

    def describe(self) -> str:
        """One line: which machine, how many runs, and the corrections.

        >>> Calibration("NVIDIA H100 80GB HBM3|torch 2.11.0|trl 1.16.0",
        ...             ({"predicted": 100, "measured": 97, "reserved": 104, "expandable": False},)).describe()
        'learned on this machine (NVIDIA H100 80GB HBM3, torch 2.11.0, trl 1.16.0): 1 run, measured/predicted 0.97, reserved/allocated 1.072'
        """
        parts = [f"measured/predicted {self.alloc_ratio:.2f}"]
        if self.frag is not None:
            parts.append(f"reserved/allocated {1 + self.frag:.3f}")
        if self.frag_expandable is not None:
            parts.append(f"with expandable segments {1 + self.frag_expandable:.3f}")
        runs = f"{self.runs} run" + ("" if self.runs == 1 else "s")
        return f"learned on this machine ({self.key.replace('|', ', ')}): {runs}, " + ", ".join(parts)


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    return min(bounds[1], max(bounds[0], x))


# -------------------------------------------------------------------------------------------------------------------
# The file


def _valid_entry(e: Any) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), int) and not isinstance(e.get(k), bool) and e[k] > 0
                                        for k in ("predicted", "measured"))
            and (e.get("reserved") is None or (isinstance(e["reserved"], int) and e["reserved"] > 0)))


def _parse(text: str) -> dict[str, list[dict[str, Any]]]:
    """``{key: entries}`` of a calibration file; ValueError when it is not one."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("machines"), dict):
        raise ValueError(f"not a {SCHEMA} file")
    out = {}
    for key, m in data["machines"].items():
        entries = m.get("runs") if isinstance(m, dict) else None
        if not isinstance(entries, list) or not all(_valid_entry(e) for e in entries):
            raise ValueError(f"malformed entry for {key!r}")
        out[str(key)] = entries
    return out


def _read(path: Path, warn: Warn) -> dict[str, list[dict[str, Any]]]:
    """The file's machines; an unreadable or corrupt file warns once and is renamed aside, never deleted."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
    else:
        try:
            return _parse(text)
        except (ValueError, AttributeError) as e:
            why = str(e).splitlines()[0]
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, aside)
        warn(f"calibration file {path} is unusable ({why}); kept it as {aside.name} and started afresh")
    except OSError:
        warn(f"calibration file {path} is unusable ({why}); using the built-in calibration")
    return {}


def _locked(path: Path) -> FileLock:
    """A lock next to the file for the read-modify-write (filelock: advisory on POSIX, a real lock on Windows)."""
    return FileLock(str(path.with_name(path.name + ".lock")))


def _write(path: Path, machines: dict[str, list[dict[str, Any]]]) -> None:
    body = json.dumps({"schema": SCHEMA, "machines": {k: {"runs": v} for k, v in machines.items()}}, indent=1)
    write_atomic(path, body + "\n")


def load_calibration(key: str, *, model: str | None = None, warn: Warn = _stderr) -> Calibration | None:
    """The calibration recorded under ``key`` for ``model`` (a ``model_key``; None: every entry), or None (no file,
    no runs for this key and model, or an unusable file)."""
    return _of_model(key, _read(calibration_path(), warn).get(key) or [], model)


def _of_model(key: str, entries: list[dict[str, Any]], model: str | None) -> Calibration | None:
    mine = [e for e in entries if model is None or e.get("model") == model]
    return Calibration(key, tuple(mine)) if mine else None


def record_run(key: str, predicted_alloc: int, measured_alloc: int, measured_reserved: int | None, *,
               expandable: bool = False, model: str | None = None, warn: Warn = _stderr) -> Calibration | None:
    """Add one worst-case probe under ``key`` (and ``model``, its ``model_key``) and return the updated calibration
    of that model (None if nothing could be stored).

    ``predicted_alloc`` is what the *built-in* coefficients (scale 1) predicted for the probe's worst case, so
    corrections never compound; ``measured_alloc`` / ``measured_reserved`` are the probe's ``max_memory_allocated`` /
    ``max_memory_reserved``. Record only probes that completed their steps: an OOM's peak is not the configuration's,
    and a real run's may be below its worst case. A cache that cannot be written gives one warning line and the run
    goes on.
    """
    if predicted_alloc <= 0 or measured_alloc <= 0:
        return None
    entry = {"predicted": int(predicted_alloc), "measured": int(measured_alloc),
             "reserved": int(measured_reserved) if measured_reserved else None, "expandable": bool(expandable),
             "time": round(time.time(), 1), **({"model": model} if model else {})}
    path = calibration_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            machines = _read(path, warn)
            machines[key] = [*machines.get(key, []), entry][-KEEP:]
            _write(path, machines)
    except OSError as e:
        warn(f"cannot save the calibration to {path} ({e.strerror or e}); set OOMGUARD_CACHE_DIR to a writable "
             "directory to keep what runs learn")
        return None
    return _of_model(key, machines[key], model)
