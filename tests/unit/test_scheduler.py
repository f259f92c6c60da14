"""SchedulerLedger on vLLM's real BlockPool: pins, the cap, collect, tail-first release."""
from __future__ import annotations

import pytest

from kvledger import LedgerInputError, LedgerInvariantError, ListTrace, SchedulerLedger
from tests.unit.conftest import alloc, make_pool, refs


def ledger(pool, **kw):
    args = dict(world_size=1, max_inflight_jobs=16, max_pinned_blocks=256)
    args.update(kw)
    return SchedulerLedger(pool, **args)


def test_null_block_id_agrees_with_vllm():
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    from kvledger import NULL_BLOCK_ID as OURS
    assert OURS == NULL_BLOCK_ID


def test_real_block_pool_satisfies_protocol_signatures():
    import inspect

    from vllm.v1.core.block_pool import BlockPool
    assert list(inspect.signature(BlockPool.touch).parameters) == ["self", "blocks"]
    assert list(inspect.signature(BlockPool.free_blocks).parameters) == ["self", "ordered_blocks"]


def test_open_job_pins_every_block_dedup_in_order_with_cow_tail(pool):
    table = alloc(pool, 4)
    cow = alloc(pool, 1)
    s = ledger(pool)
    job = s.open_job("r", table + [table[1]], tail_block_ids=[cow[0], table[0]])
    assert job == 0
    assert s.pinned_block_ids(job) == table + cow
    assert refs(pool, table + cow) == [2] * 5
    assert pool.blocks[0].ref_cnt == 0 or pool.blocks[0].is_null  # null block untouched by us
    assert s.num_pinned_blocks == 5


def test_job_ids_are_monotonic_and_never_reused(pool):
    s = ledger(pool)
    t = alloc(pool, 2)
    ids = []
    for _ in range(5):
        j = s.open_job("r", t)
        ids.append(j)
        s.collect({j: 1})
    assert ids == [0, 1, 2, 3, 4]
    assert s.next_job_id == 5


def test_release_frees_tail_first_reverse_order(pool):
    t = alloc(pool, 4)
    s = ledger(pool)
    j = s.open_job("r", t)
    # the request itself frees its blocks (preemption): only the pin holds them now
    pool.free_blocks(reversed([pool.blocks[b] for b in t]))
    assert refs(pool, t) == [1, 1, 1, 1]
    before = pool.free_block_queue.num_free_blocks
    s.collect({j: 1})
    assert refs(pool, t) == [0, 0, 0, 0]
    assert pool.free_block_queue.num_free_blocks == before + 4
    # vLLM 0.32.0 puts freed blocks without a hash at the head of the free list in the order given; we
    # give them tail first, so the tail block is the first to be reused and the prefix survives longest.
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == t[::-1]


def test_preempted_request_blocks_stay_pinned_until_every_rank_reported(pool):
    """upstream 52360: preemption must not free blocks a store job still reads."""
    t = alloc(pool, 3)
    s = ledger(pool, world_size=2)
    j = s.open_job("r", t)
    pool.free_blocks(reversed([pool.blocks[b] for b in t]))  # Preempt(r)
    s.collect({j: 1})  # rank 0 reported
    assert refs(pool, t) == [1, 1, 1]
    assert s.has_pending_work()
    other = pool.get_new_blocks(pool.get_num_free_blocks())
    assert not set(t) & {b.block_id for b in other}, "a pinned block was handed to another request"
    s.collect({j: 1})  # rank 1 reported
    assert refs(pool, t) == [0, 0, 0]
    assert not s.has_pending_work()


def test_over_report_raises_reported_once_and_keeps_pin(pool):
    t = alloc(pool, 2)
    t2 = alloc(pool, 2)
    s = ledger(pool, world_size=2)
    j = s.open_job("r", t)
    j2 = s.open_job("r2", t2)
    with pytest.raises(LedgerInvariantError) as e:
        s.collect({j: 3, j2: 2})
    assert e.value.invariant_id == "S5" and e.value.name == "ReportedOnce"
    assert f"job {j}" in str(e.value)
    assert refs(pool, t) == [2, 2] and s.ranks_left(j) == 2  # kept: freeing early could poison
    assert refs(pool, t2) == [1, 1] and j2 not in s.inflight_jobs()  # the good entry was applied


def test_over_report_split_over_two_collects(pool):
    t = alloc(pool, 1)
    s = ledger(pool, world_size=1)
    j = s.open_job("r", t)
    s.collect({j: 1})
    # j is released; a second report for it is an unknown id now (ignored, counted)
    s.collect({j: 1})
    assert s.counts.total("unknown_reports") == 1


def test_unknown_job_ids_are_ignored_and_counted(pool):
    t = alloc(pool, 2)
    s = ledger(pool)
    j = s.open_job("r", t)
    assert s.collect({999: 1, j: 1, "x": 1}) == 1
    assert s.counts.total("unknown_reports") == 2
    assert refs(pool, t) == [1, 1]


@pytest.mark.parametrize("count", [0, -1, 1.0, True, "1", None])
def test_bad_report_counts_name_the_field(pool, count):
    t = alloc(pool, 2)
    s = ledger(pool)
    j = s.open_job("r", t)
    with pytest.raises(LedgerInputError) as e:
        s.collect({j: count})
    assert e.value.field == f"completed[{j}]" and e.value.value == count
    assert refs(pool, t) == [2, 2] and s.ranks_left(j) == 1


def test_cap_on_jobs_defers_then_resumes(pool):
    s = ledger(pool, max_inflight_jobs=2)
    tables = [alloc(pool, 2) for _ in range(3)]
    a = s.open_job("a", tables[0])
    b = s.open_job("b", tables[1])
    assert s.open_job("c", tables[2]) is None  # DEFER: nothing pinned, no id used
    assert refs(pool, tables[2]) == [1, 1]
    assert s.next_job_id == 2 and s.stats()["jobs_opened"] == 2
    s.collect({a: 1})
    c = s.open_job("c", tables[2])
    assert c == 2 and refs(pool, tables[2]) == [2, 2]
    assert s.peak_inflight_jobs == 2
    s.collect({b: 1, c: 1})
    assert not s.has_pending_work()


def test_cap_on_pinned_blocks_defers_then_resumes(pool):
    s = ledger(pool, max_pinned_blocks=5)
    t1, t2 = alloc(pool, 3), alloc(pool, 3)
    j1 = s.open_job("a", t1)
    assert s.open_job("b", t2) is None
    assert s.num_pinned_blocks == 3 and s.peak_pinned_blocks == 3
    s.collect({j1: 1})
    assert s.open_job("b", t2) == 1
    assert s.peak_pinned_blocks == 3


def test_job_larger_than_cap_is_a_clear_error(pool):
    s = ledger(pool, max_pinned_blocks=2)
    t = alloc(pool, 3)
    with pytest.raises(LedgerInputError) as e:
        s.open_job("r", t)
    assert "max_pinned_blocks=2" in str(e.value)
    assert refs(pool, t) == [1, 1, 1]


@pytest.mark.parametrize("bad", [[0], [-1], [64], [10**9], ["3"]])
def test_block_ids_outside_pool_rejected_nothing_pinned(pool, bad):
    t = alloc(pool, 2)
    s = ledger(pool)
    with pytest.raises(LedgerInputError) as e:
        s.open_job("r", t + bad)
    assert e.value.field == "block_ids"
    assert refs(pool, t) == [1, 1] and s.num_inflight_jobs == 0 and s.next_job_id == 0


def test_the_null_block_is_refused_in_the_tail_too_nothing_pinned(pool):
    t = alloc(pool, 2)
    s = ledger(pool)
    with pytest.raises(LedgerInputError, match="null block") as e:
        s.open_job("r", t, tail_block_ids=[0])
    assert e.value.field == "block_ids" and e.value.value == [0]
    assert refs(pool, t) == [1, 1] and s.num_inflight_jobs == 0 and s.next_job_id == 0


def test_empty_job_is_tracked_until_reported(pool):
    s = ledger(pool, world_size=2)
    j = s.open_job("r", [])
    assert j == 0 and s.pinned_block_ids(j) == [] and s.has_pending_work()
    s.collect({j: 2})
    assert not s.has_pending_work() and s.counts.total("unknown_reports") == 0


@pytest.mark.parametrize("field,val", [("world_size", 0), ("max_inflight_jobs", -1),
                                       ("max_pinned_blocks", 1.5), ("world_size", True)])
def test_bad_config_names_field(pool, field, val):
    kw = dict(world_size=1, max_inflight_jobs=1, max_pinned_blocks=1)
    kw[field] = val
    with pytest.raises(LedgerInputError) as e:
        SchedulerLedger(pool, **kw)
    assert e.value.field == field


def test_pool_without_protocol_rejected():
    with pytest.raises(LedgerInputError) as e:
        SchedulerLedger(object(), world_size=1, max_inflight_jobs=1, max_pinned_blocks=1)
    assert e.value.field == "block_pool"


def test_release_all_frees_everything(pool):
    s = ledger(pool, world_size=2)
    t = alloc(pool, 3)
    s.open_job("a", t)
    s.open_job("b", t)
    assert refs(pool, t) == [3, 3, 3]
    assert s.release_all() == 2
    assert refs(pool, t) == [1, 1, 1] and s.num_pinned_blocks == 0


def test_trace_events_carry_the_abstract_state(pool):
    tr = ListTrace()
    s = ledger(pool, world_size=2, trace=tr)
    t = alloc(pool, 2)
    j = s.open_job("r", t)
    s.collect({j: 1, 77: 1})
    s.collect({j: 1})
    assert tr.actions() == ["EmitStore", "Collect", "Collect"]
    e0, e1, e2 = tr.events
    assert e0["blocks"] == t and e0["ranks_left"] == 2 and e0["req_id"] == "r"
    assert e1["ranks_left"] == {str(j): 1} and e1["unknown"] == [77] and e1["released"] == []
    assert e2["released"] == [j] and e2["pinned_jobs"] == 0


def test_emit_store_event_lists_the_tail_pinned_last(pool):
    tr = ListTrace(check=True)
    s = ledger(pool, trace=tr)
    t, tail = alloc(pool, 2), alloc(pool, 1)
    s.open_job("r", t, tail_block_ids=[t[0]] + tail)  # a table block is not the tail
    s.open_job("q", t)
    e0, e1 = tr.events
    assert e0["blocks"] == t + tail and e0["tail"] == tail
    assert e1["blocks"] == t and e1["tail"] == []


def test_stats(pool):
    s = ledger(pool)
    s.open_job("r", alloc(pool, 2))
    st = s.stats()
    assert st["inflight_jobs"] == 1 and st["pinned_blocks"] == 2 and st["jobs_opened"] == 1
