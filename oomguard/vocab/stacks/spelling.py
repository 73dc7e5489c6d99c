"""How a stack around TRL spells the knobs in its own arguments, read both ways: one table per stack.

A :class:`Spelling` says how one knob (or knobs a stack spells together, such as ms-swift's ``--deepspeed zero3_offload``
for a ZeRO stage with its offloads) becomes the stack's arguments (``to_args``) and how it is read back from them
(``from_args``). A :class:`StackTable` holds a stack's spellings; from it the stack's adapter in the training process
sets and observes the knobs (``apply``, ``observe``), and the diff, the lock and the terminal say them in the stack's
words (``say``). What is printed is then what the adapter applies, and a lock replays the same setting.

Pure Python: the training process resolves what only it can (a :class:`Code` name such as ``torch.bfloat16``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..knobtable import TABLE


@dataclass(frozen=True)
class Code:
    """A name in the user's code rather than a value (``torch.bfloat16``): printed bare, resolved by the training
    process (``module``, ``attr``).

    >>> Code("torch.bfloat16"), Code("torch.bfloat16").attr
    (torch.bfloat16, 'bfloat16')
    """

    text: str

    def __repr__(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text

    @property
    def module(self) -> str:
        return self.text.rpartition(".")[0]

    @property
    def attr(self) -> str:
        return self.text.rpartition(".")[2]


@dataclass(frozen=True)
class Generated:
    """A config file for a setting the stack has no word for (ms-swift's ZeRO-3 with only the optimizer offloaded,
    which none of its DeepSpeed presets says): the training process writes it (``settings`` say what goes in it) and
    gives the stack its path; ``kind`` names it among an attempt's generated configs (``Attempt.generated``). Printed
    as the file once a run says where it was written (``at``), as ``what`` until then.

    >>> g = Generated("deepspeed", "swift's zero3 preset with offload_optimizer only, as a JSON file")
    >>> str(g), str(g.at({"deepspeed": "attempt-2/deepspeed-attempt2.json"}))
    ("<swift's zero3 preset with offload_optimizer only, as a JSON file>", 'attempt-2/deepspeed-attempt2.json')
    """

    kind: str
    what: str
    settings: tuple[tuple[str, Any], ...] = ()
    path: str | None = None

    def __str__(self) -> str:
        return self.path or f"<{self.what}>"

    def at(self, files: Mapping[str, str | None] | None) -> Generated:
        """This file where ``files`` (kind -> path, what a run generated) says it was written."""
        path = (files or {}).get(self.kind)
        return Generated(self.kind, self.what, self.settings, path) if path else self


def arg(target: Any, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``target``: a parsed-arguments object (attribute) or a call's keyword arguments (key)."""
    if isinstance(target, Mapping):
        return target.get(name, default)
    return getattr(target, name, default)


def has_arg(target: Any, name: str) -> bool:
    """Whether ``target`` has argument ``name`` (a call's keyword arguments take any)."""
    return isinstance(target, Mapping) or hasattr(target, name)


@dataclass(frozen=True)
class Spelling:
    """How one stack spells ``knobs`` (one knob, or a few it spells together) in its arguments ``args``.

    - ``to_args(*values)``: the knobs' values, in the order of ``knobs`` (None: not set), as the arguments' values; an
      empty dict when the stack has nothing to say for them (``otherwise`` is then said, if anything).
    - ``from_args(target)``: the knobs' values read back from the stack's parsed arguments (or a call's keyword
      arguments); an empty dict where they do not say them.
    - ``sets(overrides)``: whether the stack's adapter sets them, given oomguard's overrides (None, the default: where
      any of ``knobs`` is set);
      ``point``: where the stack reads them (ms-swift's ``arguments``; an Unsloth call such as
      ``FastLanguageModel.from_pretrained``), and ``needs``: arguments that must be true there for them to mean
      anything (neither read nor set otherwise); ``drops``: arguments removed when they are set (an alias the stack
      would read instead).
    - ``observed``: the adapter reads the user's values from these arguments (False: it reads them elsewhere, the
      comment says where)."""

    knobs: tuple[str, ...]
    args: tuple[str, ...]
    to_args: Callable[..., dict[str, Any]]
    from_args: Callable[[Any], dict[str, Any]]
    point: str
    sets: Callable[[Any], bool] | None = None
    needs: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()
    observed: bool = True
    otherwise: str = ""
    trl_name: bool = False  # a GRPOConfig field the stack takes under TRL's name (:func:`same_name`)

    def values(self, knobs: Any) -> tuple[Any, ...]:
        """This spelling's knobs' values in ``knobs`` (a Knobs, or a mapping; a missing knob is None)."""
        return tuple(arg(knobs, k) for k in self.knobs)

    def set_by(self, overrides: Any) -> bool:
        """Whether the adapter sets these knobs under ``overrides``."""
        if self.sets is not None:
            return self.sets(overrides)
        return any(v is not None for v in self.values(overrides))

    def means_something(self, target: Any) -> bool:
        return all(arg(target, n) for n in self.needs)


def never(_: Any) -> bool:
    """``sets`` of a spelling the adapter never sets (it is said, and read, only)."""
    return False


def same_name(knob: str, point: str) -> Spelling:
    """A knob the stack takes under its own name (TRL's), set and read by the generic ``GRPOConfig`` patches."""
    return Spelling((knob,), (knob,), lambda v: {knob: v},
                    lambda a: {knob: arg(a, knob)} if has_arg(a, knob) else {}, point, sets=never, trl_name=True)


def with_trl_names(own: tuple[Spelling, ...], point: str) -> tuple[Spelling, ...]:
    """A stack's own spellings, then every GRPOConfig field it does not spell otherwise, under TRL's name, read and set
    at ``point`` (the knob table's ``grpo_field``)."""
    spelt = {k for s in own for k in s.knobs}
    return (*own, *(same_name(n, point) for n, i in TABLE.items() if i.grpo_field and n not in spelt))


@dataclass(frozen=True)
class StackTable:
    """A stack's spellings, and how it says them: ``render(spelling, args)`` the words for one spelling's arguments,
    ``said_as`` how the end of a run introduces them, ``join`` what goes between two."""

    name: str
    spellings: tuple[Spelling, ...]
    render: Callable[[Spelling, dict[str, Any]], str]
    said_as: str
    join: str = "; "

    def spelling(self, knob: str) -> Spelling | None:
        return next((s for s in self.spellings if knob in s.knobs), None)

    def takes(self) -> tuple[str, ...]:
        """Every knob this stack has words for."""
        return tuple(k for s in self.spellings for k in s.knobs)

    # -- said --------------------------------------------------------------------------------------------------
    def say(self, spelling: Spelling, values: Iterable[Any],
            files: Mapping[str, str | None] | None = None) -> str | None:
        """The words that set ``spelling``'s knobs to ``values``, or None (nothing to say); a file the training
        process generated for them named where ``files`` says it was written (:class:`Generated`)."""
        args = {k: v.at(files) if isinstance(v, Generated) else v for k, v in spelling.to_args(*values).items()}
        return self.render(spelling, args) if args else spelling.otherwise or None

    def said(self, changes: Mapping[str, Any], among: Any = None,
             files: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """``changes`` (knob -> value) in the stack's words, each spelling once, keyed by the first of its knobs among
        the changes; a spelling of several knobs reads the others from ``changes``, else from ``among`` (the knobs in
        force), else takes them as unset. ``files``: the configs a run generated, by kind (:class:`Generated`)."""
        out: dict[str, str] = {}
        seen: set[int] = set()
        for knob in changes:
            spelling = self.spelling(knob)
            if spelling is None or id(spelling) in seen:
                continue
            seen.add(id(spelling))
            values = [changes[k] if k in changes else arg(among, k) if among is not None else None
                      for k in spelling.knobs]
            if all(v is None for v in values):  # unset: nothing to say
                continue
            words = self.say(spelling, values, files)
            if words is not None:
                out[knob] = words
        return out

    # -- set and observed (the training process) ---------------------------------------------------------------
    def _chosen(self, point: str | None, knobs: Iterable[str] | None) -> list[Spelling]:
        wanted = set(knobs) if knobs is not None else None
        return [s for s in self.spellings if (point is None or s.point == point)
                and (wanted is None or wanted & set(s.knobs))]

    def observe(self, target: Any, *, point: str | None = None, knobs: Iterable[str] | None = None) -> dict[str, Any]:
        """The user's values of the knobs ``target`` (the stack's arguments at ``point``) says."""
        out: dict[str, Any] = {}
        for s in self._chosen(point, knobs):
            if s.observed and s.means_something(target):
                out.update(s.from_args(target))
        return out

    def apply(self, overrides: Any, target: Any, *, point: str | None = None,
              knobs: Iterable[str] | None = None) -> dict[str, Any]:
        """Set oomguard's ``overrides`` in ``target`` (the stack's arguments at ``point``) where the stack reads them:
        each spelling the adapter sets, whose arguments ``target`` has, and whose values the arguments do not say
        already (so a user's stronger setting of the same knob stays). Returns the arguments set."""
        done: dict[str, Any] = {}
        for s in self._chosen(point, knobs):
            if not s.set_by(overrides) or not s.means_something(target):
                continue
            said = s.from_args(target)
            # knobs spelled together are written together: one oomguard leaves alone keeps the user's value (a ZeRO
            # stage raised over the user's optimizer offload keeps that offload)
            values = tuple(v if v is not None else said.get(k) for k, v in zip(s.knobs, s.values(overrides),
                                                                               strict=True))
            if said and all(said.get(k) == v for k, v in zip(s.knobs, values, strict=True) if v is not None):
                continue
            args = s.to_args(*values)
            if not all(has_arg(target, name) for name in args):
                continue
            for name in s.drops:
                if isinstance(target, dict):
                    target.pop(name, None)
            for name, value in args.items():
                if isinstance(target, dict):
                    target[name] = value
                else:
                    setattr(target, name, value)
            done.update(args)
        return done


__all__ = ["Code", "Generated", "Spelling", "StackTable", "arg", "has_arg", "never", "same_name", "with_trl_names"]
