"""The core stays pure: no assert guards, no threads / I/O / vLLM imports in kvledger/."""
from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import kvledger
from kvledger import ListTrace, NdjsonTrace, SchedulerLedger, WorkerLedger

PKG = Path(kvledger.__file__).parent
FORBIDDEN = {"vllm", "torch", "threading", "socket", "subprocess", "asyncio", "mooncake", "multiprocessing"}


def _modules():
    for p in sorted(PKG.glob("*.py")):
        yield p, ast.parse(p.read_text(), filename=str(p))


def test_no_assert_in_core():
    found = [f"{p.name}:{n.lineno}" for p, tree in _modules() for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert found == []


def test_no_io_thread_or_vllm_imports_in_core():
    bad = []
    for p, tree in _modules():
        for n in ast.walk(tree):
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names = [n.module]
            bad += [f"{p.name}:{n.lineno} {m}" for m in names if m.split(".")[0] in FORBIDDEN]
    assert bad == []


def test_ndjson_trace_writes_one_json_object_per_line():
    from tests.unit.conftest import alloc, make_pool
    pool = make_pool(16)
    buf = io.StringIO()
    tr = NdjsonTrace(buf)
    s = SchedulerLedger(pool, world_size=1, max_inflight_jobs=2, max_pinned_blocks=8, trace=tr)
    w = WorkerLedger(0, max_live_jobs=2, trace=tr)
    j = s.open_job("r", alloc(pool, 2))
    w.register("r", j)
    w.begin(j)
    w.record_saved(j, 32)
    w.finish(j)
    s.collect(w.take_completed())
    events = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [e["action"] for e in events] == ["EmitStore", "Receive", "DmaRead", "Put", "Report", "Collect"]
    assert [e["seq"] for e in events] == list(range(6))
    assert events[-1]["released"] == [j]


def test_list_trace_is_bounded():
    tr = ListTrace(max_events=10)
    for i in range(25):
        tr.emit("sched", "Collect", {"i": i})
    assert len(tr.events) <= 10 and tr.dropped == 15 + (len(tr.events) - 10)
    assert tr.events[-1]["i"] == 24 and tr.events[-1]["seq"] == 24
