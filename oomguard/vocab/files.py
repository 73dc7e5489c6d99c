"""The one way oomguard writes a file it must not leave half-written: atomically, with the file mode any other write
of the user's would get.

A report, a lock, the calibration store, an HTML page: each is written to a temporary file in the same directory,
flushed to disk, then renamed over the target, so a crash mid-write never leaves half a file and an existing file is
replaced only by a complete one. ``tempfile.mkstemp`` creates its file readable by its owner only (0600); the file
is given the mode the umask gives a plain ``open`` (0644 under the usual 022), so a report or lock is as readable as
the user's other files. The temporary file is removed whatever goes wrong.

>>> import tempfile, os, stat
>>> d = tempfile.mkdtemp()
>>> p = write_atomic(os.path.join(d, "sub", "a.txt"), "hello")
>>> p.read_text(), stat.S_IMODE(p.stat().st_mode) == 0o666 & ~UMASK, os.listdir(p.parent)
('hello', True, ['a.txt'])
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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


__all__ = ["UMASK", "write_atomic"]
