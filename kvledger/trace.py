"""Trace events: one NDJSON line per action of the shared vocabulary (the action names of
tla/KVLedger.tla's lastAction and spec/machines.json's triggers).

Off by default and free when off: every ledger holds ``trace: TraceSink | None`` and guards each emit with
``if self._trace is not None`` (one attribute test on the hot path; the event dict is never built).

Event schema (every line is one JSON object; keys in this order; the schema as data is ``EVENTS`` below,
and ``check_event`` validates one event against it)::

    {"seq": 17, "actor": "sched" | "w<rank>", "action": "<Action>", ...parameters and abstract state...}

``seq`` increases by one per event of one sink (a sink shared by several ledgers orders their events; the
connector holds its lock around ledger calls, so the order is the order of the state changes). The
connectors of one process share one locked, line-flushed sink per ``trace_path`` (kvledger_connector.telemetry.tracefile);
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
                         offset (saved offset of the job's generation); a failed read also has
                         num_tokens (0), pressure, live as a failed Put
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

``EmitStore`` may carry ``tail`` (the copy-on-write tail block ids pinned with the job). The conformance
driver (conformance/kvdriver.py) also logs the model steps the runtime does not: Admit, Compute, Lookup,
HandleLoadErrors from ``sched`` (the scheduler's recovery: req_id, bad chunks, keep), and Evict, StoreFail,
StoreRestart from ``store``; their ``sources`` in ``EVENTS`` are ``{"driver"}``.

Generations are the scheduler's (admissions of the request, as ``gen[r]`` in the model) when the connector
passes them to ``register`` / ``drop_generation``; otherwise the rank numbers them itself, monotonic over
all its requests, and the checker must treat them as opaque ids that differ between generations.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import IO, Any, Iterable, Mapping, Protocol

from .errors import LedgerInputError


SCHED, RANK, STORE = "sched", "rank", "store"  # actor kinds: "sched", "w<rank>", "store"
_HEADER = ("seq", "actor", "action")


class TraceSchemaError(LedgerInputError):
    """An event that is not in the schema (``EVENTS``): an unknown action for its actor, a missing field,
    or a field the schema does not have."""


@dataclass(frozen=True)
class EventSpec:
    """One event of the schema: the ``action`` an ``actor`` kind logs, who emits it (``sources``: the
    ledgers "scheduler", "worker", "load"; "connector", the connector's scheduler side; "driver", the
    conformance driver), and its fields besides seq/actor/action."""

    action: str
    actor: str  # SCHED, RANK or STORE
    sources: frozenset[str]
    required: frozenset[str]
    optional: frozenset[str] = frozenset()

    @property
    def runtime(self) -> bool:
        """Logged by a real run (not only by the conformance driver)."""
        return bool(self.sources - {"driver"})


def _spec(action: str, actor: str, sources: str, required: str, optional: str = "") -> EventSpec:
    return EventSpec(action, actor, frozenset(sources.split()), frozenset(required.split()),
                     frozenset(optional.split()))


_JOB = "job req_id generation"
_SPECS = (
    _spec("EmitStore", SCHED, "scheduler", "job req_id generation blocks ranks_left pinned_jobs pinned_blocks",
          "tail"),
    _spec("Collect", SCHED, "scheduler", "completed released ranks_left unknown pinned_jobs pinned_blocks"),
    _spec("EmitLoad", SCHED, "scheduler", "req_id blocks ranks_left pinned_loads load_pinned_blocks"),
    _spec("CollectLoad", SCHED, "scheduler",
          "completed released ranks_left unknown pinned_loads load_pinned_blocks"),
    _spec("Preempt", SCHED, "connector driver", "req_id generation"),
    _spec("Finish", SCHED, "connector driver", "req_id generation"),
    # a held request released (its notice is the connector's Finish event of the same step)
    _spec("ReleaseHeld", SCHED, "driver", "req_id generation"),
    _spec("Receive", RANK, "worker", _JOB + " live stale_on_arrival superseded"),
    # a read that failed (record_failed from queued) logs the failure's fields, as a failed Put does
    _spec("DmaRead", RANK, "worker", _JOB + " dest offset", "num_tokens pressure live"),
    _spec("Put", RANK, "worker", _JOB + " dest num_tokens pressure live offset"),
    _spec("Report", RANK, "worker", _JOB + " from live closed"),
    _spec("DropGeneration", RANK, "worker", "req_id generation notice_generation finished dest live stale"),
    _spec("Load", RANK, "load", "load req_id attempted loaded failed"),
    _spec("HandleLoadErrors", RANK, "load", "blocks"),
    # model steps only the conformance driver logs
    _spec("Admit", SCHED, "driver", "req_id generation"),
    _spec("Compute", SCHED, "driver", "req_id chunk block"),
    _spec("Lookup", SCHED, "driver", "req_id hits"),
    _spec("HandleLoadErrors", SCHED, "driver", "req_id bad keep"),
    _spec("Evict", STORE, "driver", "key"),
    _spec("StoreFail", STORE, "driver", ""),
    _spec("StoreRestart", STORE, "driver", ""),
)

#: The schema: every event, by (actor kind, action). HandleLoadErrors is the one action two actor kinds
#: log, with different fields (a rank's take_errors; the driver's scheduler-side recovery step).
EVENTS: Mapping[tuple[str, str], EventSpec] = MappingProxyType({(e.actor, e.action): e for e in _SPECS})
#: Every action name of the schema.
ACTIONS: frozenset[str] = frozenset(e.action for e in _SPECS)


def actor_kind(actor: Any) -> str:
    """SCHED, RANK (``w<rank>``) or STORE; anything else is a TraceSchemaError."""
    if actor in (SCHED, STORE):
        return actor
    if isinstance(actor, str) and actor[:1] == "w" and actor[1:].isdigit():
        return RANK
    raise TraceSchemaError("actor", actor, 'not an actor of the trace ("sched", "w<rank>", "store")')


def check_event(ev: Mapping[str, Any]) -> EventSpec:
    """The spec `ev` conforms to; a TraceSchemaError naming the first field (or the action) that does not.
    A test and debug helper: the ledgers do not call it on their hot path (see ``ListTrace(check=True)``)."""
    for key in _HEADER:
        if key not in ev:
            raise TraceSchemaError(key, None, f"missing from the event {dict(ev)!r}")
    spec = EVENTS.get((actor_kind(ev["actor"]), ev["action"]))
    if spec is None:
        raise TraceSchemaError("action", ev["action"], f"not an event of actor {ev['actor']!r} in the schema")
    missing = sorted(spec.required - ev.keys())
    if missing:
        raise TraceSchemaError(missing[0], None, f"required in {spec.action} (seq {ev['seq']}), missing")
    extra = sorted(ev.keys() - spec.required - spec.optional - set(_HEADER))
    if extra:
        raise TraceSchemaError(extra[0], ev[extra[0]], f"not a field of {spec.action} (seq {ev['seq']})")
    return spec


def validate_events(events: Iterable[Mapping[str, Any]], *, runtime: bool = False) -> int:
    """``check_event`` on each event; ``runtime``: a real run's log, so no event only the conformance
    driver logs. Returns the number of events; raises TraceSchemaError at the first that does not conform."""
    n = 0
    for ev in events:
        spec = check_event(ev)
        if runtime and not spec.runtime:
            raise TraceSchemaError("action", ev["action"], f"logged only by the conformance driver, "
                                                           f"not by a real run (seq {ev['seq']})")
        n += 1
    return n


class TraceSink(Protocol):
    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None: ...


class ListTrace:
    """Keeps events in memory (tests, the conformance driver). Bounded: ``max_events`` (oldest dropped,
    counted in ``dropped``). ``check=True`` (tests) validates each event against the schema as it is
    emitted: an event outside it raises TraceSchemaError at the emit that made it."""

    def __init__(self, max_events: int = 100_000, *, check: bool = False) -> None:
        self.events: list[dict[str, Any]] = []
        self.max_events = max_events
        self.dropped = 0
        self.check = check
        self._seq = 0

    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None:
        ev = {"seq": self._seq, "actor": actor, "action": action, **fields}
        if self.check:
            check_event(ev)
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
