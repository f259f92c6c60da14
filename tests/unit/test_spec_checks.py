"""Every spec a rank receives is checked whole before anything of it runs (kvledger_connector/metadata.py's
checks, applied by `WorkerSteps.admit_load` / `receive_save` / `receive_drop`): each malformed case through
the real `WorkerSide` steps vLLM calls (start_load_kv -> start_step, wait_for_save -> end_step), never
raising into the model runner, its load finished with every real block reported failed, its save reported
with nothing written, and no good object removed. An object that fails its integrity tag in a sync load is
removed by the store thread, never the model runner's. The store is `_MemStore`, a test double that copies
real bytes; tests/integration/test_malformed_specs.py runs the property on a real Mooncake master."""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from conformance import probes_specs
from conformance.kvprobes import io_of, HASHES, ProbeStore, quiet, rank
from conformance.probes_specs import NUM_BLOCKS, worker_side
from kvledger.errors import LedgerInputError
from kvledger_connector.worker.loads import MAX_PENDING_REMOVALS
from kvledger_connector.metadata import (DropNotice, KVLedgerConnectorMetadata, LoadSpec, SaveSpec,
                                         check_drop_notice, check_load_spec, check_save_spec)
from kvledger_connector.worker.side import WorkerSide
from kvledger_connector.worker.steps import WorkerReport
from testbed.store_double import StoreDouble
from tests.reports import report_until

SECRET = b"unit-spec-checks-secret-32-bytes"
H = [bytes([0xA0 + i]) * 32 for i in range(8)]


class _MemStore(StoreDouble):
    """THIS IS A TEST DOUBLE: an object store in this process that copies the bytes of the given buffers, as
    Mooncake's batch calls do, and records every call with the thread that made it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, list[str], str]] = []
        self._lock = threading.Lock()

    def _note(self, fn: str, keys: Sequence[str]) -> None:
        with self._lock:
            self.calls.append((fn, list(keys), threading.current_thread().name))

    def register_buffer(self, ptr: int, size: int) -> None:
        return None

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._note("batch_is_exist", keys)
        return [1 if k in self.data else 0 for k in keys]

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
                  ) -> list[int]:
        self._note("batch_put", keys)
        for k, ps, ns in zip(keys, ptrs, sizes):
            self.data[k] = b"".join(ctypes.string_at(p, n) for p, n in zip(ps, ns))
        return [0] * len(keys)

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
                  ) -> list[int]:
        self._note("batch_get", keys)
        out = []
        for k, ps, ns in zip(keys, ptrs, sizes):
            blob = self.data.get(k)
            if blob is None or len(blob) != sum(ns):
                out.append(-704)
                continue
            at = 0
            for p, n in zip(ps, ns):
                ctypes.memmove(p, blob[at:at + n], n)
                at += n
            out.append(at)
        return out

    def remove(self, key: str, force: bool = False) -> int:
        self._note("remove", [key])
        return 0 if self.data.pop(key, None) is not None else -704

    def fns(self, since: int = 0) -> list[str]:
        return [fn for fn, _, _ in self.calls[since:]]


@pytest.fixture
def mem() -> _MemStore:
    return _MemStore()


@pytest.fixture
def ws(mem: _MemStore) -> Iterator[WorkerSide]:
    w, _kv = worker_side(mem)
    yield w
    w.shutdown()


_step = iter(range(1, 1 << 30))


def _start(w: WorkerSide, **kw: Any) -> None:
    w.start_step(KVLedgerConnectorMetadata(step=next(_step), **kw))


def _end(w: WorkerSide, **kw: Any) -> None:
    w.end_step(KVLedgerConnectorMetadata(step=next(_step), **kw))


def _finished(w: WorkerSide, req_id: str, timeout: float = 5.0) -> WorkerReport:
    """The reports up to the one where ``req_id``'s async load is finished (TimeoutError past ``timeout``)."""
    return report_until(w, lambda r: req_id in r.finished_recving, timeout)


def _idle(w: WorkerSide, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while w.busy():
        assert time.monotonic() < deadline, "the worker's threads did not finish"
        time.sleep(0.005)


def _saved(w: WorkerSide, job: int) -> None:
    _idle(w)
    meta = w.take_report().worker_meta
    assert meta is not None and meta.completed_saves == {job: 1}


# ---------------------------------------------------------------- the probe, unmutated
def test_probe() -> None:
    with quiet():
        probes_specs.probe_a_malformed_spec_fails_whole_and_runs_nothing()


# ---------------------------------------------------------------- loads
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, NUM_BLOCKS, 0], ids=lambda b: repr(b))
def test_an_async_load_with_a_bad_block_id_finishes_with_every_real_block_failed(ws, mem, bad):
    """Before: a negative or non-int id raised in begin_load on the load thread, outside the try that
    reports: the request waited in WAITING_FOR_REMOTE_KVS for ever. An id past the cache (or the null block)
    failed only its own sub-batch while the rest loaded."""
    _start(ws, loads=[LoadSpec("a", (4, bad, 5), tuple(H[:3]))])
    assert _finished(ws, "a").invalid_block_ids == {4, 5}
    assert mem.calls == [] and ws.steps.stats.total("refused_specs") == 1
    assert "block_ids" in ws.steps.errors[-1] and repr(bad) in ws.steps.errors[-1]


def test_a_sync_load_with_a_bad_block_id_reports_every_real_block_before_the_forward(ws, mem):
    """Before: the sync load raised before anything was reported: the spec's valid blocks were neither
    loaded nor reported, and the forward ran on them."""
    _start(ws, loads=[LoadSpec("s", (6, -2, 7), tuple(H[:3]), sync=True)])
    report = ws.take_report()
    assert report.invalid_block_ids == {6, 7}  # before the forward: vLLM's get_block_ids_with_load_errors
    meta = report.worker_meta
    assert meta is not None and meta.completed_loads == {"s": 1}
    assert mem.calls == []


def test_duplicate_block_ids_in_a_load_remove_no_good_object(mem):
    """Before, with integrity on: two keys loaded into one block, the first key's object failed its tag
    against the second's bytes and was removed from the store, a good object lost. Now the spec is refused
    whole: nothing read, nothing removed, both blocks' ids reported."""
    w, _kv = worker_side(mem, secret=SECRET)
    try:
        _end(w, saves=[SaveSpec("w", 0, 0, 0, 2, (1, 2), (H[0], H[1]))])
        _saved(w, 0)
        stored = dict(mem.data)
        assert len(stored) == 2
        n = len(mem.calls)
        _start(w, loads=[LoadSpec("d", (5, 5), (H[0], H[1]), sync=True)])
        assert w.take_report().invalid_block_ids == {5}
        assert mem.data == stored, "a good object was removed"
        assert mem.fns(n) == [] and w.steps.stats.total("integrity_mismatches") == 0
        _start(w, loads=[LoadSpec("ok", (5, 6), (H[0], H[1]), sync=True)])  # well-formed: both load
        assert w.take_report().invalid_block_ids == set() and mem.data == stored
    finally:
        w.shutdown()


def test_a_load_past_the_kv_cache_fails_as_one_unit(mem):
    """Before: with sub-batches of one key, block 4 loaded while block 99 failed alone."""
    w, _kv = worker_side(mem, load_sub_batch_keys=1)
    try:
        _end(w, saves=[SaveSpec("w", 0, 0, 0, 1, (1,), (H[0],))])
        _saved(w, 0)
        n = len(mem.calls)
        _start(w, loads=[LoadSpec("far", (4, 99), (H[0], H[1]))])
        assert _finished(w, "far").invalid_block_ids == {4}
        assert mem.fns(n) == []
    finally:
        w.shutdown()


def test_a_load_without_a_req_id_is_dropped_naming_it(ws, mem):
    _start(ws, loads=[LoadSpec(7, (4,), (H[0],)), LoadSpec("", (5,), (H[1],), sync=True)])  # type: ignore[arg-type]
    assert mem.calls == [] and not ws.take_report()
    assert ws.steps.stats.total("refused_specs") == 2 and "req_id" in ws.steps.errors[-1]


# ---------------------------------------------------------------- saves and notices
def test_a_save_with_a_negative_generation_is_reported_never_run(ws, mem):
    """Before: register raised out of end_step into the model runner (and the job's pins were never released)."""
    _end(ws, saves=[SaveSpec("r", 5, -1, 0, 2, (1, 2), (H[0], H[1]))])
    _idle(ws)
    meta = ws.take_report().worker_meta
    assert meta is not None and meta.completed_saves == {5: 1}
    assert mem.calls == [] and "generation" in ws.steps.errors[-1]
    _end(ws, saves=[SaveSpec("r", 6, 0, 0, 2, (1, 2), (H[0], H[1]))])  # the request's next, well-formed job runs
    _saved(ws, 6)
    assert len(mem.data) == 2


def test_a_duplicate_job_id_is_dropped_without_a_second_report(ws, mem):
    """Before: register raised 'already registered' out of end_step. The live job keeps its one report."""
    gate = threading.Event()
    inner = ws.io.store

    class _Held:  # THIS IS A TEST DOUBLE: holds the store thread until the gate opens
        def __getattr__(self, name: str) -> Any:
            fn = getattr(inner, name)

            def call(*a: Any, **k: Any) -> Any:
                gate.wait(5)
                return fn(*a, **k)
            return call
    ws.io.store = _Held()
    _end(ws, saves=[SaveSpec("r", 1, 0, 0, 1, (1,), (H[0],)), SaveSpec("q", 1, 0, 0, 1, (3,), (H[2],))])
    assert "another job" in ws.steps.errors[-1]
    gate.set()
    _saved(ws, 1)
    assert list(mem.data) == [ws.steps.block_shape().builders[0].key(H[0])]
    _end(ws, saves=[SaveSpec("q", 1, 0, 0, 1, (3,), (H[2],))])  # reported already: still not a second report
    assert ws.take_report().worker_meta is None


@pytest.mark.parametrize("ids", [(3, 3), (1, NUM_BLOCKS), (0, 2), (1, -1)], ids=str)
def test_a_save_naming_a_block_twice_or_outside_the_cache_writes_nothing(ws, mem, ids):
    """Before: a block named twice was put under both keys (the second key's object held another block's KV)."""
    _end(ws, saves=[SaveSpec("r", 2, 0, 0, 2, ids, (H[0], H[1]))])
    _idle(ws)
    meta = ws.take_report().worker_meta
    assert meta is not None and meta.completed_saves == {2: 1}
    assert mem.calls == [] and mem.data == {}


def test_a_malformed_drop_notice_raises_nothing_and_still_releases(ws):
    """Before: a negative generation raised out of start_step. A malformed notice closes the req_id's open
    generation (its queued jobs go stale) and a held request's release still goes out."""
    _start(ws, drops=[DropNotice("r", -3, True, release=True), DropNotice(None, 0, False)])  # type: ignore[arg-type]
    assert ws.take_report().finished_sending == {"r"}
    assert ws.steps.stats.total("refused_specs") == 2


# ---------------------------------------------------------------- the checks themselves name field and value
@pytest.mark.parametrize("call, field", [
    (lambda: check_load_spec(LoadSpec("a", (1, 1), (H[0], H[1])), num_blocks=8, num_groups=1), "block_ids"),
    (lambda: check_load_spec(LoadSpec("a", (1,), (H[0],), groups=(2,)), num_blocks=8, num_groups=2), "groups"),
    (lambda: check_load_spec(LoadSpec("a", (1,), (b"",)), num_blocks=8, num_groups=1), "block_hashes"),
    (lambda: check_save_spec(SaveSpec("a", -4, 0, 0, 1, (1,), (H[0],))), "store_job_id"),
    (lambda: check_save_spec(SaveSpec("a", 1, 0, 0, 1, (0,), (H[0],)), num_blocks=8, null_ok=False), "block_ids"),
    (lambda: check_save_spec(SaveSpec("a", 1, 0, 0, 2, (1, 1), (H[0], H[1]))), "block_ids"),
    (lambda: check_drop_notice(DropNotice("a", 1.0, False)), "generation"),  # type: ignore[arg-type]
    (lambda: check_drop_notice(DropNotice("a", 1, 1)), "finished"),  # type: ignore[arg-type]
])
def test_each_check_names_the_field_and_the_value(call, field):
    with pytest.raises(LedgerInputError) as e:
        call()
    assert e.value.field.endswith(field)


def test_a_hybrid_save_may_name_the_null_block_in_several_groups():
    check_save_spec(SaveSpec("a", 1, 0, 0, 2, (0, 5, 0, 6), (H[0], H[1]), num_groups=2), num_blocks=8, null_ok=True)


# ---------------------------------------------------------------- the mismatch removal's thread and bound
def test_a_sync_loads_tampered_object_is_removed_by_the_store_thread(mem):
    """Before: the sync load removed the object inline, a store call on the model runner's thread."""
    w, kv = worker_side(mem, secret=SECRET)
    try:
        _end(w, saves=[SaveSpec("w", 0, 0, 0, 2, (1, 2), (H[0], H[1]))])
        _saved(w, 0)
        key = w.steps.block_shape().builders[0].key(H[1])
        blob = bytearray(mem.data[key])
        blob[0] ^= 1  # another client changed a byte of the object in place
        mem.data[key] = bytes(blob)
        n = len(mem.calls)
        _start(w, loads=[LoadSpec("t", (5, 6), (H[0], H[1]), sync=True)])
        assert w.take_report().invalid_block_ids == {6}
        deadline = time.monotonic() + 5
        while key in mem.data and time.monotonic() < deadline:
            time.sleep(0.005)
        removals = [(keys, who) for fn, keys, who in mem.calls[n:] if fn == "remove"]
        assert removals == [([key], "kvledger-store-r0")], removals
        assert w.steps.block_shape().builders[0].key(H[0]) in mem.data
    finally:
        w.shutdown()


def test_pending_removals_are_bounded_and_each_key_queued_once():
    w = rank(ProbeStore())
    for i in range(MAX_PENDING_REMOVALS + 5):
        w.queue_removal(f"k{i}")
    w.queue_removal("k0")  # already waiting: not a second entry, not dropped
    assert len(w.removals) == MAX_PENDING_REMOVALS
    assert w.stats.total("integrity_removals_dropped") == 5
    keys = w.take_removals()
    assert len(keys) == MAX_PENDING_REMOVALS and not w.removals
    assert io_of(w).remove(keys) == []  # each removed, none raised
    assert io_of(w).store.calls[0] == ("remove", ["k0"])


def test_receive_save_probe_rank_without_a_cache_size_still_checks_ranges():
    """A driver's WorkerSteps (no KV cache registered: num_blocks None) checks everything but the upper bound."""
    w = rank(ProbeStore())
    assert w.receive_save(SaveSpec("r", 1, 0, 0, 1, (99,), (HASHES[0],))) is not None
    assert w.receive_save(SaveSpec("r", 2, 0, 0, 1, (-1,), (HASHES[0],))) is None
