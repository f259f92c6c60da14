"""The reset's removals (kvledger_connector/scheduler/reset.py `StoreRemovals`, `reset_scheduler_side`; the gate is
`kvledger_connector.store.deadline.DeadlineStore`'s):
each removal tried at most REMOVAL_ATTEMPTS times with waits doubling to their cap, at most
MAX_PENDING_REMOVALS waiting (the oldest dropped), never a store call on the caller's thread, the gate lifted
only by a removal that began after it, and a reset that cannot switch refused by name. The store here is a
test double (the integration tests run the same on a real master: tests/integration/test_reset_cache.py)."""
from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from conformance.kvprobes import quiet
from conformance.probes_sched import sched
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.scheduler.reset import (
    MAX_PENDING_REMOVALS,
    REMOVAL_ATTEMPTS,
    StoreRemovals,
    engine_key_regex,
    removal_backoff_s,
    reset_scheduler_side,
)
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.client import StoreCode


class Removing:
    """THIS IS A TEST DOUBLE: a store whose `remove_by_regex` answers the next of ``codes`` (then the last
    one again), recording each pattern; with ``hold`` set, each call waits for ``release`` first (bounded)."""

    def __init__(self, *codes: int, hold: bool = False, keys: set[str] | None = None) -> None:
        self.codes = list(codes) or [0]
        self.calls: list[str] = []
        self.keys = keys or set()
        self.hold = hold
        self.entered = threading.Event()
        self.release = threading.Event()

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        self.calls.append(regex)
        if self.hold:
            self.entered.set()
            self.release.wait(10)
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.keys else 0 for k in keys]


class Waits:
    """THIS IS A TEST DOUBLE: `StoreRemovals.wait` recording each backoff, returning at once (not stopped)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False


FAIL = int(StoreCode.RPC_FAIL)


def _removals(store: Removing) -> tuple[StoreRemovals, Waits, StatsRecorder]:
    waits, stats = Waits(), StatsRecorder()
    return StoreRemovals(store, stats=stats, background=False, wait=waits), waits, stats


def test_a_failing_removal_is_tried_at_most_removal_attempts_times_with_capped_backoff():
    store = Removing(FAIL)
    removals, waits, stats = _removals(store)
    removals.submit("^a$", gate=False)
    with quiet():
        removals.run_pending()
    assert store.calls == ["^a$"] * REMOVAL_ATTEMPTS
    assert waits.waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0][:REMOVAL_ATTEMPTS - 1]
    assert waits.waits[-1] == removal_backoff_s(REMOVAL_ATTEMPTS - 1) == 30.0  # the cap is reached
    assert stats.total("reset_removals_given_up") == 1 and stats.total("reset_removals") == 0
    assert stats.total("reset_removal_retries") == REMOVAL_ATTEMPTS - 1


def test_a_removal_that_succeeds_on_a_retry_counts_its_keys():
    store = Removing(FAIL, FAIL, 7)
    removals, waits, stats = _removals(store)
    removals.submit("^a$", gate=True)
    with quiet():
        removals.run_pending()
    assert len(store.calls) == 3 and waits.waits == [1.0, 2.0]
    assert (stats.total("reset_removals"), stats.total("reset_removed_keys"), removals.gated) == (1, 7, False)
    assert stats.total("reset_removed_keys") == 7 and stats.total("reset_removals_given_up") == 0


def test_pending_removals_are_bounded_oldest_dropped():
    store = Removing(0)
    removals, _, stats = _removals(store)
    with quiet():
        for i in range(MAX_PENDING_REMOVALS + 1):
            removals.submit(f"^p{i}$", gate=False)
        removals.submit(f"^p{MAX_PENDING_REMOVALS}$", gate=False)  # already waiting: not a new one
    assert removals.num_pending == MAX_PENDING_REMOVALS
    assert stats.total("reset_removals_dropped") == 1
    removals.run_pending()
    assert store.calls == [f"^p{i}$" for i in range(1, MAX_PENDING_REMOVALS + 1)]  # oldest first, p0 dropped


def test_the_gate_lifts_only_for_a_removal_begun_after_it():
    """A reset while the previous reset's removal of the same keys is inside the store: keys saved between
    the two may hold KV of the first update, so that removal's success must not lift the second's gate."""
    store = Removing(3, hold=True)
    removals = StoreRemovals(store, wait=Waits())
    try:
        removals.submit("^k$", gate=True)
        assert store.entered.wait(10)  # the first removal is inside the store
        removals.submit("^k$", gate=True)  # the second reset
        store.hold = False
        store.release.set()
        assert removals.wait_idle(10)
        assert store.calls == ["^k$", "^k$"] and removals.gated is False
    finally:
        removals.stop()

    store = Removing(3, hold=True)
    removals = StoreRemovals(store, wait=Waits())
    try:
        removals.submit("^k$", gate=True)
        assert store.entered.wait(10)
        removals.submit("^k$", gate=True)
        store.codes = [3, FAIL]  # the first succeeds, every try of the second fails
        store.hold = False
        with quiet():
            store.release.set()
            assert removals.wait_idle(10)
        assert removals.counts.total("reset_removals") == 1 and removals.counts.total("reset_removals_given_up") == 1
        assert removals.gated is True  # the first removal's success did not lift the second reset's gate
    finally:
        removals.stop()


def test_submit_returns_while_the_removal_is_inside_the_store_and_stop_ends_the_retries():
    store = Removing(FAIL, hold=True)
    removals = StoreRemovals(store)  # the real backoff wait: cut short by stop()
    removals.submit("^k$", gate=True)  # returns at once: the call is on the removal thread
    assert store.entered.wait(10) and removals.gated
    removals.stop()
    store.release.set()
    thread = removals._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert store.calls == ["^k$"] and removals.counts.total("reset_removals_given_up") == 0  # no retry after stop


def test_the_gate_answers_missing_only_while_gated():
    store = Removing(0, keys={"a", "b"})
    removals, _, _ = _removals(store)
    gate = DeadlineStore(store, 10.0, gate=removals)
    try:
        assert gate.batch_is_exist(["a", "c"]) == [1, 0]
        removals.submit("^a$", gate=True)
        assert gate.batch_is_exist(["a", "c"]) == [0, 0] and gate.untimed().batch_is_exist(["a"]) == [0]
        with quiet():
            removals.run_pending()
        assert gate.batch_is_exist(["a", "b"]) == [1, 1]
        assert gate.keys == {"a", "b"}  # every other attribute is the store's
        assert gate.counts.total("lookup_s") > 0  # three prefix lookups timed, the untimed check not
    finally:
        gate.stop()


def test_bad_inputs_are_refused_by_name():
    removals, _, _ = _removals(Removing(0))
    with pytest.raises(ValueError, match="regex"):
        removals.submit("", gate=False)
    with pytest.raises(ValueError, match="failed"):
        removal_backoff_s(0)
    with pytest.raises(ValueError, match="background"):
        StoreRemovals(Removing(0)).run_pending()


def test_a_reset_that_cannot_switch_is_refused_with_why_in_the_log_and_a_counter(caplog):
    s = sched()
    side = s.steps
    store = Removing(0)
    removals, _, _ = _removals(store)
    kbs = [KeyBuilder(dataclasses.replace(kb.layout, model="v2")) for kb in side.key_builders]
    with caplog.at_level(logging.WARNING, logger="kvledger_connector.scheduler.reset"):
        assert reset_scheduler_side(side, removals, ("v2", kbs + kbs)) is False  # one builder per shard
    assert side.weights_version == "" and removals.num_pending == 0
    assert side.stats.total("resets_refused") == 1
    assert "cannot switch to weights version 'v2'" in caplog.text

    class NoRemoval:  # THIS IS A TEST DOUBLE: a store client without remove_by_regex
        pass
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvledger_connector.scheduler.reset"):
        assert reset_scheduler_side(side, StoreRemovals(NoRemoval(), background=False), ("v2", kbs)) is False
    assert side.weights_version == "" and "cannot remove by pattern" in caplog.text
    assert side.stats.total("resets_refused") == 2

    old = engine_key_regex(side.key_builders)
    assert reset_scheduler_side(side, removals, ("v2", kbs)) is True
    assert side.weights_version == "v2" and store.calls == []  # switched; nothing asked of the store yet
    assert removals.num_pending == 1 and not removals.gated
    with quiet():
        removals.run_pending()
    assert store.calls == [old] and old != engine_key_regex(side.key_builders)
