"""The schema names of oomguard's records and the check every reader makes, in a module of their own.

Every Python process of a run reads its plan through this check at start-up (launchers and helper processes too), so
it must not pay for loading every record type (:mod:`oomguard.vocab.records` re-exports these names).

>>> check_schema({"schema": "oomguard.plan/1"}, PLAN_SCHEMA, "plan.json")
>>> check_schema({"schema": "oomguard.plan/2"}, PLAN_SCHEMA, "plan.json")
Traceback (most recent call last):
...
oomguard.vocab.schema.RecordError: plan.json: oomguard.plan schema version 2 is not supported (this oomguard reads 1)
"""

from __future__ import annotations

from typing import Any

CRASH_SCHEMA = "oomguard.crash/1"
REPORT_SCHEMA = "oomguard.report/1"
LOCK_SCHEMA = "oomguard.lock/1"
PLAN_SCHEMA = "oomguard.plan/1"


class RecordError(ValueError):
    """A file that is not the record it should be; the message names the file and the reason."""


def check_schema(data: Any, expected: str, source: str) -> None:
    """Raise RecordError unless ``data`` is a record of ``expected``'s kind and major version."""
    if not isinstance(data, dict):
        raise RecordError(f"{source}: not an oomguard record (expected a JSON object)")
    schema = str(data.get("schema", ""))
    kind, _, major = expected.partition("/")
    got_kind, _, got_major = schema.partition("/")
    if got_kind != kind:
        raise RecordError(f"{source}: not an {kind} record (schema {schema or 'missing'})")
    if got_major.split(".")[0] != major:
        raise RecordError(f"{source}: {kind} schema version {got_major} is not supported (this oomguard reads {major})")
