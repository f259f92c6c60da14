"""Errors of the ledger core.

Safety checks raise, they never ``assert`` (``python -O`` would strip an assert and bring the bug back).
Every invariant error carries the id and name of spec/README.md (``S5``, ``ReportedOnce``), so a log line, a
test and a TLC counterexample name the same rule.
"""
from __future__ import annotations

from typing import Any

#: The safety invariants of spec/README.md, by id. Lifecycle errors (a trigger that the machines of
#: ``spec/machines.json`` do not allow from the current state) use the machine name as the id.
INVARIANTS: dict[str, str] = {
    "S1": "NoPollution",
    "S2": "DmaReadsPinned",
    "S3": "RefCountExact",
    "S4": "NoStaleEffect",
    "S5": "ReportedOnce",
    "S6": "BoundedPins",
    "S7": "NoGarbageCompute",
    "S8": "LoadErrorsReported",
    "S9": "LoadsPinned",
}


class LedgerError(Exception):
    """Base class of every error raised by kvledger."""


class LedgerInvariantError(LedgerError):
    """A safety invariant (or a lifecycle transition) would break. The ledger did not apply the change
    that would have broken it."""

    def __init__(self, invariant_id: str, name: str, detail: str) -> None:
        self.invariant_id = invariant_id
        self.name = name
        self.detail = detail
        super().__init__(f"{invariant_id} {name}: {detail}")

    @classmethod
    def of(cls, invariant_id: str, detail: str) -> "LedgerInvariantError":
        """Build the error for one of the S1..S9 invariants by id."""
        return cls(invariant_id, INVARIANTS[invariant_id], detail)


class LedgerInputError(LedgerError, ValueError):
    """Bad input from the caller (config, unknown id, malformed report, a KV cache that cannot be served).
    Names the field and the value; the ledger state is unchanged by the rejected item. ``message``: the
    text of a subclass that words it its own way (default ``field=value: reason``)."""

    def __init__(self, field: str, value: Any, reason: str, message: str | None = None) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}" if message is None else message)


def check_positive_int(field: str, value: Any, *, allow_zero: bool = False) -> int:
    """Validate a configuration integer (bool is rejected: ``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LedgerInputError(field, value, "must be an int")
    if value < 0 or (value == 0 and not allow_zero):
        raise LedgerInputError(field, value, "must be >= 0" if allow_zero else "must be > 0")
    return value
