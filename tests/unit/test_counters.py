"""The counters' exactness (kvledger_connector/telemetry/stats.py): each event counter of a rank's step functions
(kvledger_connector/worker/steps.py) and of the scheduler's (scheduler/steps.py) is moved by exactly the event that
should move it, by exactly its amount, and by no other event: every test takes the difference of ALL the
event counters below around one event and compares it whole, so a counter moved by the wrong event (a
stale job counted failed, a finished request counted as a save given up) fails as surely as one not moved.
The parts are the probes' (conformance/kvprobes.py, conformance/probes_sched.py): real ledgers and steps,
the scripted in-memory store."""
from __future__ import annotations

from typing import Callable

import pytest

from conformance.kvprobes import io_of, drain, HASHES, KEY_BYTES, ProbeStore, quiet, rank, tp_shared_rank
from conformance.probes_sched import BS, Req, _run, sched
from kvledger_connector.metadata import SaveSpec
from kvledger_connector.scheduler.side import ask_store
from kvledger_connector.telemetry.stats import COUNTERS, StatsRecorder

#: the counters of events (not the store calls' keys, bytes and durations, which count volume)
WORKER = ("run_jobs", "stale_jobs", "skipped_jobs", "rejected_jobs", "failed_jobs", "loads", "rejected_loads",
          "load_errors_reported", "integrity_mismatches", "store_exceptions")
SCHEDULER = ("lookups", "lookup_hit_tokens", "store_jobs", "tail_saves", "deferrals", "saves_dropped",
             "save_errors", "refused_loads", "kept_blocks", "failed_load_requeues")
EVENTS = WORKER + SCHEDULER


def test_the_event_counters_are_declared():
    assert set(EVENTS) <= set(COUNTERS)


def moved(stats: StatsRecorder, event: Callable[[], object]) -> dict[str, float]:
    """The event counters ``event`` moved, and by how much."""
    before = {n: stats.total(n) for n in EVENTS}
    with quiet():
        event()
    return {n: stats.total(n) - before[n] for n in EVENTS if stats.total(n) != before[n]}


# ---------------------------------------------------------------- a rank's store jobs
def test_a_stored_job_counts_one_run_job_only():
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    w.receive("r", 1, 0)
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])) == {"run_jobs": 1}
    w.receive("r", 2, 0)  # nothing new to put (the offset is at the end): still a job that ran
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 2, 2, [1, 2], HASHES[:2])) == {"run_jobs": 1}


@pytest.mark.parametrize("code", [-800, 1])
def test_a_failed_put_counts_one_failed_job_whatever_its_failed_keys(code):
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2, 3: 3})
    for k in w.block_shape().builders[0].keys(HASHES[1:3]):
        st.put_codes[k] = code  # two failed keys, one job
    w.receive("r", 1, 0)
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 1, 3, [1, 2, 3], HASHES[:3])) == {"run_jobs": 1, "failed_jobs": 1}


def test_a_stale_job_counts_stale_not_failed_nor_run():
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1})
    w.receive("r", 1, 0)
    w.receive("r", 2, 1)  # generation 1 supersedes job 1's generation 0
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 1, 1, [1], HASHES[:1])) == {"stale_jobs": 1}
    assert w.take_reports() == {1: 1}


def test_a_pressure_skipped_job_counts_skipped_not_failed_nor_run():
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    st.put_codes[w.block_shape().builders[0].key(HASHES[0])] = -200  # NO_AVAILABLE_HANDLE: pressure
    w.receive("r", 1, 0)
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 1, 1, [1], HASHES[:1])) == {"run_jobs": 1, "failed_jobs": 1}
    w.receive("r", 2, 0)
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 2, 2, [1, 2], HASHES[:2])) == {"skipped_jobs": 1}


def test_a_rejected_job_counts_rejected_only():
    w = rank(ProbeStore())
    w.receive("r", 1, 0)
    assert moved(w.stats, lambda: w.reject_save(1)) == {"rejected_jobs": 1}
    # a spec that does not continue what the rank holds: refused and reported at once, never run
    bad = SaveSpec("q", 2, 0, 1, 2, (5,), (HASHES[1],))
    assert moved(w.stats, lambda: w.receive_save(bad)) == {"rejected_jobs": 1}
    assert w.take_reports() == {1: 1, 2: 1}


def test_a_handler_or_store_exception_counts_one_failed_job():
    st = ProbeStore()
    w = rank(st)
    w.receive("r", 1, 0)  # an empty hash: the key builder raises after DmaRead
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 1, 2, [1, 2], [HASHES[0], b""])) == {"run_jobs": 1,
                                                                                       "failed_jobs": 1}
    st.raises.add("batch_put")
    st.mem.update({1: 1, 2: 2})
    w.receive("r", 2, 0)
    assert moved(w.stats, lambda: w.run_save(io_of(w), "r", 2, 2, [1, 2], HASHES[:2])) == {
        "run_jobs": 1, "failed_jobs": 1, "store_exceptions": 1}


def test_an_abandoned_job_counts_one_failed_job():
    st = ProbeStore()
    w = rank(st)
    w.receive("r", 1, 0)
    gen = w.save_steps(io_of(w), "r", 1, 1, [1], HASHES[:1])
    assert moved(w.stats, lambda: next(gen)) == {"run_jobs": 1}  # DmaRead
    assert moved(w.stats, gen.close) == {"failed_jobs": 1}
    assert w.take_reports() == {1: 1}


# ---------------------------------------------------------------- a rank's loads
def test_a_whole_load_counts_one_load_and_no_error():
    st = ProbeStore()
    w = rank(st)
    st.data.update(dict.fromkeys(w.block_shape().builders[0].keys(HASHES[:3]), 1))
    assert moved(w.stats, lambda: w.run_load(io_of(w), "r", [4, 5, 6], HASHES[:3])) == {"loads": 1}


def test_load_errors_count_the_blocks_not_loaded():
    st = ProbeStore()
    w = rank(st, sub_batch=2)
    keys = w.block_shape().builders[0].keys(HASHES[:4])
    st.data.update(dict.fromkeys(keys, 1))
    del st.data[keys[1]]  # missing
    st.get_codes[keys[3]] = KEY_BYTES // 2  # a short read
    assert moved(w.stats, lambda: w.run_load(io_of(w), "r", [4, 5, 6, 7], HASHES[:4])) == {"loads": 1,
                                                                                 "load_errors_reported": 2}
    st.raises.add("batch_get")  # each sub-batch's call raises: every block fails, one exception per call
    assert moved(w.stats, lambda: w.run_load(io_of(w), "r", [4, 5, 6], HASHES[:3])) == {
        "loads": 1, "load_errors_reported": 3, "store_exceptions": 2}


def test_a_block_of_several_keys_is_one_load_error():
    st = ProbeStore()
    w = tp_shared_rank(st)
    keys = [w.block_shape().builders[j].keys(HASHES[:2]) for j in range(2)]
    st.data.update(dict.fromkeys(keys[0][:1], 1))  # block 4: only its first head shard's key is stored
    st.data.update(dict.fromkeys(keys[0][1:] + keys[1][1:], 1))  # block 5: whole
    assert moved(w.stats, lambda: w.run_load(io_of(w), "r", [4, 5], HASHES[:2])) == {"loads": 1, "load_errors_reported": 1}


def test_a_rejected_load_counts_its_blocks_as_errors():
    w = rank(ProbeStore())
    # begun and finished at once in the load ledger: counted among the loads begun too
    assert moved(w.stats, lambda: w.reject_load("r", [4, 5, 6], "queue full")) == {
        "loads": 1, "rejected_loads": 1, "load_errors_reported": 3}
    assert w.take_load_errors() == {4, 5, 6}


def test_an_integrity_mismatch_counts_once_and_only_for_the_mismatched_block():
    from conformance.probes_parts import integrity_case

    w, _seal, _kv = integrity_case()  # block 2 changed after its tag; block 1 did not
    st: ProbeStore = io_of(w).store
    st.data.update({"k1": 1, "k2": 2})
    st.get_codes.update({"k1": w.key_bytes, "k2": w.key_bytes})

    def load() -> None:
        lid = w.begin_load("r", [1, 2])
        drain(w, w.load_batch(lid, ["k1", "k2"], [1, 2]))
        w.finish_load(lid, "done")
    assert moved(w.stats, load) == {"loads": 1, "integrity_mismatches": 1, "load_errors_reported": 1}

    def good() -> None:
        lid = w.begin_load("r", [1])
        drain(w, w.load_batch(lid, ["k1"], [1]))
        w.finish_load(lid, "done")
    assert moved(w.stats, good) == {"loads": 1}


# ---------------------------------------------------------------- the scheduler
def test_a_lookup_counts_once_per_store_question():
    s = sched()
    req = Req("a", 3 * BS + 1)
    s.stored(req, 2)
    s.steps.on_new_request(req)
    assert moved(s.steps.stats, lambda: ask_store(s.steps, s.store, req, 0)) == {"lookups": 1, "lookup_hit_tokens": 2 * BS}
    assert moved(s.steps.stats, lambda: ask_store(s.steps, s.store, req, 0)) == {}  # the same question: answered from cache
    short = Req("b", BS)  # no full block before the last token: nothing to ask the store
    s.steps.on_new_request(short)
    assert moved(s.steps.stats, lambda: ask_store(s.steps, s.store, short, 0)) == {}
    miss = Req("c", 2 * BS + 1)
    s.steps.on_new_request(miss)
    assert moved(s.steps.stats, lambda: ask_store(s.steps, s.store, miss, 0)) == {"lookups": 1}


def test_a_job_opened_counts_store_jobs_and_a_deferral_counts_once():
    s = sched(jobs_cap=1)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)
    jobs: list = []
    assert moved(s.steps.stats, lambda: jobs.extend(_run(s, a, BS + 1))) == {"store_jobs": 1}
    assert moved(s.steps.stats, lambda: _run(s, b, BS + 1)) == {"deferrals": 1}  # the job cap
    assert moved(s.steps.stats, lambda: s.step({})) == {}  # still deferred: the same deferral, not counted again
    s.steps.collect({jobs[0].store_job_id: 1})
    assert moved(s.steps.stats, lambda: s.step({})) == {"store_jobs": 1}  # the retry opens it


def test_a_partial_tail_counts_a_tail_save_with_its_job():
    s = sched(partial_tail=True)
    req = Req("a", 2 * BS + 2)
    s.steps.on_new_request(req)
    assert moved(s.steps.stats, lambda: _run(s, req, 2 * BS + 2)) == {"store_jobs": 1, "tail_saves": 1}


def test_only_a_deferred_save_of_a_finished_request_is_dropped():
    s = sched(jobs_cap=1)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)
    _run(s, a, BS + 1)
    _run(s, b, BS + 1)  # deferred behind a's job
    assert moved(s.steps.stats, lambda: s.steps.request_finished(a)) == {}  # its save went out: nothing dropped
    assert moved(s.steps.stats, lambda: s.steps.request_finished(b)) == {"saves_dropped": 1}
    c = Req("c", BS - 1)  # never saved anything, never deferred
    s.steps.on_new_request(c)
    assert moved(s.steps.stats, lambda: s.steps.request_finished(c)) == {}


def test_a_save_over_the_block_cap_is_dropped_not_deferred():
    s = sched(pins=2)
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    assert moved(s.steps.stats, lambda: _run(s, req, 3 * BS + 1)) == {"saves_dropped": 1}
    assert moved(s.steps.stats, lambda: s.steps.request_finished(req)) == {}  # not counted a second time
