"""A per-request trace of ours' load path, for bench.real: where the time between a request's arrival and
its first token goes. Instrumentation only, installed in the engine's own process by testbed/engine_run.py's
`preload` ("bench.loadtrace:install"): it wraps shipped methods to note the time and calls them unchanged;
no decision is made here. Each event is appended to the file named by $KVLEDGER_LOADTRACE as one JSON line
{"req": req_id, "ev": event, "t": time.monotonic()} (the engine_run timeline's clock):

  lookup       vLLM asks the connector how many tokens the store has (the first time, per request)
  allocated    vLLM allocated its blocks for the load (`SchedulerSide.update_state_after_alloc`)
  in_meta      its load went into a step's metadata (`SchedulerSide.build_connector_meta`)
  issued       the worker side queues the request's load for a load thread (`WorkerSide._enqueue_load`)
  load_start   a load thread takes it (`WorkerSide._handle_load`)
  bytes_in     a batch get of the load returned (the last one counts)
  tag_checked  its blocks' integrity tags were checked (`BlockSeal.verify`; the last one counts)
  load_done    the load thread finished it (every block loaded or reported failed)
  reported     vLLM took it as finished_recving (`WorkerSide.take_report`)

In-process EngineCore only (TP 1, mp=0): the scheduler, the worker and the driver share one process.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EVENTS = ("lookup", "allocated", "in_meta", "issued", "load_start", "bytes_in", "tag_checked", "load_done", "reported")
ENV = "KVLEDGER_LOADTRACE"

_local = threading.local()  # the load a load thread is running (its req_id)


class _Sink:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._looked_up: set[str] = set()

    def note(self, req: str | None, ev: str) -> None:
        if req is None:
            return
        t = time.monotonic()
        if ev == "lookup":
            if req in self._looked_up:
                return
            self._looked_up.add(req)
        with self._lock:
            self._f.write(json.dumps({"req": req, "ev": ev, "t": t}) + "\n")


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    setattr(cls, name, make(getattr(cls, name)))


def install() -> dict[str, Any]:
    """Wraps the load path's methods when $KVLEDGER_LOADTRACE names a file; otherwise does nothing."""
    path = os.environ.get(ENV)
    if not path:
        return {"loadtrace": None}
    sink = _Sink(path)
    from kvledger_connector.scheduler.side import SchedulerSide
    from kvledger_connector.shape.integrity import BlockSeal
    from kvledger_connector.store.io import StoreIO
    from kvledger_connector.worker.side import WorkerSide

    def lookup(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, request: Any, num_computed_tokens: int) -> Any:
            sink.note(request.request_id, "lookup")
            return f(self, request, num_computed_tokens)
        return wrapped

    def alloc(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens:
                sink.note(request.request_id, "allocated")
            return f(self, request, blocks, num_external_tokens)
        return wrapped

    def meta(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, scheduler_output: Any) -> Any:
            m = f(self, scheduler_output)
            for spec in m.loads:
                sink.note(spec.req_id, "in_meta")
            return m
        return wrapped

    def enqueue(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, spec: Any) -> Any:
            sink.note(spec.req_id, "issued")
            return f(self, spec)
        return wrapped

    def handle(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, spec: Any) -> Any:
            _local.req = spec.req_id
            sink.note(spec.req_id, "load_start")
            try:
                return f(self, spec)
            finally:
                sink.note(spec.req_id, "load_done")
                _local.req = None
        return wrapped

    def call(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, c: Any) -> Any:
            res = f(self, c)
            if c.op == "batch_get":
                sink.note(getattr(_local, "req", None), "bytes_in")
            return res
        return wrapped

    def verify(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            res = f(self, *a, **kw)
            sink.note(getattr(_local, "req", None), "tag_checked")
            return res
        return wrapped

    def report(f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any) -> Any:
            rep = f(self)
            for req in rep.finished_recving:
                sink.note(req, "reported")
            return rep
        return wrapped

    _wrap(SchedulerSide, "get_num_new_matched_tokens", lookup)
    _wrap(SchedulerSide, "update_state_after_alloc", alloc)
    _wrap(SchedulerSide, "build_connector_meta", meta)
    _wrap(WorkerSide, "_enqueue_load", enqueue)
    _wrap(WorkerSide, "_handle_load", handle)
    _wrap(StoreIO, "__call__", call)
    _wrap(BlockSeal, "verify", verify)
    _wrap(WorkerSide, "take_report", report)
    return {"loadtrace": path}


def read(path: Path) -> dict[str, dict[str, float]]:
    """{req_id: {event: time}}: each request's first lookup, first report, and the last of the others."""
    out: dict[str, dict[str, float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        e = json.loads(line)
        evs = out.setdefault(e["req"], {})
        if e["ev"] in ("lookup", "allocated", "in_meta", "reported", "issued", "load_start") and e["ev"] in evs:
            continue
        evs[e["ev"]] = float(e["t"])
    return out


def stages(trace: dict[str, float], arrival: float, first_token: float) -> dict[str, float] | None:
    """One request's stage durations (seconds), arrival -> lookup -> allocated -> in_meta -> issued ->
    load_start -> bytes_in -> tag_checked (bytes_in, where no tag is checked) -> load_done -> reported ->
    first token; None when it has no load."""
    if not all(k in trace for k in ("lookup", "issued", "load_start", "bytes_in", "load_done", "reported")):
        return None
    order: Sequence[tuple[str, float]] = (
        ("arrival", arrival), ("lookup", trace["lookup"]),
        ("allocated", trace.get("allocated", trace["lookup"])), ("in_meta", trace.get("in_meta", trace["issued"])),
        ("issued", trace["issued"]),
        ("load_start", trace["load_start"]), ("bytes_in", trace["bytes_in"]),
        ("tag_checked", trace.get("tag_checked", trace["bytes_in"])), ("load_done", trace["load_done"]),
        ("reported", trace["reported"]), ("first_token", first_token))
    return {f"{a}->{b}": tb - ta for (a, ta), (b, tb) in zip(order, order[1:])}
