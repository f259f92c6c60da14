"""The trace event schema (kvledger.trace.EVENTS) against its emitters and its two normalizers.

(a) The real ledgers (SchedulerLedger on vLLM's real BlockPool, WorkerLedger, LoadLedger) driven through
    every event they log, into a ListTrace that validates each event as it is emitted: every event
    conforms, and every ledger event of the schema was seen.
(b) conformance.kvtrace (logs of the conformance driver) and conformance.runlog (logs of real runs) each
    map every action of the schema they are meant for, refuse the rest by name, and test no action name
    the schema lacks.
The connector's own Preempt/Finish notices are validated in every integration test's log
(tests/integration/conftest.py).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from kvledger import ListTrace, LoadLedger, SchedulerLedger, Verdict, WorkerLedger
from kvledger import trace as T
from tests.unit.conftest import alloc

LEDGER_SOURCES = {"scheduler", "worker", "load"}


def _run_ledgers(pool) -> list[dict[str, Any]]:
    """One scheduler and one rank through every event the ledgers log (shared sink, log order)."""
    tr = ListTrace(check=True)
    s = SchedulerLedger(pool, world_size=1, max_inflight_jobs=8, max_pinned_blocks=64, trace=tr)
    w = WorkerLedger(0, max_live_jobs=8, trace=tr)
    ld = LoadLedger(0, max_inflight_loads=4, trace=tr)
    table, cow = alloc(pool, 3), alloc(pool, 1)

    j0 = s.open_job("a", table[:2], tail_block_ids=cow, generation=0)        # EmitStore
    w.register("a", j0, generation=0)                                         # Receive
    assert w.begin(j0) is Verdict.RUN                                         # DmaRead running
    w.record_saved(j0, 32)                                                    # Put stored
    w.finish(j0)                                                              # Report
    j1 = s.open_job("a", table, generation=0)
    w.register("a", j1, generation=0)
    w.begin(j1)
    w.record_failed(j1, pressure=True)                                        # Put failed (pressure)
    w.finish(j1)
    j2 = s.open_job("a", table, generation=0)
    w.register("a", j2, generation=0)
    w.record_failed(j2)                                                       # DmaRead failed
    w.finish(j2)
    s.collect(w.take_completed())                                             # Collect
    w.drop_generation("a", finished=False, generation=0)                      # DropGeneration closed
    w.drop_generation("nobody", finished=True, generation=3)                  # DropGeneration none
    j3 = s.open_job("b", table[:1], generation=1)
    w.register("b", j3, generation=1)
    w.drop_generation("b", finished=True, generation=1)                       # DropGeneration closing
    assert w.begin(j3) is Verdict.RUN   # a finished request's job still saves: its blocks are pinned
    w.record_saved(j3, 16)
    w.finish(j3)
    s.collect(w.take_completed())
    dest = alloc(pool, 2)
    s.pin_load("c", dest)                                                     # EmitLoad
    lid = ld.begin_load("c", dest)
    ld.record_results(lid, dest, [4096, -704], 4096)
    ld.finish_load(lid)                                                       # Load
    ld.take_errors()                                                          # HandleLoadErrors (rank)
    s.collect_loads({"c": 1})                                                 # CollectLoad
    return tr.events


@pytest.fixture
def ledger_events(pool) -> list[dict[str, Any]]:
    return _run_ledgers(pool)


def test_every_ledger_event_conforms_and_every_ledger_event_is_emitted(ledger_events):
    seen = {(T.actor_kind(e["actor"]), e["action"]) for e in ledger_events}
    specs = {T.check_event(e) for e in ledger_events}   # ListTrace(check=True) checked them already
    assert all(s.sources & LEDGER_SOURCES for s in specs), "a ledger logged an event the schema gives others"
    want = {k for k, s in T.EVENTS.items() if s.sources & LEDGER_SOURCES}
    assert seen == want, f"ledger events of the schema never emitted: {sorted(want - seen)}"
    drops = {e["dest"] for e in ledger_events if e["action"] == "DropGeneration"}
    assert drops == {"closed", "closing", "none"}


def test_check_event_names_what_is_wrong(ledger_events):
    ev = next(e for e in ledger_events if e["action"] == "Put")
    with pytest.raises(T.TraceSchemaError, match="offset.*required in Put"):
        T.check_event({k: v for k, v in ev.items() if k != "offset"})
    with pytest.raises(T.TraceSchemaError, match="colour.*not a field of Put"):
        T.check_event({**ev, "colour": "red"})
    with pytest.raises(T.TraceSchemaError, match="Frobnicate.*not an event of actor 'w0'"):
        T.check_event({**ev, "action": "Frobnicate"})
    with pytest.raises(T.TraceSchemaError, match="EmitStore.*not an event of actor 'w0'"):
        T.check_event({**ev, "action": "EmitStore"})   # a scheduler event logged by a rank
    with pytest.raises(T.TraceSchemaError, match="actor='x1'"):
        T.check_event({**ev, "actor": "x1"})
    with pytest.raises(T.TraceSchemaError, match="seq"):
        T.check_event({k: v for k, v in ev.items() if k != "seq"})


def test_checking_sink_raises_at_the_emit_and_plain_sink_does_not():
    with pytest.raises(T.TraceSchemaError, match="Frobnicate"):
        ListTrace(check=True).emit("sched", "Frobnicate", {})
    plain = ListTrace()
    plain.emit("sched", "Frobnicate", {})   # the hot path does not validate
    assert plain.actions() == ["Frobnicate"]


def test_emit_store_tail_is_optional_in_the_schema():
    spec = T.EVENTS[(T.SCHED, "EmitStore")]
    assert "tail" in spec.optional and "tail" not in spec.required


def test_docstring_table_lists_the_runtime_actions():
    """The module doc's table is for readers; it must name the same runtime actions as EVENTS."""
    doc = T.__doc__ or ""
    table = doc.split("=============== ======== ")[2]   # the rows between the 2nd and 3rd rule
    rows = {ln.split()[0] for ln in table.splitlines() if ln[:1].isalpha()}
    assert rows == {s.action for s in T.EVENTS.values() if s.runtime}


# ----------------------------------------------------------------------------------------------- (b)
def _driver_events() -> list[dict[str, Any]]:
    """Examples of the events only the conformance driver logs (fields as kvdriver writes them)."""
    ex = [("sched", "Admit", {"req_id": "a", "generation": 0}),
          ("sched", "Compute", {"req_id": "a", "chunk": 0, "block": 1}),
          ("sched", "Lookup", {"req_id": "a", "hits": 1}),
          ("sched", "HandleLoadErrors", {"req_id": "a", "bad": [1], "keep": 0}),
          ("sched", "ReleaseHeld", {"req_id": "a", "generation": 0}),
          ("store", "Evict", {"key": ["a", 0]}),
          ("store", "StoreFail", {}),
          ("store", "StoreRestart", {})]
    return [{"seq": 1000 + i, "actor": a, "action": n, **f} for i, (a, n, f) in enumerate(ex)]


def _connector_events() -> list[dict[str, Any]]:
    """The connector's notices, with the fields its scheduler side writes (checked against real logs
    in tests/integration/conftest.py)."""
    return [{"seq": 2000, "actor": "sched", "action": "Preempt", "req_id": "a", "generation": 0},
            {"seq": 2001, "actor": "sched", "action": "Finish", "req_id": "a", "generation": 0}]


def _all_examples(ledger_events) -> list[dict[str, Any]]:
    # the notices go after the ledgers' events (the normalizers need the EmitStore that names the ranks)
    evs = [*ledger_events, *_connector_events(), *_driver_events()]
    for e in evs:
        T.check_event(e)
    assert {(T.actor_kind(e["actor"]), e["action"]) for e in evs} == set(T.EVENTS), "an example is missing"
    return evs


def _kvtrace_normalizer():
    from conformance import kvtrace
    return kvtrace.Normalizer({"Ranks": ["w1", "w2"], "Req": ["r1", "r2", "r3", "r4", "r5"]})


def _runlog_normalizer():
    from conformance import runlog
    return runlog.RunLogNormalizer()


def test_kvtrace_maps_every_event_of_the_schema(ledger_events):
    from conformance.engine import tracecheck as tc
    norm = _kvtrace_normalizer()
    for ev in _all_examples(ledger_events):
        out = norm(ev)
        if out is None:   # a rank's take_errors (checked in its Load event); a release (its Finish event)
            assert (ev["actor"], ev["action"]) in {("w0", "HandleLoadErrors"), ("sched", "ReleaseHeld")}
        else:
            assert out["action"] == ev["action"]
    with pytest.raises(tc.UnknownActionError, match="Frobnicate"):
        norm({"seq": 1, "actor": "sched", "action": "Frobnicate"})


def test_runlog_maps_every_runtime_event_and_refuses_the_drivers_by_name(ledger_events):
    from conformance.engine import tracecheck as tc
    norm = _runlog_normalizer()
    for ev in _all_examples(ledger_events):
        spec = T.check_event(ev)
        if spec.runtime:
            assert norm(ev)["action"] == ev["action"]
        else:
            with pytest.raises(tc.TraceCheckError, match="conformance driver") as e:
                norm(ev)
            assert not isinstance(e.value, tc.UnknownActionError)
    with pytest.raises(tc.UnknownActionError, match="Frobnicate"):
        norm({"seq": 1, "actor": "w0", "action": "Frobnicate"})


def _names_tested(fn) -> set[str]:
    """The action names a normalizer's `_map` compares its action `a` with (a == "X", a in (...))."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "a":
            for comp in node.comparators:
                for c in ast.walk(comp):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        names.add(c.value)
                    elif isinstance(c, ast.Name) and c.id.startswith("_"):   # a module-level set of names
                        names |= set(getattr(inspect.getmodule(fn), c.id))
    return names


def test_normalizers_test_no_name_outside_the_schema():
    from conformance import kvtrace, runlog
    for fn in (kvtrace.Normalizer._map, runlog.RunLogNormalizer._map):
        names = _names_tested(fn)
        assert names <= T.ACTIONS, f"{fn.__qualname__} handles {sorted(names - T.ACTIONS)}, not in the schema"
        assert names == T.ACTIONS, f"{fn.__qualname__} never names {sorted(T.ACTIONS - names)}"


def test_validate_events_refuses_driver_events_in_a_real_runs_log(ledger_events):
    assert T.validate_events(ledger_events, runtime=True) == len(ledger_events)
    drv = _driver_events()
    assert T.validate_events(drv) == len(drv)
    with pytest.raises(T.TraceSchemaError, match="Admit.*only by the conformance driver"):
        T.validate_events([*ledger_events, *drv], runtime=True)
