"""oomguard: keep GRPO fine-tuning alive through GPU out-of-memory errors.

Importing oomguard is cheap and never imports torch. The public names are loaded on first use:

>>> import oomguard
>>> oomguard.is_oom(MemoryError())
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "is_oom": ("oomguard.oom.parse", "is_oom"),
    "parse_oom": ("oomguard.oom.parse", "parse_oom"),
    "OOMReport": ("oomguard.vocab.oomreport", "OOMReport"),
    "diagnose": ("oomguard.oom.diagnose", "diagnose"),
    "Diagnosis": ("oomguard.vocab.diagnosis", "Diagnosis"),
    "Knobs": ("oomguard.vocab.knobs", "Knobs"),
    "guard": ("oomguard.inprocess.guarded", "guard"),  # no submodule is named guard: this name is only the function
    "OOMGuardExhausted": ("oomguard.inprocess.guarded", "OOMGuardExhausted"),
    "estimate": ("oomguard.memory.estimate", "estimate"),
    "analyze_paths": ("oomguard.oom.analyze", "analyze_paths"),
}

__all__ = [
    "Diagnosis",
    "Knobs",
    "OOMGuardExhausted",
    "OOMReport",
    "__version__",
    "analyze_paths",
    "diagnose",
    "estimate",
    "guard",
    "is_oom",
    "parse_oom",
]

if TYPE_CHECKING:  # pragma: no cover
    from .inprocess.guarded import OOMGuardExhausted, guard
    from .memory.estimate import estimate
    from .oom.analyze import analyze_paths
    from .oom.diagnose import diagnose
    from .oom.parse import is_oom, parse_oom
    from .vocab.diagnosis import Diagnosis
    from .vocab.knobs import Knobs
    from .vocab.oomreport import OOMReport


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'oomguard' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
