"""The per-job generators of kvledger_connector/worker/steps.py (`WorkerSteps.save_steps`, `load_steps`): the one
orchestration the connector's threads drain (`run_save`, `run_load`) and the replay driver advances one
model action at a time. Every exit path — done, an exception raised or thrown in, abandoned (closed or
collected) — reports the job exactly once (S5) and every block not loaded (S8). Also the worker house: one
counter system (`stats`), no pass-through properties. The store is the probes' scripted in-memory one."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

from conformance.kvprobes import io_of, BLOCK_SIZE, HASHES, ProbeStore, rank
from kvledger.errors import LedgerInputError
from kvledger.worker import Verdict
from kvledger_connector.worker import side as worker_mod
from kvledger_connector.worker.base import JobAction
from kvledger_connector.worker.loads import load_pairs
from kvledger_connector.worker.saves import SaveStep
from kvledger_connector.worker.steps import WorkerSteps
from kvledger_connector.telemetry.stats import COUNTERS, GAUGES, StatsRecorder


class Thrown(RuntimeError):
    """What a driver throws in: the handler raised."""


def _saving(n: int = 2) -> tuple[ProbeStore, WorkerSteps]:
    st = ProbeStore()
    w = rank(st)
    st.mem.update({b: 100 + b for b in range(1, n + 1)})
    w.receive("r", 1, 0)
    return st, w


def _save(w: WorkerSteps, n: int = 2):  # type: ignore[no-untyped-def]
    return w.save_steps(io_of(w), "r", 1, n, list(range(1, n + 1)), HASHES[:n])


# ---------------------------------------------------------------- saves
def test_a_save_stops_at_each_model_action_and_reports_once():
    st, w = _saving()
    gen = _save(w)
    assert st.calls == [] and w.ledger.job_state(1) == "queued"  # started, nothing done: START
    dma = next(gen)
    assert (dma.action, dma.verdict) == (JobAction.DMA_READ, Verdict.RUN) and w.ledger.job_state(1) == "running"
    assert st.calls == []  # the verdict only: no store call yet
    put = next(gen)
    assert put.action is JobAction.PUT and put.outcome is not None and put.outcome.stored
    assert w.ledger.job_state(1) == "stored" and w.take_reports() == {}
    rep = next(gen)
    assert rep == SaveStep(JobAction.REPORT, 1, Verdict.RUN)
    assert w.take_reports() == {1: 1}
    with pytest.raises(StopIteration):
        next(gen)
    assert w.stats.total("run_jobs") == 1 and w.stats.total("puts") == 1 and w.errors == []


def test_a_stale_job_goes_from_its_verdict_to_report():
    st, w = _saving()
    w.receive("r", 2, 1)  # generation 1 arrives: job 1 is stale
    gen = _save(w)
    assert next(gen).verdict is Verdict.STALE
    assert next(gen).action is JobAction.REPORT and st.calls == []
    assert w.stats.total("stale_jobs") == 1 and w.stats.total("run_jobs") == 0


def test_an_exception_thrown_at_start_is_dmaread_failed_then_report():
    st, w = _saving()
    gen = _save(w)
    failed = gen.throw(Thrown("handler raised"))
    assert failed.action is JobAction.DMA_READ and failed.verdict is None and "Thrown" in (failed.error or "")
    assert w.ledger.job_state(1) == "failed" and st.calls == []
    assert next(gen).action is JobAction.REPORT and w.take_reports() == {1: 1}
    assert w.stats.total("failed_jobs") == 1 and any("handler raised" in e for e in w.errors)


def test_an_exception_thrown_before_the_put_is_put_failed():
    st, w = _saving()
    gen = _save(w)
    next(gen)  # DmaRead: running
    failed = gen.throw(Thrown("x"))
    assert (failed.action, failed.verdict) == (JobAction.PUT, Verdict.RUN) and failed.error
    assert w.ledger.job_state(1) == "failed" and st.calls == [] and not st.data
    assert next(gen).action is JobAction.REPORT and w.take_reports() == {1: 1}
    assert w.ledger.request("r").saved_offset == 0


def test_an_exception_thrown_after_the_outcome_changes_nothing_and_reports():
    st, w = _saving()
    gen = _save(w)
    next(gen), next(gen)  # DmaRead, Put: stored
    assert gen.throw(Thrown("late")).action is JobAction.REPORT
    assert w.ledger.request("r").saved_offset == 2 * BLOCK_SIZE  # the stored outcome stands
    assert w.take_reports() == {1: 1} and w.stats.total("failed_jobs") == 0


def test_an_exception_raised_inside_an_action_fails_that_action():
    st, w = _saving()
    gen = w.save_steps(io_of(w), "r", 1, 2, [1, 2], [HASHES[0], b""])  # an empty hash: the key builder raises in Put
    next(gen)
    failed = next(gen)
    assert failed.action is JobAction.PUT and "ValueError" in (failed.error or "") and st.calls == []
    assert next(gen).action is JobAction.REPORT and w.take_reports() == {1: 1}


@pytest.mark.parametrize("advances, state_before_report", [(0, "queued"), (1, "running"), (2, "stored"),
                                                           (3, "reported")])
def test_a_closed_save_is_failed_where_it_stands_and_reported_once(advances: int, state_before_report: str):
    st, w = _saving()
    gen = _save(w)
    for _ in range(advances):
        next(gen)
    assert w.ledger.job_state(1) == state_before_report
    gen.close()
    assert w.take_reports() == {1: 1}
    assert w.ledger.job_state(1) == "reported"
    assert w.stats.total("failed_jobs") == (1 if advances < 2 else 0)
    gen.close()  # idempotent
    assert w.take_reports() == {}


def test_a_collected_save_generator_is_reported():
    st, w = _saving()
    gen = _save(w)
    next(gen)
    del gen
    gc.collect()
    assert w.take_reports() == {1: 1} and w.ledger.job_state(1) == "reported"


def test_a_baseexception_thrown_in_reports_and_propagates():
    st, w = _saving()
    gen = _save(w)
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt())
    assert w.take_reports() == {1: 1}


class _FullSegment(ProbeStore):
    """TEST DOUBLE (fault injection): a memory segment with no room (-200, NO_AVAILABLE_HANDLE) for each key's
    first ``full_for`` puts, as while the disk tier has not yet written older objects out."""

    def __init__(self, full_for: int) -> None:
        super().__init__()
        self.full_for = full_for
        self.tries: dict[str, int] = {}

    def batch_put(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        for k in keys:
            self.tries[k] = self.tries.get(k, 0) + 1
            self.put_codes[k] = -200 if self.tries[k] <= self.full_for else 0
        return super().batch_put(keys, ptrs, sizes)


def _tiered_rank(st: ProbeStore, tmp_path: Path, disk_offload: bool = True, retry_ms: int = 1) -> WorkerSteps:
    """A rank whose config has the disk tier (or not), with its retries ``retry_ms`` apart."""
    from conformance.kvprobes import with_edge
    from kvledger_connector.config import ConnectorConfig, StoreConfig
    tier = dict(disk_offload=True, disk_offload_dir=str(tmp_path / "tier")) if disk_offload else {}
    cfg = ConnectorConfig(store=StoreConfig(full_put_retries=3, full_put_retry_ms=retry_ms, **tier), block_size=BLOCK_SIZE)
    base = rank(st)
    w = with_edge(WorkerSteps(cfg, base.cache, ledger=base.ledger, loads=base.loads, tp_rank=0, shape=base.shape), st)
    st.mem.update({1: 101, 2: 102})
    w.receive("r", 1, 0)
    return w


@pytest.mark.parametrize("full_for, stored", [(2, True), (4, False)])
def test_a_put_into_a_full_segment_is_retried_with_the_tier_then_fails(tmp_path, full_for, stored):
    """With the disk tier a full segment is backpressure: the keys that found no room are put again after a
    wait, up to full_put_retries times (each counted); past them the save fails under pressure, as before."""
    st = _FullSegment(full_for)
    w = _tiered_rank(st, tmp_path)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    puts = [keys for fn, keys in st.calls if fn == "batch_put"]
    assert len(puts) == min(full_for, 3) + 1 and all(len(k) == 2 for k in puts)  # only the full keys, again
    assert w.stats.total("full_put_retries") == min(full_for, 3)
    assert w.ledger.request("r").saved_offset == (2 * BLOCK_SIZE if stored else 0)
    assert w.stats.total("failed_jobs") == (0 if stored else 1)
    assert w.stats.total("put_failed_keys") == (0 if stored else 2) and w.take_reports() == {1: 1}
    w_off = _tiered_rank(_FullSegment(1), tmp_path, disk_offload=False)  # no tier: the save fails at once
    w_off.run_save(io_of(w_off), "r", 1, 2, [1, 2], HASHES[:2])
    assert w_off.stats.total("failed_jobs") == 1 and w_off.stats.total("full_put_retries") == 0


def test_a_retrying_put_gives_up_at_shutdown(tmp_path):
    """The edge's stop (WorkerSide.shutdown) ends every wait at once: a put into a full segment does not
    hold the store thread for its retries' waits while the worker shuts down."""
    import threading
    st = _FullSegment(10)
    w = _tiered_rank(st, tmp_path, retry_ms=60_000)  # a wait of a minute before each retry
    io_of(w).stop()
    t = threading.Thread(target=w.run_save, args=(io_of(w), "r", 1, 2, [1, 2], HASHES[:2]), daemon=True)
    t.start()
    t.join(30)  # a bound, not a timing: the three waits would take three minutes
    assert not t.is_alive() and w.stats.total("failed_jobs") == 1 and w.stats.total("full_put_retries") == 3


def test_run_save_drains_save_steps():
    st, w = _saving()
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    assert w.take_reports() == {1: 1} and len(st.data) == 2


# ---------------------------------------------------------------- loads
def _loading(tp_rank: int = 1, sub_batch: int = 2) -> tuple[ProbeStore, WorkerSteps, list[str]]:
    st = ProbeStore()
    w = rank(st, tp_rank=tp_rank, sub_batch=sub_batch)
    keys = w.block_shape().builders[0].keys(HASHES[:3])
    st.data.update({k: 300 + i for i, k in enumerate(keys)})
    return st, w, keys


def test_a_load_stops_after_begin_and_each_sub_batch_in_the_rotated_order():
    st, w, keys = _loading(tp_rank=1, sub_batch=2)
    gen = w.load_steps(io_of(w), "r", [10, 11, 12], HASHES[:3])
    assert w.loads.num_inflight_loads == 0  # not started: nothing owed yet
    begin = next(gen)
    assert begin.action is JobAction.EMIT_LOAD and begin.result is None and st.calls == []
    first = next(gen)
    order = load_pairs(keys, [10, 11, 12], 1)
    assert first.action is JobAction.LOAD and first.result is None
    assert st.calls == [("batch_get", [k for k, _ in order[:2]])]  # rank 1 starts on key 1
    last = next(gen)
    assert last.result is not None and last.result.loaded == {10, 11, 12}
    assert w.take_finished_loads() == {"r"}
    with pytest.raises(StopIteration):
        next(gen)


def test_a_failed_key_is_in_its_sub_batch_step_and_reported():
    st, w, keys = _loading(tp_rank=0, sub_batch=1)
    st.get_codes[keys[1]] = -800
    steps = list(w.load_steps(io_of(w), "r", [10, 11, 12], HASHES[:3]))
    assert [s.action for s in steps] == [JobAction.EMIT_LOAD] + [JobAction.LOAD] * 3
    assert steps[2].failed == ((11, -800),) and steps[-1].result is not None
    assert w.take_load_errors() == {11} and w.stats.total("load_errors_reported") == 1


def test_a_load_with_nothing_to_try_finishes_at_begin():
    st, w, _ = _loading()
    (only,) = list(w.load_steps(io_of(w), "r", [], []))
    assert only.action is JobAction.EMIT_LOAD and only.result is not None
    assert w.take_finished_loads() == {"r"}


@pytest.mark.parametrize("advances, reported", [(1, {10, 11, 12}), (2, {11, 12}), (3, {12})])
def test_a_closed_load_reports_every_block_not_loaded(advances: int, reported: set[int]):
    st, w, _ = _loading(tp_rank=0, sub_batch=1)
    gen = w.load_steps(io_of(w), "r", [10, 11, 12], HASHES[:3])
    for _ in range(advances):
        next(gen)
    gen.close()
    assert w.take_load_errors() == reported
    assert w.take_finished_loads() == {"r"} and w.loads.num_inflight_loads == 0


def test_an_exception_thrown_into_a_load_finishes_it_with_every_block_left_reported():
    st, w, _ = _loading(tp_rank=0, sub_batch=1)
    gen = w.load_steps(io_of(w), "r", [10, 11, 12], HASHES[:3])
    next(gen), next(gen)  # begun, block 10 loaded
    end = gen.throw(Thrown("driver"))
    assert end.result is not None and end.result.failed == {11, 12} and end.result.loaded == {10}
    assert len(st.calls) == 1  # the rest was not tried
    with pytest.raises(StopIteration):
        next(gen)


def test_run_load_drains_load_steps():
    st, w, _ = _loading(tp_rank=1, sub_batch=2)
    res = w.run_load(io_of(w), "r", [10, 11, 12], HASHES[:3])
    assert res.loaded == {10, 11, 12} and st.mem[10] == 300 and w.stats.total("loads") == 1


# ---------------------------------------------------------------- one counter system, three layers
def test_an_undeclared_counter_or_gauge_is_refused():
    s = StatsRecorder()
    with pytest.raises(LedgerInputError, match="counter='nope'"):
        s.add("nope")
    with pytest.raises(LedgerInputError, match="gauge='puts'"):
        s.gauge("puts", 1)
    s.add("puts", 2)
    assert s.total("puts") == 2 and s.total("gets") == 0


def test_every_counter_the_connector_adds_is_declared():
    """A name added anywhere in the connector or the ledgers is in COUNTERS (so it has its Prometheus metric)."""
    src = Path(worker_mod.__file__).parents[1]  # kvledger_connector/, every room
    added = set()
    for f in [*src.rglob("*.py"), *(src.parent / "kvledger").glob("*.py")]:
        added |= set(re.findall(r"(?:stats|counts)\.add\(\s*\"(\w+)\"", f.read_text()))
    assert added and added <= set(COUNTERS), sorted(added - set(COUNTERS))
    assert not set(COUNTERS) & set(GAUGES)


def test_the_worker_side_has_no_pass_through_properties():
    assert [n for n, v in vars(worker_mod.WorkerSide).items() if isinstance(v, property)] == []


def test_a_failed_save_is_counted_once_in_the_stats():
    st, w = _saving()
    st.put_codes[w.block_shape().builders[0].key(HASHES[0])] = -800
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    assert (w.stats.total("run_jobs"), w.stats.total("failed_jobs")) == (1, 1)
    assert w.stats.total("put_failed_keys") == 1
