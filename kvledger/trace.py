"""Trace events: one NDJSON line per action of the shared vocabulary (the action names of
tla/KVLedger.tla's lastAction and spec/machines.json's triggers).

Off by default and free when off: every ledger holds ``trace: TraceSink | None`` and guards each emit with
``if self._trace is not None`` (one attribute test on the hot path; the event dict is never built).

Event schema (every line is one JSON object; keys in this order)::

    {"seq": 17, "actor": "sched" | "w<rank>", "action": "<Action>", ...parameters and abstract state...}

``seq`` increases by one per event of one sink (a sink shared by several ledgers orders their events; the
connector holds its lock around ledger calls, so the order is the order of the state changes). The
connectors of one process share one locked, line-flushed sink per ``trace_path`` (kvledger_connector.tracefile);
conformance.runlog checks such a log with TLC, conformance.kvtrace a log of the conformance driver.

=============== ======== =============================================================================
action          actor    fields
=============== ======== =============================================================================
EmitStore       sched    job, req_id, generation (the request's, null when not given), blocks (pinned
                         ids, in order), ranks_left (= world size), pinned_jobs, pinned_blocks (block
                         pins after the emit)
Preempt         sched    req_id, generation (the one dropped; null if unknown): the connector's
                         scheduler side tells every rank (each logs a DropGeneration)
Finish          sched    req_id, generation (null when no save was ever planned): likewise
Collect         sched    completed {job: count} (as given, job ids as strings: JSON keys),
                         released [jobs freed now, tail first], ranks_left {job: left} (jobs still pinned
                         among those reported), unknown [ids ignored], pinned_jobs, pinned_blocks
Receive         w<r>     job, req_id, generation, live [live job ids of that generation after register],
                         stale_on_arrival (bool: an older generation's job), superseded [job ids made
                         stale because this job's newer generation replaced the open one: an
                         unannounced preemption, folded into this Receive as in the model]
DmaRead         w<r>     job, req_id, generation, dest ("running"|"stale"|"skipped"|"failed"),
                         offset (saved offset of the job's generation)
Put             w<r>     job, req_id, generation, dest ("stored"|"failed"), num_tokens, pressure (bool),
                         live (bool: did the result touch the generation), offset (after)
Report          w<r>     job, req_id, generation, from (job state before the report), live [after],
                         closed (bool: the report closed a closing generation)
DropGeneration  w<r>     req_id, generation (of the state dropped), notice_generation, finished (bool),
                         dest ("closed"|"closing"), live [jobs still live], stale [jobs now stale];
                         a notice with nothing to drop (no open generation, or a late notice of an older
                         one) is logged too: dest "none", generation null
EmitLoad        sched    req_id, blocks (destination ids, pinned for the load), ranks_left (= world
                         size), pinned_loads, load_pinned_blocks (after the pin)
CollectLoad     sched    completed {req_id: ranks} (finished_recving: vLLM reports a load once every
                         rank finished it), released [req_ids whose load pins were freed now, tail
                         first], ranks_left {req_id: left}, unknown [req_ids with no pinned load],
                         pinned_loads, load_pinned_blocks
Load            w<r>     load, req_id, attempted [block ids], loaded [..], failed [..] (emitted when the
                         load is finished: per-key results are folded into one event)
HandleLoadErrors w<r>    blocks [block ids handed out by take_errors]
=============== ======== =============================================================================

Generations are the scheduler's (admissions of the request, as ``gen[r]`` in the model) when the connector
passes them to ``register`` / ``drop_generation``; otherwise the rank numbers them itself, monotonic over
all its requests, and the checker must treat them as opaque ids that differ between generations.
"""
from __future__ import annotations

import json
from typing import IO, Any, Protocol


class TraceSink(Protocol):
    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None: ...


class ListTrace:
    """Keeps events in memory (tests, the conformance driver). Bounded: ``max_events`` (oldest dropped,
    counted in ``dropped``)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self.events: list[dict[str, Any]] = []
        self.max_events = max_events
        self.dropped = 0
        self._seq = 0

    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None:
        ev = {"seq": self._seq, "actor": actor, "action": action, **fields}
        self._seq += 1
        if len(self.events) >= self.max_events:
            # drop the oldest half at once: amortized O(1)
            cut = self.max_events // 2 or 1
            del self.events[:cut]
            self.dropped += cut
        self.events.append(ev)

    def actions(self) -> list[str]:
        return [e["action"] for e in self.events]


class NdjsonTrace:
    """Writes one JSON line per event to a text stream (the caller owns and closes the stream)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._seq = 0

    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None:
        ev = {"seq": self._seq, "actor": actor, "action": action, **fields}
        self._seq += 1
        self._stream.write(json.dumps(ev, separators=(",", ":"), default=_jsonable) + "\n")

    def flush(self) -> None:
        self._stream.flush()


def _jsonable(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return sorted(o) if isinstance(o, (set, frozenset)) else list(o)
    raise TypeError(f"not JSON-serialisable in a trace event: {type(o).__name__}")
