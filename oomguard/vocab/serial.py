"""Records as JSON and back, generically over a dataclass's fields: the events, the plan and its parts, the lock, the
report's attempts. A field's type (its annotation) says how a value is read back; a nested record is a dataclass
read the same way; a malformed value reads as the field's empty value (a torn or foreign line must never stop the
supervisor), and fields a reader does not know are left out (a newer oomguard may add some).

>>> coerce("3", int), coerce(None, list[str]), coerce(["a", 1], list[str]), coerce("yes", bool)
(3, [], ['a', '1'], False)

``oomguard.vocab.lock.Lock`` and the plan's parts (``oomguard.vocab.protocol``) are read with ``read_fields`` and
written with ``to_fields``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (cached)."""
    cached = _HINTS.get(cls)
    if cached is None:
        cached = _HINTS[cls] = typing.get_type_hints(cls)
    return cached


def coerce(value: Any, hint: Any) -> Any:
    """``value`` as a field of type ``hint`` holds it; a malformed value reads as the field's empty value."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if optional else []
    base = args[0] if len(args) == 1 else hint
    origin = typing.get_origin(base)
    if base is Any:
        return value
    if value is None:
        return None if type(None) in typing.get_args(hint) else _empty(base)
    if dataclasses.is_dataclass(base) and isinstance(base, type):
        if isinstance(value, base):
            return value
        return read_fields(base, value) if isinstance(value, dict) else None
    if isinstance(base, type) and issubclass(base, Enum):
        try:
            return base(value)
        except ValueError:
            return value
    if base is bool:
        return value is True
    if base is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _int(value)
    if base is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    if base is str:
        return value if isinstance(value, str) else str(value)
    if origin is dict or base is dict:
        return dict(value) if isinstance(value, dict) else (None if type(None) in typing.get_args(hint) else {})
    if origin is list or base is list:
        item = (typing.get_args(base) or (Any,))[0]
        return [coerce(v, item) for v in value] if isinstance(value, (list, tuple)) else []
    if origin is tuple:
        return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else ()
    return value


def read_fields(cls: type[T], data: dict[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from ``data``: each known field coerced to its type, the others left out,
    missing ones at their defaults."""
    known = hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{k: coerce(data[k], known[k]) for k in names if k in data})


def to_fields(obj: Any) -> dict[str, Any]:
    """A record as plain JSON values, its fields in declared order: nested records (through their own ``to_dict``
    where they have one) and lists of them too, an Enum as its value, a tuple as a list. A field whose metadata has
    ``omit`` set is left out while it is None or an empty list; one with ``round`` is rounded to that many digits."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"not a record: {obj!r}")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("omit") and (value is None or value == []):
            continue
        if "round" in f.metadata and isinstance(value, float):
            value = round(value, f.metadata["round"])
        out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_dict() if callable(to_dict) else to_fields(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _empty(base: Any) -> Any:
    origin = typing.get_origin(base)
    if origin is list or base is list:
        return []
    if origin is dict or base is dict:
        return {}
    return {bool: False, str: "", float: 0.0}.get(base, () if origin is tuple else None)


def _int(v: Any) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


__all__ = ["coerce", "hints", "read_fields", "to_fields"]
