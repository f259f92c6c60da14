"""SchedulerLedger's load pins (EmitLoad .. CollectLoad, S9 LoadsPinned) on vLLM's real BlockPool."""
from __future__ import annotations

import pytest

from kvledger import LedgerInputError, LedgerInvariantError, ListTrace, SchedulerLedger
from tests.unit.conftest import alloc, make_pool, refs


def ledger(pool, **kw):
    args = dict(world_size=2, max_inflight_jobs=4, max_pinned_blocks=64)
    args.update(kw)
    return SchedulerLedger(pool, **args)


def test_load_pin_holds_blocks_of_an_aborted_request_until_every_rank_finished(pool):
    dest = alloc(pool, 3)
    s = ledger(pool)
    s.pin_load("r", dest)
    assert refs(pool, dest) == [2, 2, 2] and s.has_pending_work()
    # the request is aborted mid-load: vLLM frees its blocks at once
    pool.free_blocks(reversed([pool.blocks[b] for b in dest]))
    assert refs(pool, dest) == [1, 1, 1]
    free_before = pool.get_num_free_blocks()
    assert s.collect_loads({"r": 1}) == 0  # one rank of two: still pinned
    assert refs(pool, dest) == [1, 1, 1] and s.load_ranks_left("r") == 1
    assert s.collect_loads({"r": 1}) == 1
    assert refs(pool, dest) == [0, 0, 0] and pool.get_num_free_blocks() == free_before + 3
    assert not s.has_pending_work() and s.num_pinned_loads == 0 and s.num_load_pinned_blocks == 0


def test_load_release_is_tail_first(pool):
    dest = alloc(pool, 3)
    s = ledger(pool, world_size=1)
    s.pin_load("r", dest)
    pool.free_blocks(reversed([pool.blocks[b] for b in dest]))
    s.collect_loads({"r": 1})
    # as a store job's release (vLLM 0.32.0 puts blocks without a hash at the head of the free list in
    # the order given): the tail block is the first to be reused
    assert [b.block_id for b in pool.get_new_blocks(3)] == dest[::-1]


def test_unknown_and_duplicate_load_reports_raise_named_errors_and_keep_pins(pool):
    dest = alloc(pool, 2)
    s = ledger(pool)
    s.pin_load("r", dest)
    with pytest.raises(LedgerInputError) as e:
        s.collect_loads({"nope": 2})
    assert e.value.field == "completed" and e.value.value == "nope"
    with pytest.raises(LedgerInvariantError) as e:
        s.collect_loads({"r": 3})  # more ranks than ranks_left: a duplicate report
    assert e.value.invariant_id == "S9" and e.value.name == "LoadsPinned"
    assert refs(pool, dest) == [2, 2] and s.load_ranks_left("r") == 2
    with pytest.raises(LedgerInputError):
        s.collect_loads({"r": 0})
    assert s.collect_loads({"r": 2}) == 1
    with pytest.raises(LedgerInputError):
        s.collect_loads({"r": 2})  # reported again after the release: no pinned load
    assert refs(pool, dest) == [1, 1]


def test_bad_load_inputs_pin_nothing(pool):
    s = ledger(pool)
    for ids in ([], [0], [10_000], [-1], ["3"]):
        with pytest.raises(LedgerInputError) as e:
            s.pin_load("r", ids)
        assert e.value.field == "block_ids"
    b = alloc(pool, 1)
    with pytest.raises(LedgerInputError):
        s.pin_load("r", b + b)
    assert refs(pool, b) == [1] and s.num_pinned_loads == 0


def test_load_pin_bound_one_pinned_load_per_block_hits_the_pool_size():
    """The bound of load pins: a block is the destination of at most one pinned load (S9), so load-pinned
    blocks never exceed the pool. Pin every block of a small pool, then one more load of any block."""
    pool = make_pool(9)  # 8 usable blocks + the null block
    s = ledger(pool)
    blocks = alloc(pool, 8)
    for i, b in enumerate(blocks):
        s.pin_load(f"r{i}", [b])
    assert s.num_load_pinned_blocks == 8 == len(pool.blocks) - 1 and s.peak_load_pinned_blocks == 8
    with pytest.raises(LedgerInvariantError) as e:
        s.pin_load("late", [blocks[3]])
    assert e.value.invariant_id == "S9" and "r3" in str(e.value)
    assert refs(pool, blocks) == [2] * 8 and s.num_pinned_loads == 8


def test_reused_req_id_loads_release_oldest_first(pool):
    old, new = alloc(pool, 1), alloc(pool, 1)
    s = ledger(pool, world_size=1)
    s.pin_load("r", old)
    s.pin_load("r", new)  # the id came back while its old load is still in flight
    assert s.num_pinned_loads == 2 and s.load_pinned_block_ids("r") == old
    s.collect_loads({"r": 1})
    assert refs(pool, old) == [1] and refs(pool, new) == [2] and s.load_pinned_block_ids("r") == new


def test_release_all_drops_load_pins(pool):
    s = ledger(pool)
    dest = alloc(pool, 2)
    j = s.open_job("s", alloc(pool, 1))
    s.pin_load("r", dest)
    assert s.release_all() == 1 and j is not None
    assert refs(pool, dest) == [1, 1] and not s.has_pending_work()
    assert s.stats()["loads_released"] == 1 and s.stats()["pinned_loads"] == 0


def test_load_pins_are_traced():
    pool = make_pool(16)
    tr = ListTrace()
    s = ledger(pool, trace=tr)
    dest = alloc(pool, 2)
    s.pin_load("r", dest)
    s.collect_loads({"r": 1})
    s.collect_loads({"r": 1})
    e0, e1, e2 = tr.events
    assert (e0["action"], e0["actor"], e0["req_id"], e0["blocks"]) == ("EmitLoad", "sched", "r", dest)
    assert e0["ranks_left"] == 2 and e0["pinned_loads"] == 1 and e0["load_pinned_blocks"] == 2
    assert e1["action"] == "CollectLoad" and e1["released"] == [] and e1["ranks_left"] == {"r": 1}
    assert e2["released"] == ["r"] and e2["pinned_loads"] == 0 and e2["load_pinned_blocks"] == 0


def test_load_pins_do_not_count_against_the_store_cap(pool):
    """Load pins have their own bound (above): the store cap defers saves, and a load cannot be deferred
    (vLLM allocated its blocks already)."""
    s = ledger(pool, max_inflight_jobs=1, max_pinned_blocks=2)
    s.pin_load("r", alloc(pool, 3))
    assert s.open_job("s", alloc(pool, 2)) is not None
