"""The typed parameters a ladder file may give a remedy: type, range, meaning, checked when the ladder is loaded.

A ladder is the user's file (``--ladder my.toml``), so a wrong value is the user's to fix, in one line that names the
rung, the parameter, what it takes and what it got, before anything runs: never a traceback, and never an "internal
error" the first time a climb reaches the rung.

>>> R = Param(16, int, low=1, text="the LoRA rank")
>>> R.check("r", 8), R.check("r", -4)
(None, 'r must be an integer of at least 1 (the LoRA rank), not -4')
>>> Param(0.5, float, low=0, high=1, low_open=True, high_open=True).check("factor", "half")
"factor must be a number between 0 and 1 (both excluded), not 'half'"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Param:
    """One parameter of a remedy: its default, its type (``int``, ``float``, ``str`` or ``list`` of str), its
    range (``low``/``high``, excluded where ``*_open``), values of another type it also takes (``also``: ``"auto"``,
    ``"all-linear"``), and what it means (for messages and the reference)."""

    default: Any
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[str, ...] = ()
    text: str = ""

    def takes(self) -> str:
        """What the parameter takes, in words: ``an integer of at least 1``, ``a number between 0 and 1``."""
        noun = {int: "an integer", float: "a number", str: "a string", list: "a list of names"}[self.kind]
        if self.low is not None and self.high is not None:
            ends = (" (both excluded)" if self.low_open and self.high_open else " (excluded)" if self.low_open
                    or self.high_open else "")
            rng = f" between {self.low:g} and {self.high:g}{ends}"
        elif self.low is not None:
            rng = f" {'above' if self.low_open else 'of at least'} {self.low:g}"
        elif self.high is not None:
            rng = f" {'below' if self.high_open else 'of at most'} {self.high:g}"
        else:
            rng = ""
        alt = "".join(f" or \"{a}\"" for a in self.also)
        return f"{noun}{rng}{alt}"

    def check(self, name: str, value: Any) -> str | None:
        """Why ``value`` cannot be this parameter, or None."""
        if isinstance(value, str) and value in self.also:
            return None
        if not self._typed(value) or not self._in_range(value):
            meaning = f" ({self.text})" if self.text else ""
            return f"{name} must be {self.takes()}{meaning}, not {value!r}"
        return None

    def _typed(self, v: Any) -> bool:
        if isinstance(v, bool):
            return False
        if self.kind is float:
            return isinstance(v, (int, float))
        if self.kind is list:
            return isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)
        return isinstance(v, self.kind)

    def _in_range(self, v: Any) -> bool:
        if self.kind not in (int, float):
            return True
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return not (self.high is not None and (v >= self.high if self.high_open else v > self.high))


def shrink_factor(default: float, text: str) -> Param:
    """A factor a graded rung multiplies a knob by on each step: strictly between 0 and 1."""
    return Param(default, float, low=0, high=1, low_open=True, high_open=True, text=text)


def lora_params() -> dict[str, Param]:
    """The LoRA adapter parameters (``lora``, and ``load_4bit`` when it adds LoRA)."""
    return {"r": Param(16, int, low=1, high=4096, text="the LoRA rank"),
            "alpha": Param(32, int, low=1, text="the LoRA scaling alpha"),
            "target_modules": Param("all-linear", list, also=("all-linear",),
                                    text="the modules LoRA adapts, e.g. [\"q_proj\", \"v_proj\"]")}


__all__ = ["Param", "lora_params", "shrink_factor"]
