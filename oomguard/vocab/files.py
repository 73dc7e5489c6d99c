"""The one way oomguard writes a file it must not leave half-written: atomically, with the file mode any other write
of the user's would get.

A report, a lock, the calibration store, an HTML page: each is written to a temporary file in the same directory,
flushed to disk, then renamed over the target, so a crash mid-write never leaves half a file and an existing file is
replaced only by a complete one. ``tempfile.mkstemp`` creates its file readable by its owner only (0600); the file
is given the mode the umask gives a plain ``open`` (0644 under the usual 022), so a report or lock is as readable as
the user's other files. The temporary file is removed whatever goes wrong. A run's report and lock are published
(``publish``) so that no earlier one is lost.

>>> import tempfile, os, stat
>>> d = tempfile.mkdtemp()
>>> p = write_atomic(os.path.join(d, "sub", "a.txt"), "hello")
>>> p.read_text(), stat.S_IMODE(p.stat().st_mode) == 0o666 & ~UMASK, os.listdir(p.parent)
('hello', True, ['a.txt'])
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()  # read once, at import (os.umask can only be read by setting it)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically, creating its directory; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (``oomguard.vocab.files.write_atomic``) and return the path."""
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def publish(data: dict[str, Any], kept: str | os.PathLike[str], top: str | os.PathLike[str],
            aside_dir: str | os.PathLike[str]) -> Path | None:
    """Write a run's record (report or lock) to its own file ``kept`` and a copy of it to ``top``; lose nothing.

    ``kept`` (under the run's workdir) is never replaced; ``top`` (``oomguard-report.json``, ``oomguard.lock.json``)
    always holds the latest run's record, with ``kept_at`` naming the kept copy. A ``top`` file that is not such a copy
    (written by an older oomguard, or by hand, or whose kept copy is gone) is first copied into ``aside_dir``.
    Returns the path it was kept at, or None.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _ = write_json_atomic(os.path.join(d, "top.json"), {"status": "stable", "by": "an older run"})
    >>> aside = publish({"status": "failed"}, os.path.join(d, "runs", "2", "report.json"), os.path.join(d, "top.json"),
    ...                 os.path.join(d, "kept"))
    >>> read_json(aside)["by"], read_json(os.path.join(d, "top.json"))["status"]
    ('an older run', 'failed')
    >>> publish({"status": "stable"}, os.path.join(d, "runs", "3", "report.json"), os.path.join(d, "top.json"),
    ...         os.path.join(d, "kept")) is None  # the top file was a copy of run 2's, which is kept
    True
    """
    kept, top = Path(kept), Path(top)
    data = {**data, "kept_at": str(kept.resolve())}
    write_json_atomic(kept, data)
    aside = None
    if top.exists() and not _is_kept_copy(top):
        aside = _keep_aside(top, Path(aside_dir))
    write_json_atomic(top, data)
    return aside


def _is_kept_copy(path: Path) -> bool:
    """True when ``path`` is a byte-for-byte copy of the record its ``kept_at`` names."""
    try:
        text = path.read_bytes()
        where = json.loads(text).get("kept_at")
        return bool(where) and Path(where).resolve() != path.resolve() and Path(where).read_bytes() == text
    except (OSError, ValueError, AttributeError):
        return False


def _keep_aside(path: Path, aside_dir: Path) -> Path:
    """Copy ``path`` into ``aside_dir`` under a name stamped with its modification time; never overwrite."""
    import shutil

    aside_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    dest = aside_dir / f"{path.stem}-{stamp}{path.suffix}"
    n = 1
    while dest.exists():
        n += 1
        dest = aside_dir / f"{path.stem}-{stamp}-{n}{path.suffix}"
    shutil.copy2(path, dest)
    return dest


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    to_dict = getattr(o, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return repr(o)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when it is missing, unreadable or not an object (a run cut short may
    leave no report, or half of one).

    >>> read_json_object("/nonexistent/report.json") is None
    True
    """
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["UMASK", "publish", "read_json", "read_json_object", "write_atomic", "write_json_atomic"]
