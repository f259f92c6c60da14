"""LoadLedger: every attempted block ends loaded or reported (S8), including the upstream code-reading
bugs: an empty key list, and sub-batches after a failed one."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import LedgerInputError, LedgerInvariantError, ListTrace, LoadLedger, load_batch_keys, load_order, rotation
from kvledger.codes import classify_put, split_loaded

KB = 4096  # bytes of one key's object in these tests


def ld(**kw) -> LoadLedger:
    args = dict(max_inflight_loads=8)
    args.update(kw)
    return LoadLedger(0, **args)


def test_empty_key_list_finishes_without_error():
    """upstream: ``tp_rank % len(key_list)`` divided by zero before the request was marked finished."""
    for tp_rank in range(4):
        assert rotation(0, tp_rank) == 0 and load_order(0, tp_rank) == []
    led = ld()
    lid = led.begin_load("r", [])
    res = led.finish_load(lid)
    assert res.loaded == frozenset() and res.failed == frozenset()
    assert led.take_errors() == set() and led.num_inflight_loads == 0


def run_sub_batched(led: LoadLedger, block_ids, tp_rank, per_batch, fail_batch, mode):
    """A receive handler in the shape of upstream's, with the fix: after a failed sub-batch the rest of
    the load is reported (fail_pending). The store is simulated here to inject the failure."""
    lid = led.begin_load("r", block_ids)
    rot = [block_ids[i] for i in load_order(len(block_ids), tp_rank)]
    batches = [range(lo, min(lo + per_batch, len(rot))) for lo in range(0, len(rot), per_batch)]
    issued = []
    try:
        for i, rng in enumerate(batches):
            ids = [rot[k] for k in rng]
            issued.append(ids)
            if i == fail_batch and mode == "raise":
                raise RuntimeError("batch_get raised")
            codes = [-704 if (i == fail_batch and k == rng[-1]) else KB for k in rng]
            if led.record_results(lid, ids, codes, KB):
                break
    except RuntimeError:
        pass
    finally:
        led.fail_pending(lid, "sub-batch failed; later sub-batches not loaded")
        res = led.finish_load(lid)
    return res, issued


@pytest.mark.parametrize("tp_rank", [0, 1, 3])
@pytest.mark.parametrize("mode", ["code", "raise"])
def test_failing_middle_sub_batch_reports_every_unloaded_block(tp_rank, mode):
    blocks = list(range(100, 110))
    led = ld()
    res, issued = run_sub_batched(led, blocks, tp_rank, per_batch=3, fail_batch=1, mode=mode)
    assert [len(b) for b in issued] == [3, 3]
    errs = led.take_errors()
    assert res.loaded | res.failed == set(blocks) and not (res.loaded & res.failed)
    assert errs == set(res.failed)
    # the first sub-batch loaded; of the failing one, only the keys with a good code (none if it raised)
    expect = set(issued[0]) | (set(issued[1][:2]) if mode == "code" else set())
    assert res.loaded == expect
    assert len(res.failed) == 10 - len(expect)
    # with rotation the request's leading blocks sit in the last sub-batch: they must be reported
    assert blocks[0] in errs or blocks[0] in res.loaded
    assert led.take_errors() == set()


def test_finish_with_unreported_block_raises_s8_and_loses_nothing():
    led = ld()
    lid = led.begin_load("r", [1, 2, 3])
    led.record_results(lid, [1], [KB], KB)
    with pytest.raises(LedgerInvariantError) as e:
        led.finish_load(lid)
    assert e.value.invariant_id == "S8" and "[2, 3]" in str(e.value)
    assert led.pending(lid) == [2, 3]
    assert led.fail_pending(lid, "x") == [2, 3]
    assert led.finish_load(lid).failed == {2, 3}


def test_failing_the_whole_load_reports_every_block():
    led = ld()
    lid = led.begin_load("r", [5, 6, 7])
    led.fail_pending(lid, "key larger than the staging budget")
    assert led.finish_load(lid).failed == {5, 6, 7}
    assert led.take_errors() == {5, 6, 7}


def test_negative_codes_report_exact_blocks_under_rotation():
    blocks = [11, 12, 13, 14]
    led = ld()
    lid = led.begin_load("r", blocks)
    rot = [blocks[i] for i in load_order(4, 2)]
    assert rot == [13, 14, 11, 12]
    failed = led.record_results(lid, rot, [KB, -800, KB, -704], KB)
    assert failed == [(14, -800), (12, -704)]
    led.finish_load(lid)
    assert led.take_errors() == {12, 14}


@pytest.mark.parametrize("code", [KB - 1, 1, 0, KB + 1, -704, -800, -900, -600])
def test_only_a_whole_read_is_loaded(code):
    """Mooncake's batch_get answers bytes read or a negative code: a short read (or 0 bytes, or more than
    the key's object) is a failure like a negative code, never a loaded block (S8)."""
    led = ld()
    lid = led.begin_load("r", [1, 2, 3])
    assert led.record_results(lid, [1, 2, 3], [KB, code, KB], KB) == [(2, code)]
    res = led.finish_load(lid)
    assert res.loaded == {1, 3} and res.failed == {2}
    assert led.take_errors() == {2}


@pytest.mark.parametrize("codes,stored,pressure", [
    ([0, 0, 0], True, False), ([], True, False), ([0, -800, 0], False, False), ([-800, 0], False, False),
    ([0, 0, -200], False, True), ([-200, -900], False, True), ([0, 5], False, False)])
def test_a_put_batch_is_stored_only_if_every_key_is(codes, stored, pressure):
    out = classify_put(codes, len(codes))
    assert (out.stored, out.pressure) == (stored, pressure)
    assert out.failed_codes == tuple(c for c in codes if c != 0)


def test_result_lists_of_the_wrong_length_are_refused():
    with pytest.raises(LedgerInputError) as e:
        classify_put([0], 2)
    assert e.value.field == "batch_put codes" and e.value.value == 1
    with pytest.raises(LedgerInputError) as e:
        split_loaded([1, 2], [KB], KB)
    assert e.value.field == "batch_get codes"
    with pytest.raises(LedgerInputError) as e:
        split_loaded([1], [KB], 0)
    assert e.value.field == "key_bytes"


def test_failed_block_stays_failed_after_late_ok():
    led = ld()
    lid = led.begin_load("r", [1, 2])
    led.record_failed(lid, [1], "x")
    led.record_ok(lid, [1, 2])
    assert led.finish_load(lid).failed == {1}


def test_blocks_not_attempted_are_rejected():
    led = ld()
    lid = led.begin_load("r", [1, 2])
    with pytest.raises(LedgerInputError) as e:
        led.record_ok(lid, [3])
    assert e.value.field == "block_ids" and e.value.value == [3]
    with pytest.raises(LedgerInputError):
        led.record_results(lid, [1, 2], [0], KB)


def test_unknown_load_and_bad_block_ids():
    led = ld()
    with pytest.raises(LedgerInputError) as e:
        led.finish_load(3)
    assert e.value.field == "load_id"
    with pytest.raises(LedgerInputError) as e:
        led.begin_load("r", [1, -2])
    assert e.value.value == [-2]


def test_bound_on_inflight_loads():
    led = ld(max_inflight_loads=2)
    led.begin_load("a", [1])
    led.begin_load("b", [2])
    with pytest.raises(LedgerInputError) as e:
        led.begin_load("c", [3])
    assert e.value.field == "max_inflight_loads"


def test_bound_on_untaken_error_blocks():
    led = ld(max_error_blocks=3)
    lid = led.begin_load("a", [1, 2, 3, 4])
    led.record_failed(lid, [1, 2, 3], "x")
    with pytest.raises(LedgerInputError) as e:
        led.record_failed(lid, [4], "x")
    assert e.value.field == "max_error_blocks"
    assert led.pending(lid) == [4]          # nothing lost: still pending
    led.take_errors()
    led.fail_pending(lid, "x")
    assert led.finish_load(lid).failed == {1, 2, 3, 4}


def test_load_trace_event():
    tr = ListTrace()
    led = LoadLedger(2, max_inflight_loads=2, trace=tr)
    lid = led.begin_load("r", [1, 2])
    led.record_results(lid, [1, 2], [KB, -704], KB)
    led.finish_load(lid)
    led.take_errors()
    assert tr.actions() == ["Load", "HandleLoadErrors"]
    assert tr.events[0]["failed"] == [2] and tr.events[1]["blocks"] == [2]


@given(n=st.integers(0, 40), tp=st.integers(0, 16))
def test_load_order_is_a_rotation(n, tp):
    order = load_order(n, tp)
    assert sorted(order) == list(range(n))
    assert all(order[i] == (i + rotation(n, tp)) % n for i in range(n))
    assert n == 0 or order[0] == tp % n


@given(n=st.integers(0, 20), tp=st.integers(0, 7), fail_at=st.integers(0, 25),
       raise_=st.booleans(), budget_keys=st.integers(1, 6))
def test_any_failure_point_leaves_every_block_loaded_or_reported(n, tp, fail_at, raise_, budget_keys):
    blocks = list(range(1, n + 1))
    led = ld()
    lid = led.begin_load("r", blocks)
    rot = [blocks[i] for i in load_order(n, tp)]
    try:
        for lo in range(0, n, budget_keys):
            rng = range(lo, min(lo + budget_keys, n))
            ids = [rot[k] for k in rng]
            if raise_ and fail_at in rng:
                raise RuntimeError
            codes = [-1 if k == fail_at else KB for k in rng]
            if led.record_results(lid, ids, codes, KB):
                break
    except RuntimeError:
        pass
    led.fail_pending(lid, "rest")
    res = led.finish_load(lid)
    assert res.loaded | res.failed == set(blocks)
    assert led.take_errors() == set(res.failed)


def test_a_block_of_several_keys_is_loaded_only_when_every_key_is():
    """The TP-shared layout stores a block as one key per head shard: one key read is not the block loaded,
    a later key's failure fails it, and a load cut short reports a block with only some keys read (S8)."""
    led = ld()
    lid = led.begin_load("r", [4, 5, 6], keys_per_block=2)
    led.record_results(lid, [4, 5, 6], [KB, KB, KB], KB)  # each block's first key
    assert led.pending(lid) == [4, 5, 6]
    bad = led.record_results(lid, [4, 5], [KB, -704], KB)  # 4 whole; 5's second key missing
    assert bad == [(5, -704)] and led.pending(lid) == [6]
    with pytest.raises(LedgerInvariantError):
        led.finish_load(lid)  # 6 has one key of two: neither loaded nor reported
    assert led.fail_pending(lid, "cut short") == [6]
    res = led.finish_load(lid)
    assert res.loaded == frozenset({4}) and res.failed == frozenset({5, 6})
    assert led.take_errors() == {5, 6}
    with pytest.raises(LedgerInputError):
        led.begin_load("r", [1], keys_per_block=0)


def test_a_load_batch_fits_the_tiers_staging_buffer():
    """With the disk tier one batch get's disk reads come through the owner's staging buffer, where every
    rank of the engine may read at once: the keys per get shrink to fit it, and a buffer that cannot hold one
    key per rank is refused by name. Without the tier `load_sub_batch_keys` stands."""
    mib = 1 << 20
    staging = 64 * mib
    assert load_batch_keys(64, 2 * mib, 2) == 64  # no tier
    assert load_batch_keys(64, 2 * mib, 1, staging) == 32
    assert load_batch_keys(64, 2 * mib, 2, staging) == 16
    assert load_batch_keys(8, 2 * mib, 2, staging) == 8
    assert load_batch_keys(64, 64 * mib, 1, staging) == 1
    with pytest.raises(LedgerInputError, match="disk_offload_staging_size.*at least 134217728"):
        load_batch_keys(64, 64 * mib, 2, staging)
    with pytest.raises(LedgerInputError, match="readers"):
        load_batch_keys(64, mib, 0, staging)
