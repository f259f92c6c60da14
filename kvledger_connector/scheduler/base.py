"""What every part of the scheduler side's steps reads: the state `SchedulerSteps.__init__` sets
(kvledger_connector/scheduler/steps.py), declared once here with its types, and the two checks every part
makes (the ledger is bound; a request's tables are one per KV cache group).

The steps are one object split by subject: `LookupSteps` (lookup.py), `SaveSteps` (saves.py), `CollectSteps`
(collect.py) and `SchedulerSteps` itself (EmitLoad, finish and held requests, queries), each over this state.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink
from kvledger_connector.scheduler.held import HeldRequests
from kvledger_connector.scheduler.requests import _RequestTable
from kvledger_connector.shape.group_kind import GroupKinds
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.telemetry.stats import StatsRecorder


class StepsBase:
    """The scheduler side's state, as `SchedulerSteps.__init__` sets it (see there for each field)."""

    block_size: int
    world_size: int
    num_groups: int
    sync_load_max_tokens: int
    kv_load_failure_policy: str
    key_builders: list[KeyBuilder]
    kinds: GroupKinds
    state_groups: frozenset[int]
    sliding_groups: frozenset[int]
    reachable_blocks: Callable[[Any, int, int, int], Sequence[bool] | None] | None
    block_hash_of: Callable[[int], object | None] | None
    max_pinned_blocks: int
    save_enabled: bool
    load_enabled: bool
    save_decode: bool
    save_partial_tail: bool
    stats: StatsRecorder
    trace: TraceSink | None
    events: Any
    errors: deque[str]
    ledger: SchedulerLedger | None
    held: HeldRequests
    _reqs: _RequestTable
    _load_outcomes: deque[bool]
    _failed_loads: set[str]

    def _ledger(self) -> SchedulerLedger:
        if self.ledger is None:
            raise LedgerInputError("block_pool", None, "bind_gpu_block_pool was not called")
        return self.ledger

    def _tables(self, tables: Any) -> list[Sequence[int]]:
        """The request's block tables, one per KV cache group (vLLM's ``KVCacheBlocks.get_block_ids()``)."""
        if not isinstance(tables, (list, tuple)) or len(tables) != self.num_groups:
            got = len(tables) if isinstance(tables, (list, tuple)) else type(tables).__name__
            raise LedgerInputError("block_ids", got, f"one table per KV cache group ({self.num_groups})")
        return list(tables)
