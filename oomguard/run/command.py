"""How oomguard is called: the command forms it runs, the lock file it replays, usage errors and exit codes.

Everything here is checked before anything runs, and every mistake is one line that names the way out.

>>> resolve_command(["-m", "trl", "grpo"])[1:]
['-m', 'trl', 'grpo']
>>> resolve_command([])
Traceback (most recent call last):
  ...
oomguard.run.command.UsageError: no command given: use `oomguard run train.py ARGS...` or `oomguard run -- COMMAND...`
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..vocab.knobs import TRL_DEFAULTS, check_values
from ..vocab.records import read_json
from ..vocab.schema import LOCK_SCHEMA, RecordError, check_schema
from ..vocab.trlrange import Support, support

EXIT_EXHAUSTED = 75  # EX_TEMPFAIL: the ladder or the budget is used up
EXIT_BUG = 70  # EX_SOFTWARE: an oomguard bug (a rung produced invalid knobs)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


class UsageError(Exception):
    """A mistake in how oomguard was called; the message is one line and names the way out."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def resolve_command(args: list[str]) -> list[str]:
    """``train.py ARGS`` -> the current interpreter; ``-m module``; ``python ...``; any console script on PATH."""
    if not args:
        raise UsageError("no command given: use `oomguard run train.py ARGS...` or `oomguard run -- COMMAND...`")
    first = args[0]
    if first == "-m":
        if len(args) < 2:
            raise UsageError("`-m` needs a module name: `oomguard run -m package.module ARGS...`")
        return [sys.executable, "-m", *args[1:]]
    if first.endswith(".py"):
        if not Path(first).is_file():
            raise UsageError(f"no such script: {first}", EXIT_NOT_FOUND)
        return [sys.executable, *args]
    if os.sep in first or (os.altsep and os.altsep in first):
        if not Path(first).exists():
            raise UsageError(f"no such command: {first}", EXIT_NOT_FOUND)
        return list(args)
    if shutil.which(first) is None:
        raise UsageError(f"command not found: {first} (is it installed in this environment?)", EXIT_NOT_FOUND)
    return list(args)


def trl_support(argv: list[str]) -> Support:
    """How oomguard stands to the TRL the command will import (``oomguard.vocab.trlrange``), read before anything
    launches: from the installed distribution's ``trl-VERSION.dist-info`` on this interpreter's path, when the
    command runs in this environment (``train.py`` and ``-m`` forms; a ``python``, console script or launcher from
    the same ``bin`` directory). Another interpreter's TRL is not read here (``unknown``): the training process
    refuses a TRL below the floor itself when it imports it (``oomguard.child.trlcompat``). Looks at no more than the
    names of the directories on the path, so it costs well under a millisecond.

    >>> trl_support([sys.executable, "-c", "pass"]).status in ("tested", "newer", "older", "unknown")
    True
    """
    if not argv or not _same_environment(argv[0]):
        return support(None)
    return support(installed_version("trl", sys.path))


def installed_version(dist: str, paths: list[str]) -> str | None:
    """The version of the distribution ``dist`` that the first of ``paths`` holding it has (its ``.dist-info``
    directory's name, ``trl-1.16.0.dist-info``; an egg-info's ``PKG-INFO`` otherwise), or None.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.mkdir(os.path.join(d, "trl-0.28.0.dist-info"))
    >>> installed_version("trl", [d]), installed_version("peft", [d])
    ('0.28.0', None)
    """
    prefix = dist.lower().replace("-", "_") + "-"
    for entry in paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            low = name.lower()
            if low.startswith(prefix) and low.endswith(".dist-info"):
                return name[len(prefix):-len(".dist-info")]
            if low.startswith(prefix) and low.endswith(".egg-info"):
                return _pkg_info_version(Path(entry or ".") / name / "PKG-INFO")
    return None


def _pkg_info_version(path: Path) -> str | None:
    try:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _same_environment(program: str) -> bool:
    """Whether ``program`` (the command's first word) runs with this interpreter's packages: this interpreter, or a
    program in its ``bin`` directory (a venv's ``python``, ``torchrun``, ``accelerate``, ``trl``), or a script whose
    ``#!`` names an interpreter there."""
    here = os.path.dirname(os.path.abspath(sys.executable))
    path = shutil.which(program) or program
    if os.path.dirname(os.path.abspath(path)) == here:
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return False
    if not first.startswith(b"#!"):
        return False
    words = first[2:].decode(errors="replace").split()
    return bool(words) and os.path.dirname(os.path.abspath(words[0])) == here


def load_lock(path: str) -> dict[str, Any]:
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise UsageError(f"no such lock file: {path}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the lock file {path}: {e}") from None
    try:
        check_schema(data, LOCK_SCHEMA, path)
    except RecordError as e:
        raise UsageError(str(e)) from None
    # A lock is read back as Knobs are checked (types, ranges, optimizer names, GRPO's batch rules), before anything
    # runs: a hand-edited or corrupted lock is refused, never replayed or reported as a stable config.
    overrides = data.get("overrides")
    if overrides is None:
        overrides = data["overrides"] = {}
    if not isinstance(overrides, dict):
        raise UsageError(f"{path}: \"overrides\" must be an object of knob values; re-create the lock with "
                         "`oomguard run` (without --config)")
    world = data.get("world_size")
    world = world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else 1
    stable = data.get("stable")
    problems = check_values(stable, world) if isinstance(stable, dict) else []
    if not problems:
        base = TRL_DEFAULTS.merged(stable) if isinstance(stable, dict) else TRL_DEFAULTS
        problems = check_values(overrides, world, base=base)
    if problems:
        raise UsageError(f"{path}: not a usable lock: {'; '.join(problems)}; fix it or re-create it with "
                         "`oomguard run` (without --config)")
    return data


__all__ = ["EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "UsageError", "load_lock",
           "resolve_command", "trl_support"]
