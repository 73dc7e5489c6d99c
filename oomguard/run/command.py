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
           "resolve_command"]
