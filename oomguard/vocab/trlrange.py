"""The TRL releases oomguard supports and tests, and what it says about a TRL outside them.

oomguard runs the TRL a user already has, from the floor (0.29) up to the next major release (2.0), the range
``pyproject.toml`` declares. Which of those releases were tested, and which memory behaviour each has, is stated
here once; what the installed TRL *offers* (its GRPOConfig fields, its trainer's arguments, its LM head) is read from
the code itself in the training process (``oomguard.child.trlcompat``), never inferred from a version number.

A version number decides only two things, both here: whether a TRL is below the floor (refused, exit 2: its
GRPOTrainer lacks what the patches need) and whether it is newer than the newest tested release (it runs; its
memory behaviour has not been measured, so the pre-flight stops only what is beyond any plausible error and a probe
verifies the first choice). ``oomguard plan`` and the supervisor, which never import TRL, also use
:func:`head_of` to guess the LM head of a release before the training process has reported the real one.

>>> support("0.29.1").status, support("1.16.0").status, support("1.20.0").status, support("0.28.0").status
('tested', 'tested', 'newer', 'older')
>>> print(support("0.28.0").message)
TRL 0.28.0 is installed; oomguard supports TRL 0.29 to 1.x (tested: 0.29.1, 1.10.0, 1.16.0): pip install "trl>=0.29,<2"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

# The oldest supported release: from 0.29 on GRPOConfig rests on TRL's _BaseConfig as in 1.x, prompts are no longer
# truncated by max_prompt_length, and each knob oomguard changes means the same (research notes, issue 24).
FLOOR = "0.29"
# Not yet supported: the next major release, whose breaking changes are not known.
CEILING = "2"
REQUIREMENT = f"trl>={FLOOR},<{CEILING}"
# The releases the suite runs on (ci/compat.sh: the floor; the main suite: the newest) and whose memory was measured
# on the simulated device (tests/fixtures/trl/). The newest of them bounds what counts as tested.
TESTED = ("0.29.1", "1.10.0", "1.16.0")
# TRL 1.15.0 replaced the materialised logits by a fused, chunked LM head (trl/trainer/utils.py add_fused_lm_head).
FUSED_HEAD_SINCE = "1.15.0"
# The memory behaviours of the LM head that the memory model knows (oomguard.memory.estimate): TRL's two, and
# Unsloth's CPU backend, which routes TRL's fused head to its own row-chunked torch code (child/stacks/unsloth.py).
HEADS = ("fused", "logits", "rowchunk")


@dataclass(frozen=True)
class Support:
    """How oomguard stands to one installed TRL: ``tested`` (in the tested range: from the floor to the newest tested
    release, whose ends and memory behaviours are measured), ``newer`` (newer than the newest tested: runs, verified by a probe), ``older`` (below the floor:
    refused), ``unknown`` (no version could be read). ``message`` is the one line to print, if any (without
    the ``oomguard:`` the printer adds)."""

    version: str | None
    status: str
    message: str | None = None

    @property
    def refused(self) -> bool:
        return self.status == "older"

    @property
    def untested(self) -> bool:
        """Newer than the newest tested release: its memory behaviour is not measured."""
        return self.status == "newer"


def _range_text() -> str:
    return f"TRL {FLOOR} to 1.x (tested: {', '.join(TESTED)})"


def _parse(version: str) -> Version | None:
    from packaging.version import InvalidVersion, Version  # loaded when a version is read, not with the supervisor

    try:
        return Version(version)
    except (InvalidVersion, TypeError):
        return None


def _release(v: Version) -> Version:
    return type(v)(v.base_version)


def support(version: str | None) -> Support:
    """Where ``version`` (the installed TRL's, e.g. ``"1.16.0"``) stands; see :class:`Support`.

    A development or release-candidate build counts as its release (``1.17.0.dev0`` is newer than 1.16.0, ``0.29.0rc1``
    is in range); anything from 2.0 on is newer than tested.

    >>> support("1.12.0").status, support("1.17.0.dev0").status, support("2.0.0").status, support(None).status
    ('tested', 'newer', 'newer', 'unknown')
    """
    v = _parse(version) if version else None
    if v is None:
        return Support(version, "unknown")
    release = _release(v)
    if release < type(v)(FLOOR):
        return Support(version, "older", f"TRL {version} is installed; oomguard supports {_range_text()}: "
                                         f'pip install "{REQUIREMENT}"')
    if release > type(v)(TESTED[-1]):
        return Support(version, "newer", f"TRL {version} is newer than the newest release oomguard was "
                                         f"tested with ({TESTED[-1]}): its memory behaviour is not measured, so "
                                         "the pre-flight stops only a config far beyond the device and a probe "
                                         "verifies the first choice before it is trusted")
    return Support(version, "tested")


def head_of(version: str | None) -> str | None:
    """The LM head a release is known to have (``fused`` from 1.15.0, ``logits`` before), or None when the version
    cannot be read. Only for where TRL cannot be inspected (``oomguard plan``, the supervisor before the training
    process reports): the training process reads the real one from the installed code.

    >>> head_of("1.16.0"), head_of("1.14.2"), head_of("0.29.1"), head_of("garbled")
    ('fused', 'logits', 'logits', None)
    """
    v = _parse(version) if version else None
    if v is None:
        return None
    return "fused" if _release(v) >= type(v)(FUSED_HEAD_SINCE) else "logits"
