"""Shows-probes: for each runtime mutant (conformance/mutants.py), the smallest direct observation of the
function it patches. ``SHOWS[name]()`` returns normally on the shipped code and raises
:class:`ProbeFailed` with the mutant applied: the proof that the mutant changes the function its name
says, on the path the connector runs. (What kills a mutant is the table's named checks; this only shows
that there is something to kill.) tests/unit/test_mutant_shows.py runs each one both ways.

Adding a mutant: one MUTANTS entry and one function here, registered under the same name.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable

import kvledger.codes as codes
import kvledger_connector.worker.loads as loads
import kvledger_connector.worker.sent as sent_blocks
import kvledger_connector.shape.keys as keys
import kvledger_connector.scheduler.plan as scheduler_plan
from conformance import probes_edge, probes_identity, probes_rules, probes_sched, probes_specs
from conformance.kvprobes import (io_of, HASHES, KEY_BYTES, ProbeFailed, ProbeStore, block_pool, check, drain, rank,
                                  tp_shared_rank)
from conformance.probes_parts import (BASE, HASH, check_layout, foreign_dir, integrity_case, replica_split,
                                     replicas_of, reset_case, runtime_dir_env)
from kvledger.errors import LedgerInputError, LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.scheduler import SchedulerLedger
from kvledger.worker import Verdict, WorkerLedger
from kvledger_connector.store import rendezvous
from kvledger_connector.worker.saves import SavePlan
from kvledger_connector.metadata import KVLedgerWorkerMetadata, SaveSpec

SHOWS: dict[str, Callable[[], None]] = {}


def shows(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def reg(f: Callable[[], None]) -> Callable[[], None]:
        SHOWS[name] = f
        return f
    return reg


def _ledger(*, world: int = 1, jobs_cap: int = 2, pins: int = 8) -> tuple[SchedulerLedger, list[int], list[int]]:
    """A ledger on a fresh BlockPool with 4 allocated blocks; (ledger, block ids, their ref counts)."""
    pool, ids = block_pool(4)
    led = SchedulerLedger(pool, world_size=world, max_inflight_jobs=jobs_cap, max_pinned_blocks=pins)
    return led, ids, [pool.blocks[b].ref_cnt for b in ids]


def _refs(led: SchedulerLedger, ids: list[int]) -> list[int]:
    return [led._blocks[b].ref_cnt for b in ids]


# ---------------------------------------------------------------- scheduler ledger
@shows("no_pin")
def _() -> None:
    led, ids, before = _ledger()
    led.open_job("r", ids[:1])
    check(_refs(led, ids[:1]) == [before[0] + 1], "open_job added no ref to its block")


@shows("pin_released_one_report_early")
def _() -> None:
    led, ids, _refs0 = _ledger(world=2)
    j = led.open_job("r", ids[:1])
    check(j is not None and led.ranks_left(j) == 2, "a job of 2 ranks does not wait for 2 reports")


@shows("cow_tail_unpinned")
def _() -> None:
    led, ids, _refs0 = _ledger()
    j = led.open_job("r", ids[:1], tail_block_ids=ids[3:])
    check(j is not None and led.pinned_block_ids(j) == [ids[0], ids[3]], "open_job did not pin the tail")


@shows("pin_cap_admits_one_over")
def _() -> None:
    led, ids, _refs0 = _ledger(jobs_cap=1)
    led.open_job("a", ids[:1])
    check(led.open_job("b", ids[1:2]) is None, "a job over max_inflight_jobs=1 was admitted")


@shows("pin_block_cap_one_short")
def _() -> None:
    led, ids, _refs0 = _ledger(pins=2)
    led.open_job("a", ids[:1])
    check(led.open_job("b", ids[1:2]) is not None, "a job reaching max_pinned_blocks exactly was deferred")


@shows("over_report_ignored")
def _() -> None:
    led, ids, _refs0 = _ledger()
    j = led.open_job("a", ids[:1])
    try:
        led.collect({j: 2})  # type: ignore[dict-item]
    except LedgerInvariantError as e:
        check(e.invariant_id == "S5", f"an over-report raised {e.invariant_id}, not S5")
        return
    raise ProbeFailed("collect accepted 2 reports of a 1-rank job")


@shows("no_load_pin")
def _() -> None:
    led, ids, before = _ledger()
    led.pin_load("r", ids[:2])
    check(_refs(led, ids[:2]) == [r + 1 for r in before[:2]], "pin_load added no ref to its destination blocks")


@shows("load_pin_released_at_first_rank")
def _() -> None:
    led, ids, _refs0 = _ledger(world=2)
    led.pin_load("r", ids[:1])
    check(led.load_ranks_left("r") == 2, f"a load of 2 ranks waits for {led.load_ranks_left('r')} reports")


# ---------------------------------------------------------------- worker ledger, reports
@shows("worker_keyed_by_req_id")
def _() -> None:
    wl = WorkerLedger(0, max_live_jobs=4)
    wl.register("r", 1, 0)
    wl.register("r", 2, 1)  # generation 1 supersedes generation 0
    check(wl.begin(1) is Verdict.STALE, "a job of a superseded generation is not stale")
    wl.drop_generation("r", finished=False, generation=0)  # a late notice of generation 0
    req = wl.request("r")
    check(req is not None and req.generation == 1, f"a late notice of generation 0 closed generation 1: {req}")


@shows("no_report_when_store_raises")
def _() -> None:
    wl = WorkerLedger(0, max_live_jobs=4)
    wl.register("r", 1, 0)
    wl.begin(1)
    wl.record_failed(1)
    wl.finish(1)
    check(wl.take_completed() == {1: 1}, "a failed job was not reported")


@shows("reports_counted_twice")
def _() -> None:
    wl = WorkerLedger(0, max_live_jobs=4)
    wl.register("r", 1, 0)
    wl.finish(1)
    wl.take_completed()
    check(wl.take_completed() == {}, "take_completed handed a report out twice")


@shows("rank_reports_overwritten")
def _() -> None:
    meta = KVLedgerWorkerMetadata({1: 1}).aggregate(KVLedgerWorkerMetadata({1: 1}))
    check(meta.completed_saves == {1: 2}, f"two ranks' reports of job 1 merged to {meta.completed_saves}")


# ---------------------------------------------------------------- store-code classification
@shows("put_partial_batch_ok")
def _() -> None:
    check(not codes.classify_put([0, -800], 2).stored, "a batch with a failed key counts as stored")


@shows("put_pressure_first_key_only")
def _() -> None:
    check(codes.classify_put([0, -200], 2).pressure, "NO_AVAILABLE_HANDLE on the second key is no pressure")


@shows("put_positive_code_stored")
def _() -> None:
    check(not codes.classify_put([0, 1], 2).stored, "a positive put code counts as stored")


@shows("answer_length_unchecked")
def _() -> None:
    try:
        codes.classify_put([0], 2)
    except LedgerInputError:
        return
    raise ProbeFailed("one put code for two keys was accepted")


@shows("get_short_read_loaded")
def _() -> None:
    check(not codes.is_loaded(KEY_BYTES // 2, KEY_BYTES), "a short read counts as loaded")


@shows("exist_error_means_present")
def _() -> None:
    got = codes.missing([1, -900, 0], 3)
    check(got == [1, 2], f"batch_is_exist [1, -900, 0]: keys {got} to put, expected [1, 2]")


@shows("failing_subbatch_unreported")
def _() -> None:
    ll = LoadLedger(0, max_inflight_loads=2)
    lid = ll.begin_load("r", [4, 5])
    ll.record_results(lid, [4, 5], [KEY_BYTES, -800], KEY_BYTES)
    check(ll.take_errors() == {5}, "a sub-batch's failed key is not reported")


# ---------------------------------------------------------------- the connector's step functions
@shows("register_generation_dropped")
def _() -> None:
    w = rank(ProbeStore())
    w.receive("r", 1, 3)
    req = w.ledger.request("r")
    check(req is not None and req.generation == 3, f"Receive of a generation-3 job registered {req}")


@shows("stale_job_runs")
def _() -> None:
    check(not SavePlan(1, Verdict.STALE, 0, 2).run, "a stale job's plan runs")


@shows("skipped_job_runs")
def _() -> None:
    check(not SavePlan(1, Verdict.SKIP, 0, 2).run, "a pressure-skipped job's plan runs")


@shows("put_resumes_past_offset")
def _() -> None:
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    w.receive("r", 2, 0)
    plan = w.begin_save(2, 4)
    check(plan.start == 2, f"with 2 blocks saved the next put starts at block {plan.start}")


@shows("load_ids_not_rotated")
def _() -> None:
    got = loads.load_pairs(["k0", "k1", "k2"], [10, 11, 12], 1)
    check(got == [("k1", 11), ("k2", 12), ("k0", 10)], f"rank 1's load pairs {got}")


@shows("save_report_skipped_on_exception")
def _() -> None:
    w = rank(ProbeStore())
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], [HASHES[0], b""])  # an empty hash: the key builder raises
    check(w.take_reports() == {1: 1}, "a job whose handler raised was not reported")


@shows("load_unfinished_on_exception")
def _() -> None:
    w = rank(ProbeStore())
    w.run_load(io_of(w), "r", [4, 5], [HASHES[0], b""])
    check(w.take_finished_loads() == {"r"}, "a load whose handler raised never finished")


# ---------------------------------------------------------------- KV cache copy plans
@shows("layout_last_run_dropped")
def _() -> None:
    check_layout("LHBNC")  # two heads: two runs per block and layer


@shows("layout_stride_per_kernel_block")
def _() -> None:
    check_layout("LBNHC", kernel=2)


@shows("layout_lhbnc_token_major")
def _() -> None:
    check_layout("LHBNC")


# ---------------------------------------------------------------- keys
@shows("key_without_pp_stage")
def _() -> None:
    a, b = keys.KeyBuilder(BASE).key(HASH), keys.KeyBuilder(dataclasses.replace(BASE, pp_rank=1)).key(HASH)
    check(a != b, f"pipeline stages 0 and 1 share the key {a!r}")


@shows("key_digest_without_layout")
def _() -> None:
    check(BASE.digest() != dataclasses.replace(BASE, kv_layout="LHBNC").digest(),
          "LBNHC and LHBNC have one layout digest")


@shows("tail_hash_without_tokens")
def _() -> None:
    for where, f in (("keys", keys.partial_tail_hash), ("scheduler.plan", scheduler_plan.partial_tail_hash)):
        check(f(HASH, [5, 6]) != f(HASH, [5, 7]), f"{where}.partial_tail_hash: tails [5, 6] and [5, 7] share a hash")


@shows("replicas_put_every_key")
def _() -> None:
    split = replica_split(2)
    check(not set(split[0]) & set(split[1]), f"replicas 0 and 1 both put positions {set(split[0]) & set(split[1])}")


@shows("replicas_share_distinct_heads")
def _() -> None:
    check(replicas_of("per_rank", 2) == 1, "two ranks with heads of their own share keys")


# ---------------------------------------------------------------- integrity tags
@shows("integrity_mismatch_loaded")
def _() -> None:
    w, _seal, _kv = integrity_case()
    got = drain(w, w._verified(0, ["k2"], [2], [w.key_bytes]))
    check(got != [w.key_bytes], "WorkerSteps._verified kept a block whose bytes changed after its tag as loaded")


@shows("integrity_tag_ignores_key")
def _() -> None:
    from kvledger_connector.shape.integrity import IntegrityKey
    ik = IntegrityKey("mac", b"s" * 16)
    check(ik.bind("a", b"n" * 8) != ik.bind("b", b"n" * 8), "IntegrityKey.bind is the same for keys a and b")


# ---------------------------------------------------------------- reset_cache's pattern
@shows("reset_pattern_unanchored")
def _() -> None:
    rx, mine, _others = reset_case()
    check(rx.search("other/" + mine[0]) is None, f"{rx.pattern!r} matches this engine's key inside another path")


@shows("reset_pattern_first_shard_only")
def _() -> None:
    rx, mine, _others = reset_case()
    check(all(rx.search(k) for k in mine), f"{rx.pattern!r} misses a shard's keys")


# ---------------------------------------------------------------- runtime directory
@shows("runtime_dir_any_directory")
def _() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = foreign_dir(tmp)
        with runtime_dir_env(d):
            try:
                rendezvous.runtime_dir()
            except rendezvous.RendezvousError:
                return
    raise ProbeFailed(f"another user's directory {d} accepted as the runtime dir")


@shows("liveness_ignores_start_time")
def _() -> None:
    check(rendezvous._start_time(os.getpid()) is not None, "this process's start time is not read")


@shows("sweep_ignores_liveness")
def _() -> None:
    check(rendezvous._alive(os.getpid()), "this very process counts as dead")


# ---------------------------------------------------------------- worker side: removal, TP-shared blocks, SentBlocks
def _mismatch_removal() -> tuple[list[str], ProbeStore]:
    """WorkerSteps._verified on k1 (good) and k2 (changed after its tag, leased by a reader), then
    the removal the store thread makes (`take_removals` through the edge's `StoreIO.remove`): the keys
    removed, and the store."""
    w, _seal, _kv = integrity_case()
    st = io_of(w).store
    st.data.update({"k1": 1, "k2": 2})
    st.leased.add("k2")
    drain(w, w._verified(0, ["k1", "k2"], [1, 2], [w.key_bytes, w.key_bytes]))
    io_of(w).remove(w.take_removals())
    return [k[0] for fn, k in st.calls if fn == "remove"], st


@shows("integrity_mismatch_not_removed")
def _() -> None:
    removed, _st = _mismatch_removal()
    check(removed == ["k2"], f"the store thread's removal removed {removed} after k2's mismatch, expected ['k2']")


@shows("integrity_mismatch_removed_unforced")
def _() -> None:
    _removed, st = _mismatch_removal()
    check("k2" not in st.data, "the store thread's removal left a leased mismatched object in the store")


@shows("integrity_mismatch_removes_whole_batch")
def _() -> None:
    _removed, st = _mismatch_removal()
    check("k1" in st.data, "WorkerSteps._verified queued k1, whose tag matched, for removal")


@shows("shared_block_loaded_at_first_key")
def _() -> None:
    w = tp_shared_rank(ProbeStore())
    lid = w.begin_load("r", [4])
    w.loads.record_ok(lid, [4])
    check(w.loads.pending(lid) == [4], "a TP-shared block (2 keys) counts loaded after its first key")


@shows("load_ledger_ignores_keys_per_block")
def _() -> None:
    ll = LoadLedger(0, max_inflight_loads=2)
    lid = ll.begin_load("r", [4], keys_per_block=2)
    ll.record_ok(lid, [4])
    check(ll.pending(lid) == [4], "LoadLedger.record_ok loaded a block of 2 keys after one")


def _resolved_with_null_before() -> tuple[int, ...]:
    sent = sent_blocks.SentBlocks(4)
    sent.resolve(SaveSpec("r", 1, 0, 0, 2, (11, 21, 12, 22), (b"h0", b"h1"), num_groups=2))
    return sent.resolve(SaveSpec("r", 2, 0, 2, 3, (13, 23), (b"h2",), num_groups=2, null_before=(0, 2)))[0]


@shows("sent_null_before_ignored")
def _() -> None:
    ids = _resolved_with_null_before()
    check(ids[1] == ids[3] == 0, f"null_before=(0, 2) left group 1's freed ids in {ids}")


@shows("sent_null_before_wrong_group")
def _() -> None:
    ids = _resolved_with_null_before()
    check(ids == (11, 0, 12, 0, 13, 23), f"null_before=(0, 2) resolved {ids}, expected (11, 0, 12, 0, 13, 23)")


# the scheduler side's mutants are shown by their own probes (conformance/probes_sched.py)
SHOWS.update(probes_sched.SHOWS)
# the edges' mutants likewise (conformance/probes_edge.py)
SHOWS.update(probes_edge.SHOWS)
# and the spec checks' (conformance/probes_specs.py)
SHOWS.update(probes_specs.SHOWS)
# and the embedded master's identity (conformance/probes_identity.py)
SHOWS.update(probes_identity.SHOWS)
# and the rules of conformance/probes_rules.py
SHOWS.update(probes_rules.SHOWS)
