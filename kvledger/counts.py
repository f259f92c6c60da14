"""What a part that counts events needs of the one counter sink: ``add(name, value)`` and ``total(name)``.

The connector's sink is ``kvledger_connector.telemetry.stats.StatsRecorder`` (the interval vLLM takes, Prometheus, the
run's totals; thread-safe); it satisfies :class:`Counter`. A part built without one (a ledger in a unit
test, a store opened by a bench) counts into its own :class:`Counts`, read the same way:
``part.counts.total(name)``. The ledgers take a ``Counter`` rather than import the connector's: this package
is the bottom floor.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Counter(Protocol):
    def add(self, name: str, value: float = 1) -> None: ...

    def total(self, name: str) -> float: ...


class Counts:
    """Whole-run totals by name: the sink of a part that was given none. No lock (this package starts no
    threads): each name is added from one thread at a time, as its part does (a ledger under its owner's
    lock; a connector part adds a name from one thread, or under its own lock)."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        self._totals[name] = self._totals.get(name, 0) + value

    def total(self, name: str) -> float:
        """The total of ``name``; 0 if never added."""
        return self._totals.get(name, 0)
