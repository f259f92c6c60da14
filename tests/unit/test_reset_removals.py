"""The reset (kvledger_connector/scheduler/reset.py `StoreRemovals`, `reset_scheduler_side`, `keys_after_reset`):
each removal tried at most REMOVAL_ATTEMPTS times with waits doubling to their cap, at most
MAX_PENDING_REMOVALS waiting (the oldest dropped), never a store call on the caller's thread, every reset
moving the keys (a new version, or a fresh reset epoch), and a reset that cannot switch refused by name. The store here is a
test double (the integration tests run the same on a real master: tests/integration/test_reset_cache.py)."""
from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from conformance.kvprobes import quiet
from conformance.probes_sched import sched
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.shape.keys import KeyBuilder, is_reset_epoch
from kvledger_connector.scheduler.reset import (
    MAX_PENDING_REMOVALS,
    REMOVAL_ATTEMPTS,
    StoreRemovals,
    engine_key_regex,
    keys_after_reset,
    removal_backoff_s,
    reset_scheduler_side,
)
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import StoreCode
from testbed.store_double import StoreDouble


class Removing(StoreDouble):
    """THIS IS A TEST DOUBLE: a store whose `remove_by_regex` answers the next of ``codes`` (then the last
    one again), recording each pattern; with ``hold`` set, each call waits for ``release`` first (bounded)."""

    def __init__(self, *codes: int, hold: bool = False, keys: set[str] | None = None) -> None:
        self.codes = list(codes) or [0]
        self.calls: list[str] = []
        self.keys = keys or set()
        self.hold = hold
        self.entered = threading.Event()
        self.release = threading.Event()

    removes_by_regex = True

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
    removals.submit("^a$")
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
    removals.submit("^a$")
    with quiet():
        removals.run_pending()
    assert len(store.calls) == 3 and waits.waits == [1.0, 2.0]
    assert (stats.total("reset_removals"), stats.total("reset_removed_keys")) == (1, 7)
    assert stats.total("reset_removed_keys") == 7 and stats.total("reset_removals_given_up") == 0


def test_pending_removals_are_bounded_oldest_dropped():
    store = Removing(0)
    removals, _, stats = _removals(store)
    with quiet():
        for i in range(MAX_PENDING_REMOVALS + 1):
            removals.submit(f"^p{i}$")
        removals.submit(f"^p{MAX_PENDING_REMOVALS}$")  # already waiting: not a new one
    assert removals.num_pending == MAX_PENDING_REMOVALS
    assert stats.total("reset_removals_dropped") == 1
    removals.run_pending()
    assert store.calls == [f"^p{i}$" for i in range(1, MAX_PENDING_REMOVALS + 1)]  # oldest first, p0 dropped


def test_submit_returns_while_the_removal_is_inside_the_store_and_stop_ends_the_retries():
    store = Removing(FAIL, hold=True)
    removals = StoreRemovals(store)  # the real backoff wait: cut short by stop()
    removals.submit("^k$")  # returns at once: the call is on the removal thread
    assert store.entered.wait(10)
    removals.stop()
    store.release.set()
    thread = removals._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive()
    assert store.calls == ["^k$"] and removals.counts.total("reset_removals_given_up") == 0  # no retry after stop


def test_lookups_pass_through_to_the_store_and_are_timed():
    store = Removing(0, keys={"a", "b"})
    bounded = DeadlineStore(store, 10.0)
    try:
        assert bounded.batch_is_exist(["a", "c"]) == [1, 0] and bounded.untimed().batch_is_exist(["b"]) == [1]
        assert bounded.keys == {"a", "b"}  # every other attribute is the store's
        assert bounded.counts.total("lookup_s") > 0  # the prefix lookup timed, the untimed check not
    finally:
        bounded.stop()


def test_bad_inputs_are_refused_by_name():
    removals, _, _ = _removals(Removing(0))
    with pytest.raises(ValueError, match="regex"):
        removals.submit("")
    with pytest.raises(ValueError, match="failed"):
        removal_backoff_s(0)
    with pytest.raises(ValueError, match="background"):
        StoreRemovals(Removing(0)).run_pending()


def _rekey(side, made: list[tuple[str, str]]):
    """The connector's `rekey` for `side`'s shards: builders whose model names the version and epoch."""
    def rekey(version: str, epoch: str) -> list[KeyBuilder]:
        made.append((version, epoch))
        return [KeyBuilder(dataclasses.replace(kb.layout, model=f"m-{version}-{epoch}")) for kb in side.key_builders]
    return rekey


def test_a_reset_that_cannot_switch_is_refused_with_why_in_the_log_and_a_counter(caplog):
    s = sched()
    side = s.steps
    store = Removing(0)
    removals, _, _ = _removals(store)
    made: list[tuple[str, str]] = []
    doubled = lambda v, e: _rekey(side, made)(v, e) * 2  # noqa: E731  one builder per shard, twice
    with caplog.at_level(logging.WARNING, logger="kvledger_connector.scheduler.reset"):
        assert reset_scheduler_side(side, removals, doubled, "v2") is False
    assert side.weights_version == "" and removals.num_pending == 0
    assert side.stats.total("resets_refused") == 1
    assert "cannot switch to weights version 'v2'" in caplog.text

    class NoRemoval(StoreDouble):  # THIS IS A TEST DOUBLE: a store client that cannot remove by pattern
        pass
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvledger_connector.scheduler.reset"):
        assert reset_scheduler_side(side, StoreRemovals(NoRemoval(), background=False), _rekey(side, made),
                                    "v2") is False
    assert side.weights_version == "" and "cannot remove by pattern" in caplog.text
    assert side.stats.total("resets_refused") == 2

    old = engine_key_regex(side.key_builders)
    assert reset_scheduler_side(side, removals, _rekey(side, made), "v2") is True
    assert (side.weights_version, side.reset_epoch) == ("v2", "") and store.calls == []  # switched, no store call
    assert removals.num_pending == 1
    with quiet():
        removals.run_pending()
    assert store.calls == [old] and old != engine_key_regex(side.key_builders)


def test_every_reset_keeping_the_version_moves_the_keys_under_a_fresh_epoch():
    """A replayed pre-reset object (read before, put back after the removal) sits under a key never built
    again; a version switch drops the epoch (engines switching together share the version's keys)."""
    side = sched().steps
    removals, _, _ = _removals(Removing(0))
    made: list[tuple[str, str]] = []
    prefixes = [side.key_builders[0].prefix]
    for _ in range(3):
        assert reset_scheduler_side(side, removals, _rekey(side, made)) is True
        assert side.weights_version == "" and is_reset_epoch(side.reset_epoch) and side.reset_epoch
        prefixes.append(side.key_builders[0].prefix)
    assert len(set(prefixes)) == 4 and len({e for _, e in made}) == 3
    assert keys_after_reset("v1", "v1")[0] == "v1" and keys_after_reset("v1", "v1")[1] != ""
    assert keys_after_reset("v1", "v2") == ("v2", "")
    assert reset_scheduler_side(side, removals, _rekey(side, made), "v2") is True
    assert (side.weights_version, side.reset_epoch) == ("v2", "") and made[-1] == ("v2", "")
    assert removals.num_pending == MAX_PENDING_REMOVALS  # one pattern per reset, the oldest dropped
