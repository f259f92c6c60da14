"""The connector's per-job step functions (kvledger_connector/worker/steps.py), the code both the connector's
threads and the conformance driver run. The probes (conformance/kvprobes.py) are the scenarios the
mutant table runs; here they run on the unmutated runtime, plus the steps' input checks. The store is
the probes' scripted in-memory one: it injects per-key faults (a failing key, a short read, a raising
call) deterministically."""
from __future__ import annotations

import pytest

from conformance import kvprobes
from conformance.kvprobes import io_of, HASHES, KEY_BYTES, ProbeStore, rank
from kvledger.errors import LedgerInputError, LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.worker import WorkerLedger
from kvledger_connector.worker.base import MAX_ERRORS_KEPT
from kvledger_connector.worker.cache import RegisteredCache
from kvledger_connector.worker.loads import load_pairs
from kvledger_connector.worker.steps import WorkerSteps


@pytest.mark.parametrize("probe", kvprobes.PROBES, ids=lambda p: p.__name__)
def test_probe(probe):
    probe()


def test_run_probes_names_the_failing_probe(monkeypatch):
    def broken(*a, **k):
        raise kvprobes.ProbeFailed("seen")
    monkeypatch.setattr(kvprobes, "PROBES", [kvprobes.probe_pin_cap_boundary, broken])
    assert kvprobes.run_probes() == kvprobes.ProbeRun(("broken", "ProbeFailed: seen"), [])


def test_a_named_invariant_fails_a_probe_and_any_other_exception_is_a_crash():
    """A crash (here: an attribute a patch renamed) is no finding: it is noted, the next probes still run,
    and only a named check (ProbeFailed, LedgerInvariantError) counts as a failure."""
    def renamed():
        return kvprobes.ProbeStore().no_such_call
    def invariant():
        raise LedgerInvariantError.of("S5", "seen")
    run = kvprobes.run_probes([renamed, kvprobes.probe_pin_cap_boundary, invariant])
    assert run.failed == ("invariant", "LedgerInvariantError: S5 ReportedOnce: seen")
    assert [n for n, _ in run.crashes] == ["renamed"] and "AttributeError" in run.crashes[0][1]
    crash_only = kvprobes.run_probes([renamed])
    assert crash_only.failed is None and len(crash_only.crashes) == 1


def test_a_save_with_everything_present_puts_nothing_and_is_stored():
    st = ProbeStore()
    w = rank(st)
    st.data.update({k: 7 for k in w.block_shape().builders[0].keys(HASHES[:2])})
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    assert [c[0] for c in st.calls] == ["batch_is_exist"]
    assert w.ledger.request("r").saved_offset == 2 * kvprobes.BLOCK_SIZE


def test_a_partial_tail_is_put_but_the_saved_offset_stops_before_it():
    """A job whose last block is the prompt's partial tail (SaveSpec.tail_tokens > 0) puts every block it
    covers, tail included, but the rank's saved offset moves only to the end of the full blocks: if decode
    fills that block later, a save_decode job puts it whole under its full-block key."""
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2, 3: 3})
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 3, [1, 2, 3], HASHES[:3], None, 2)
    assert w.take_reports() == {1: 1}
    assert [c[0] for c in st.calls] == ["batch_is_exist", "batch_put"] and len(st.calls[1][1]) == 3
    assert w.ledger.request("r").saved_offset == 2 * kvprobes.BLOCK_SIZE
    w.receive("r", 2, 0)  # the next job (block 2 now full) starts at block 2 again
    w.run_save(io_of(w), "r", 2, 3, [1, 2, 3], HASHES[:3])
    assert w.ledger.request("r").saved_offset == 3 * kvprobes.BLOCK_SIZE


def test_two_finished_loads_of_one_req_id_are_reported_in_two_steps():
    """vLLM's finished_recving is a set: a reused req_id whose two loads both finished before a step takes
    them is reported once per step, so the scheduler releases both load pins (one per report)."""
    st = ProbeStore()
    w = rank(st)
    w.run_load(io_of(w), "r", [4], HASHES[:1])
    w.run_load(io_of(w), "r", [5], HASHES[1:2])
    w.run_load(io_of(w), "q", [6], HASHES[2:3])
    assert w.take_finished_loads() == {"r", "q"}
    assert w.take_finished_loads() == {"r"}
    assert w.take_finished_loads() == set()


def test_every_sub_batch_is_tried_after_a_failed_one():
    st = ProbeStore()
    w = rank(st, sub_batch=1)
    keys = w.block_shape().builders[0].keys(HASHES[:3])
    st.data.update({keys[0]: 1, keys[2]: 3})
    res = w.run_load(io_of(w), "r", [4, 5, 6], HASHES[:3])
    assert [c[0] for c in st.calls] == ["batch_get"] * 3
    assert res.loaded == {4, 6} and res.failed == {5}


def test_an_empty_load_finishes():
    w = rank(ProbeStore())
    res = w.run_load(io_of(w), "r", [], [])
    assert res.loaded == res.failed == frozenset()
    assert w.take_finished_loads() == {"r"}


def test_a_rejected_load_reports_every_block():
    w = rank(ProbeStore())
    res = w.reject_load("r", [3, 4], "queue full")
    assert res.failed == {3, 4} and w.take_load_errors() == {3, 4}


@pytest.mark.parametrize("tp_rank", [0, 1, 2, 5])
def test_load_pairs_keep_each_block_with_its_key(tp_rank):
    keys = ["k0", "k1", "k2"]
    pairs = load_pairs(keys, [10, 11, 12], tp_rank)
    assert sorted(pairs) == [("k0", 10), ("k1", 11), ("k2", 12)]
    assert pairs[0][0] == keys[tp_rank % 3]


def test_bad_settings_and_inputs_name_the_field():
    kw = dict(ledger=WorkerLedger(0, max_live_jobs=2), loads=LoadLedger(0, max_inflight_loads=2), tp_rank=0)
    cache = RegisteredCache(lambda ids, parts: ([], []), None, key_bytes=KEY_BYTES)
    with pytest.raises(LedgerInputError) as e:  # the steps take the connector's config, checked whole
        WorkerSteps({"block_size": 16}, cache, **kw)  # type: ignore[arg-type]
    assert e.value.field == "config"
    with pytest.raises(LedgerInputError) as e:  # and the registered KV cache, one value
        WorkerSteps(kvprobes.worker_config(16), {"key_bytes": KEY_BYTES}, **kw)  # type: ignore[arg-type]
    assert e.value.field == "cache"
    with pytest.raises(LedgerInputError) as e:
        RegisteredCache(cache.buffers, -1)
    assert e.value.field == "num_blocks"
    w = kvprobes.with_edge(WorkerSteps(kvprobes.worker_config(16), cache, **kw), ProbeStore())
    with pytest.raises(LedgerInputError) as e:
        next(w.put(["a", "b"], [1]))  # checked before its first store call
    assert e.value.field == "ids"
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 1, [1], [b"\x01"])  # no KeyBuilder: the job fails, and is reported all the same
    assert w.take_reports() == {1: 1}
    assert any("field keys" in e or "KeyBuilder" in e for e in w.errors), w.errors


def test_kept_errors_are_bounded():
    w = rank(ProbeStore())
    for i in range(MAX_ERRORS_KEPT + 5):
        w.note_error(f"e{i}")
    assert len(w.errors) == MAX_ERRORS_KEPT
