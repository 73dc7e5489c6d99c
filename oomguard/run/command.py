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

from ..vocab.files import read_json
from ..vocab.knobs import TRL_DEFAULTS, check_values
from ..vocab.lock import Lock
from ..vocab.schema import RecordError
from ..vocab.trlrange import Support, support

EXIT_EXHAUSTED = 75  # EX_TEMPFAIL: the ladder or the budget is used up
EXIT_LEAKED = 76  # the run leaks memory and stopped at it (--no-leak-restart, too fast, or the budget spent)
EXIT_BUG = 70  # EX_SOFTWARE: an oomguard bug (a rung produced invalid knobs)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


class UsageError(Exception):
    """A mistake in how oomguard was called; the message is one line and names the way out."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class InternalError(Exception):
    """An error of oomguard's own (a bug, a training process of another version): the message is one line that names
    it and where its traceback is; the exit code is EXIT_BUG."""

    code = EXIT_BUG


INTERNAL_ERROR_FILE = "internal-error.txt"


def internal_error(e: BaseException, run_dir: Path, when: str = "") -> str:
    """Keep ``e``'s traceback in ``run_dir`` and return the one line the user reads instead of it (``when``: "during
    attempt 2", where that is known).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> try:
    ...     {}["answer"]
    ... except KeyError as e:
    ...     line = internal_error(e, d, "during attempt 2")
    >>> line.replace(str(d), "RUN")  # doctest: +NORMALIZE_WHITESPACE
    "internal error of oomguard during attempt 2 (KeyError: 'answer'); the traceback is in RUN/internal-error.txt:
    please report it to oomguard's maintainers with that file"
    >>> "Traceback" in (d / INTERNAL_ERROR_FILE).read_text()
    True
    """
    import traceback

    path = run_dir / INTERNAL_ERROR_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)) + "\n")
        where = f"the traceback is in {path}"
    except OSError:
        where = f"its traceback could not be kept ({path} cannot be written)"
    said = (str(e).strip().splitlines() or [""])[0][:300]
    what = f"{type(e).__name__}: {said}" if said else type(e).__name__
    return (f"internal error of oomguard{' ' + when if when else ''} ({what}); {where}: please report it to "
            "oomguard's maintainers with that file")


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
        _executable(first)
        return list(args)
    found = shutil.which(first)
    if found is None:
        raise UsageError(f"command not found: {first} (is it installed in this environment?)", EXIT_NOT_FOUND)
    _executable(found, first)
    return list(args)


def _executable(path: str, typed: str | None = None) -> None:
    """Refuse, before anything runs, a command the kernel would not execute: not a file, no execute permission, or
    neither a ``#!`` line nor a binary (the shell runs such a script itself; ``exec`` fails with ENOEXEC).

    >>> import tempfile
    >>> f = tempfile.mkstemp(suffix=".sh")[1]
    >>> _ = Path(f).write_text("echo hi\\n"); os.chmod(f, 0o755)
    >>> _executable(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    oomguard.run.command.UsageError: cannot execute ...sh: it has no #! line naming its interpreter; add one (#!/usr/bin/env bash), or run it as `oomguard run -- bash ...sh`
    """
    name = typed or path
    if os.path.isdir(path):
        raise UsageError(f"cannot execute {name}: it is a directory", EXIT_NOT_EXECUTABLE)
    if not os.access(path, os.X_OK):
        raise UsageError(f"permission denied: {name} is not executable (chmod +x {name}, or run it through its "
                         "interpreter)", EXIT_NOT_EXECUTABLE)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return  # exec will say what is wrong
    if head and not head.startswith((b"#!", b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe")):
        raise UsageError(f"cannot execute {name}: it has no #! line naming its interpreter; add one "
                         f"(#!/usr/bin/env bash), or run it as `oomguard run -- bash {name}`", EXIT_NOT_EXECUTABLE)


def output_file(text: str, default_name: str, option: str) -> Path:
    """Where ``option`` (``--report``, ``--lock``, ``--html``) writes: the path given, or ``default_name`` inside it
    when it names a directory (an existing one, or one written with a trailing ``/``). Checked before anything runs,
    so that a run never ends stable without its report or lock: a path that cannot be written is one line, exit 2.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> output_file(d, "oomguard-report.json", "--report") == Path(d) / "oomguard-report.json"
    True
    >>> output_file(os.path.join(d, "new", "r.json"), "oomguard-report.json", "--report").name
    'r.json'
    >>> open(os.path.join(d, "notes"), "w").close()
    >>> output_file(os.path.join(d, "notes", "r.json"), "x", "--report")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    oomguard.run.command.UsageError: --report .../notes/r.json: .../notes is a file, not a directory; give a path in a directory
    """
    path = Path(text).expanduser()
    if path.is_dir() or text.endswith(("/", os.sep)):
        path = path / default_name
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {text}: {path} cannot be written (permission denied); give a writable path")
    _writable_dir(path.parent, option, text)
    return path


def work_dir(text: str, option: str = "--workdir") -> Path:
    """The working directory oomguard keeps each attempt's plan, events and crash records in: an existing directory
    it can write in, or one it can create; else one line, exit 2.

    >>> import tempfile
    >>> f = tempfile.mkstemp()[1]
    >>> work_dir(f)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    oomguard.run.command.UsageError: --workdir ...: a file, not a directory; give a directory (it is created if missing)
    """
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {text}: a file, not a directory; give a directory (it is created if missing)")
    _writable_dir(path, option, text)
    return path


def _writable_dir(path: Path, option: str, text: str) -> None:
    """``path`` is a directory oomguard can write in, or can be created: its nearest existing ancestor is a directory
    it can write in."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        missing = "" if probe == path else f"{path} does not exist yet, but "
        raise UsageError(f"{option} {text}: {missing}{probe} is a file, not a directory; give a path in a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {text}: cannot write in {probe} (permission denied); give a writable path")


def trl_support(argv: list[str]) -> Support:
    """How oomguard stands to the TRL the command will import (``oomguard.vocab.trlrange``), read before anything
    launches: from the installed distribution's metadata on this interpreter's path (``importlib.metadata``, a
    millisecond or two), when the command runs in this environment (``train.py`` and ``-m`` forms; a ``python``, console script or launcher from
    the same ``bin`` directory). Another interpreter's TRL is not read here (``unknown``): the training process
    refuses a TRL below the floor itself when it imports it (``oomguard.child.trlcompat``).

    >>> from importlib.metadata import version
    >>> trl_support([sys.executable, "-c", "pass"]).version == version("trl")  # this environment's TRL
    True
    >>> trl_support(["/elsewhere/venv/bin/python", "train.py"]).status  # another environment's: not read here
    'unknown'
    """
    if not argv or not _same_environment(argv[0]):
        return support(None)
    return support(installed_version("trl", sys.path))


def installed_version(dist: str, paths: list[str]) -> str | None:
    """The version of the distribution ``dist`` installed on ``paths`` (the first one that holds it), as
    ``importlib.metadata`` finds it, or None.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> os.mkdir(os.path.join(d, "trl-0.28.0.dist-info"))
    >>> _ = Path(d, "trl-0.28.0.dist-info", "METADATA").write_text("Name: trl\\nVersion: 0.28.0\\n")
    >>> installed_version("trl", [d]), installed_version("peft", [d])
    ('0.28.0', None)
    """
    from importlib import metadata

    for found in metadata.distributions(name=dist, path=list(paths)):
        return found.version
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


def load_lock(path: str) -> Lock:
    """The lock at ``path``, to replay with ``--config``; a UsageError (one line) where it cannot be one."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise UsageError(f"no such lock file: {path}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the lock file {path}: {e}") from None
    try:
        lock = Lock.from_dict(data, path)
    except RecordError as e:
        raise UsageError(str(e)) from None
    # A lock is read back as Knobs are checked (types, ranges, optimizer names, GRPO's batch rules), before anything
    # runs: a hand-edited or corrupted lock is refused, never replayed or reported as a stable config.
    stable = lock.stable
    problems = check_values(stable, lock.world_size) if stable is not None else []
    if not problems:
        base = TRL_DEFAULTS.merged(stable) if stable is not None else TRL_DEFAULTS
        problems = check_values(lock.overrides, lock.world_size, base=base)
    if problems:
        raise UsageError(f"{path}: not a usable lock: {'; '.join(problems)}; fix it or re-create it with "
                         "`oomguard run` (without --config)")
    return lock


__all__ = ["EXIT_BUG", "EXIT_EXHAUSTED", "EXIT_LEAKED", "EXIT_NOT_EXECUTABLE", "EXIT_NOT_FOUND", "INTERNAL_ERROR_FILE",
           "InternalError", "UsageError", "internal_error", "load_lock", "output_file", "resolve_command",
           "trl_support", "work_dir"]
