"""Sync loads in the two sides' step functions: which loads are sync (`SchedulerSteps.load_is_async`), the
save that waits for a sync load's report, the report itself (`WorkerSteps.take_finished_sync_loads`,
`KVLedgerWorkerMetadata.completed_loads`) and its release (`collect_sync_loads`). vLLM's real BlockPool."""
from __future__ import annotations

import pickle

import pytest

from conformance.kvprobes import io_of, HASHES, ProbeStore, rank
from conformance.probes_sched import BS, Req, sched, sched_config
from kvledger.errors import LedgerInputError, LedgerInvariantError
from kvledger_connector.config import ConfigError, ConnectorConfig, StoreConfig
from kvledger_connector.metadata import KVLedgerWorkerMetadata
from kvledger_connector.scheduler.side import ask_store
from kvledger_connector.scheduler.steps import SchedulerSteps


def _loaded(sync_max: int, blocks: int = 2, prompt_blocks: int = 3):
    """A request whose first ``blocks`` blocks are stored, looked up and allocated: (sched, req, n)."""
    s = sched(sync_load_max_tokens=sync_max)
    req = Req("a", prompt_blocks * BS + 1)
    s.steps.on_new_request(req)
    s.stored(req, blocks)
    n = ask_store(s.steps, s.store, req, 0)
    assert n == blocks * BS
    s.alloc("a", prompt_blocks + 1)
    return s, req, n


def test_a_load_up_to_the_limit_is_sync_a_longer_one_async():
    s, req, n = _loaded(sync_max=2 * BS)
    assert s.steps.load_is_async("a", n) is False
    assert s.steps.load_is_async("a", n + 1) is True
    spec = s.steps.emit_load(req, [s.table["a"]], n)
    assert spec is not None and spec.sync and s.steps.stats.total("sync_loads") == 1
    s0, req0, n0 = _loaded(sync_max=0)
    assert s0.steps.load_is_async("a", n0) is True
    assert not s0.steps.emit_load(req0, [s0.table["a"]], n0).sync


def test_a_req_id_with_a_load_still_pinned_loads_async():
    """A report releases the oldest pinned load of its req_id: a second load of a reused id must not use the
    other channel (its report could release the first load's blocks while that one still writes)."""
    s, req, n = _loaded(sync_max=1 << 10)
    s.ledger.pin_load("a", s.alloc("old-a", 1))  # an older load of the same req_id, not reported yet
    assert s.steps.load_is_async("a", n) is True
    assert not s.steps.emit_load(req, [s.table["a"]], n).sync


def test_the_save_waits_for_the_sync_load_report_then_starts_after_the_kept_blocks():
    s, req, n = _loaded(sync_max=1 << 10)
    s.steps.emit_load(req, [s.table["a"]], n)
    req.num_computed_tokens = n  # vLLM counted the loaded tokens and schedules the rest in this step
    rest = req.num_prompt_tokens - n
    assert s.step({"a": rest}) == []  # the load's outcome is not known: no job reads these blocks yet
    req.num_computed_tokens += rest
    assert s.step({"a": 1}) == []  # still not reported
    with pytest.raises(LedgerInputError):
        s.steps.collect_sync_loads({"b": 1})  # no load of "b" is pinned
    assert s.steps.collect_sync_loads({"a": 1}) == 1 and s.ledger.num_pinned_loads == 0
    (job,) = s.step({"a": 1})
    assert s.ledger.pinned_block_ids(job.store_job_id) == s.table["a"][:3]  # every block, from block 0
    assert s.steps.emitted_blocks("a") == 3


def test_two_ranks_release_a_sync_load_only_together():
    s, req, n = _loaded(sync_max=1 << 10)
    steps = SchedulerSteps(sched_config(world_size=2, max_pinned_blocks=32, sync_load_max_tokens=1 << 10),
                           key_builders=s.steps.key_builders)
    from kvledger.scheduler import SchedulerLedger
    steps.bind_ledger(SchedulerLedger(s.pool, world_size=2, max_inflight_jobs=4, max_pinned_blocks=32))
    steps.on_new_request(req)
    ask_store(steps, s.store, req, 0)
    steps.emit_load(req, [s.table["a"]], n)
    assert steps.collect_sync_loads({"a": 1}) == 0 and steps.ledger.has_pinned_load("a")
    with pytest.raises(LedgerInvariantError):
        steps.collect_sync_loads({"a": 2})  # more ranks than are left: pins kept (S9)
    assert steps.ledger.has_pinned_load("a")
    assert steps.collect_sync_loads({"a": 1}) == 1 and not steps.ledger.has_pinned_load("a")


def test_sync_load_max_tokens_must_be_an_int_ge_0():
    for bad in (-1, 1.5, True):  # checked once, by the config the steps take whole
        with pytest.raises(LedgerInputError, match="sync_load_max_tokens"):
            sched_config(max_pinned_blocks=8, sync_load_max_tokens=bad)


def test_kv_load_failure_policy_is_vllms_and_recompute_keeps_loads_async():
    """vLLM keeps a failed sync load's blocks in its prefix cache under "recompute": no load is sync there."""
    s = sched()
    with pytest.raises(LedgerInputError, match="config"):  # the steps take the checked config, nothing else
        SchedulerSteps({"kv_load_failure_policy": "retry"}, key_builders=s.steps.key_builders)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_load_failure_policy.*'retry'"):
        ConnectorConfig(store=StoreConfig(), block_size=BS, kv_load_failure_policy="retry")
    assert ConnectorConfig(store=StoreConfig(), block_size=BS).kv_load_failure_policy == "fail"  # vLLM's default
    r = sched(sync_load_max_tokens=1 << 10, policy="recompute")
    assert r.steps.load_is_async("a", 1) is True


def test_a_save_sharing_a_block_with_a_pinned_load_waits_then_is_retried():
    """Another request's save whose table holds a block a sync load still writes (vLLM's prefix cache shared
    it) is deferred, then retried once that load is reported, even in a step that does not schedule it."""
    s, req, n = _loaded(sync_max=1 << 10)
    s.steps.emit_load(req, [s.table["a"]], n)
    other = Req("b", 3 * BS + 1)
    s.steps.on_new_request(other)
    s.table["b"] = s.table["a"][:2] + s.alloc("b-own", 2)
    other.num_computed_tokens = 2 * BS
    assert s.step({"b": BS + 1}) == []
    assert s.ledger.num_inflight_jobs == 0 and s.steps.stats.total("saves_dropped") == 0
    other.num_computed_tokens = 3 * BS + 1
    s.steps.collect_sync_loads({"a": 1})
    (job,) = s.step({})
    assert job.req_id == "b" and s.ledger.pinned_block_ids(job.store_job_id) == s.table["b"][:3]


def test_a_sync_load_is_reported_in_worker_metadata_not_finished_recving():
    st = ProbeStore()
    w = rank(st)
    keys = w.block_shape().builders[0].keys(HASHES[:2])
    st.data.update({keys[0]: 1})
    res = w.run_load(io_of(w), "r", [4, 5], HASHES[:2], sync=True)
    w.run_load(io_of(w), "r", [6], HASHES[2:3], sync=True)  # a reused id's second load: reported a step later
    w.run_load(io_of(w), "q", [7], HASHES[3:4])  # an async one
    assert res.failed == {5} and w.take_load_errors() == {5, 6, 7}  # S8 all the same (6, 7 not stored)
    assert w.take_finished_sync_loads() == {"r": 1}
    assert w.take_finished_sync_loads() == {"r": 1}
    assert w.take_finished_sync_loads() == {}
    assert w.take_finished_loads() == {"q"}
    rej = w.reject_load("p", [8], "worker shut down", sync=True)
    assert rej.failed == {8} and w.take_finished_sync_loads() == {"p": 1}


def test_worker_metadata_sums_the_ranks_sync_loads_and_refuses_bad_counts():
    a = KVLedgerWorkerMetadata({1: 1}, {"r": 1})
    b = KVLedgerWorkerMetadata(None, {"r": 1, "q": 1})
    merged = a.aggregate(b)
    assert merged.completed_loads == {"r": 2, "q": 1} and merged.completed_saves == {1: 1}
    again = pickle.loads(pickle.dumps(merged))
    assert again.completed_loads == merged.completed_loads and again.completed_saves == merged.completed_saves
    for bad, field in (({"r": 0}, "completed_loads['r']"), ({"": 1}, "completed_loads key"),
                       ({5: 1}, "completed_loads key")):
        with pytest.raises(LedgerInputError, match=field.replace("[", r"\[")):
            KVLedgerWorkerMetadata(None, bad)  # type: ignore[arg-type]


def test_a_failed_block_caps_the_requests_later_lookups():
    """vLLM's invalid_block_ids, noted while the load still holds its pins: the request's next lookup stops
    before the first failed block (its key exists, its get failed); another request's lookup does not."""
    s, req, n = _loaded(sync_max=0, blocks=2)
    spec = s.steps.emit_load(req, [s.table["a"]], n)
    s.steps.note_load_errors({spec.block_ids[1], 999})  # 999: not a load's block (another connector's)
    s.steps.collect_loads(["a"])
    assert ask_store(s.steps, s.store, req, 0) == BS  # block 0 only
    other = Req("b", 3 * BS + 1)
    other.block_hashes = list(req.block_hashes)
    s.steps.on_new_request(other)
    assert ask_store(s.steps, s.store, other, 0) == 2 * BS
    s.steps.note_load_errors(None)
    s.steps.note_load_errors(set())


def _one_load(s, i: int, *, fail: bool, finished_first: bool = False) -> bool:
    """A new request loads 2 stored blocks (sync if the rule says so), fails or not, and is collected; its
    blocks go back to the pool (``finished_first``: vLLM ended the request, as "fail" does, before the
    connector is told of the failed block). Returns whether the load was sync."""
    req = Req(f"r{i}", 3 * BS + 1)
    s.steps.on_new_request(req)
    s.stored(req, 2)
    n = ask_store(s.steps, s.store, req, 0)
    blocks = s.alloc(req.request_id, 4)
    spec = s.steps.emit_load(req, [blocks], n)
    s.steps.take_loads()
    if finished_first:
        s.steps.request_finished(req)
    s.steps.note_load_errors({spec.block_ids[0]} if fail else None)
    if spec.sync:
        s.steps.collect_sync_loads({req.request_id: 1})
    else:
        s.steps.collect_loads([req.request_id])
    if not finished_first:
        s.steps.request_finished(req)
    s.pool.free_blocks(s.pool.blocks[b] for b in s.table.pop(req.request_id))
    return spec.sync


def test_short_loads_turn_async_while_most_recent_loads_fail_and_sync_again_once_they_succeed():
    """A failed sync load spends its get inside the step: while more than half of the last
    LOAD_OUTCOME_WINDOW loads failed, short loads are async; async outcomes count, so the rule recovers."""
    from kvledger_connector.scheduler.lookup import LOAD_OUTCOME_WINDOW
    s = sched(sync_load_max_tokens=1 << 10)
    assert _one_load(s, 0, fail=True, finished_first=True) is True  # no outcome yet: sync
    assert s.steps.loads_mostly_fail()
    assert _one_load(s, 1, fail=True) is False and s.steps.stats.total("async_after_failures") == 1
    for i in range(2, 2 + 3 * LOAD_OUTCOME_WINDOW):  # more outcomes than the window holds
        _one_load(s, i, fail=True)
    assert len(s.steps._load_outcomes) == LOAD_OUTCOME_WINDOW and not s.steps._failed_loads
    syncs = [_one_load(s, 100 + i, fail=False) for i in range(LOAD_OUTCOME_WINDOW)]
    assert syncs.index(True) == LOAD_OUTCOME_WINDOW // 2  # failures no longer more than half: sync again
    assert all(syncs[LOAD_OUTCOME_WINDOW // 2:]) and s.ledger.num_pinned_loads == 0
