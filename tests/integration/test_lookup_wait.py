"""A lookup holds an engine step at most ``lookup_wait_ms``: a store slower than that (a master starved of CPU
by the engine's own compute threads) leaves the request waiting for the next step while its call goes on,
instead of answering a miss or holding every other request's step (`DeadlineStore.ask_exist`). Only a call
unanswered ``lookup_timeout_ms`` after it was sent is a miss and trips the breaker.

The slow stores are TEST DOUBLES (a fault injected: an existence check that answers only when the test lets
it); the last test slows the real Mooncake store's check under vLLM 0.32's real Scheduler."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.deadline import DeadlineStore
from testbed.harness import Harness, shared_prefix_prompts
from testbed.store_double import StoreDouble


class _Held(StoreDouble):
    """THIS IS A TEST DOUBLE: a store whose existence check answers "present" only once ``release`` is set
    (a master that is slow, not gone); ``tripped`` counts the breaker trips asked of it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked: list[list[str]] = []
        self.tripped = 0

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.asked.append(list(keys))
        self.release.wait(10.0)
        return [1] * len(keys)

    def trip(self) -> None:
        self.tripped += 1


def _answered(ds: DeadlineStore, keys: list[str], within_s: float = 10.0) -> list[int]:
    """Asks as vLLM does, once a step, until the lookup is answered."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        got = ds.ask_exist(keys)
        if got is not None:
            return got
    raise AssertionError(f"lookup of {keys} unanswered after {within_s} s")


def test_a_slow_answer_leaves_the_request_waiting_then_hits() -> None:
    store = _Held()
    ds = DeadlineStore(store, 10.0, wait_s=0.01)
    try:
        assert ds.ask_exist(["a", "b"]) is None  # not answered within the step's wait: asked again next step
        assert ds.ask_exist(["a", "b"]) is None and len(store.asked) == 1  # the same call waited on, not resent
        store.release.set()
        assert _answered(ds, ["a", "b"]) == [1, 1]  # the hit, not a miss
        assert len(store.asked) == 1 and store.tripped == 0
        assert ds.counts.total("lookups_deferred") == 2 and ds.counts.total("lookups_past_deadline") == 0
        assert ds.counts.total("lookup_s") > 0  # timed once, when answered
        assert ds.ask_exist(["c"]) == [1]  # a store that answers within the wait: answered in the step
    finally:
        store.release.set()
        ds.stop()


def test_one_lookup_in_flight_and_an_answer_nobody_wants_is_dropped() -> None:
    store = _Held()
    ds = DeadlineStore(store, 10.0, wait_s=0.01)
    try:
        assert ds.ask_exist(["a"]) is None
        assert ds.ask_exist(["b"]) is None  # another request meanwhile: waits too, nothing sent for it
        assert store.asked == [["a"]]
        store.release.set()
        assert _answered(ds, ["b"]) == [1]  # "a" answered but was not asked for again: dropped, "b" sent
        assert store.asked == [["a"], ["b"]]
    finally:
        store.release.set()
        ds.stop()


def test_a_call_unanswered_past_its_deadline_is_a_miss_and_trips_the_breaker() -> None:
    store = _Held()
    ds = DeadlineStore(store, 0.2, wait_s=0.01)
    try:
        assert _answered(ds, ["a"]) == [int(StoreCode.RPC_TIMEOUT)]
        assert store.tripped == 1 and ds.counts.total("lookups_past_deadline") == 1
        assert ds.counts.total("lookups_deferred") >= 1
        # the abandoned call is still inside the store: a new lookup is answered at once, never queued
        assert ds.ask_exist(["b"]) == [int(StoreCode.UNHEALTHY_SKIPPED)]
        assert store.asked == [["a"]] and ds.counts.total("lookups_skipped_busy") == 1
    finally:
        store.release.set()
        ds.stop()


def test_another_requests_call_past_its_deadline_is_a_miss_too() -> None:
    store = _Held()
    ds = DeadlineStore(store, 0.2, wait_s=0.01)
    try:
        assert ds.ask_exist(["a"]) is None  # the request that asked went away; its call never answers
        time.sleep(0.25)
        assert ds.ask_exist(["b"]) == [int(StoreCode.RPC_TIMEOUT)]
        assert store.tripped == 1 and store.asked == [["a"]]
    finally:
        store.release.set()
        ds.stop()


def test_a_lookup_left_in_flight_when_the_breaker_opens_is_dropped_not_answered_later() -> None:
    """The breaker opened for another reason (a worker's failed put) while a lookup was left in flight: that
    call's answer predates the outage, so once the breaker closes the same keys are asked of the store again."""
    store = _Held()
    ds = DeadlineStore(store, 10.0, wait_s=0.01)
    try:
        assert ds.ask_exist(["a"]) is None  # in flight
        store.breaker_open = True
        store.release.set()
        assert _answered(ds, ["x"]) == [1]  # breaker open: the wrapped store answers at once (this double: 1)
        store.breaker_open = False
        end = time.monotonic() + 10.0  # until the dropped call has left the store, a lookup is skipped at once
        while (got := _answered(ds, ["a"])) == [int(StoreCode.UNHEALTHY_SKIPPED)] and time.monotonic() < end:
            time.sleep(0.01)
        assert got == [1]
        assert store.asked == [["a"], ["x"], ["a"]]  # "a" sent again, its old answer dropped
    finally:
        store.release.set()
        ds.stop()


def test_a_check_that_is_no_lookup_waits_for_the_lookup_in_flight_not_skipped() -> None:
    """The KV-events check (`check_exist`) made while a lookup is left in flight waits for that call to leave
    the store and then gets the store's answer: only an abandoned call makes it answer UNHEALTHY_SKIPPED."""
    store = _Held()
    ds = DeadlineStore(store, 10.0, wait_s=0.01)
    try:
        assert ds.ask_exist(["a"]) is None
        threading.Timer(0.05, store.release.set).start()
        assert ds.untimed().batch_is_exist(["e"]) == [1]
        assert store.asked == [["a"], ["e"]] and ds.counts.total("lookups_skipped_busy") == 0
    finally:
        store.release.set()
        ds.stop()


@pytest.mark.parametrize("field,kw", [("wait_s", {"wait_s": 0}), ("wait_s", {"wait_s": True}),
                                      ("timeout_s", {"timeout_s": -1.0})])
def test_a_bad_wait_or_deadline_is_refused_by_name(field: str, kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"timeout_s": 1.0, **kw}
    with pytest.raises(LedgerInputError) as e:
        DeadlineStore(StoreDouble(), **args)
    assert e.value.field == field


PROMPTS = shared_prefix_prompts(3, num_prefixes=1, prefix_len=64, suffix_len=12, seed=4)


def test_a_starved_master_delays_the_hit_under_vllms_scheduler_never_loses_it(store_config: StoreConfig) -> None:
    """vLLM's real Scheduler honours the lookup's "not known yet": the request stays waiting while the
    slowed check runs, then loads its prefix from the store (outputs checked by the harness)."""
    with Harness(store_config, tp_size=2, num_blocks=48,
                 extra={"lookup_wait_ms": 5, "lookup_timeout_ms": 10_000}) as h:
        h.run_pass(PROMPTS[:1], 4, tag="warm")  # the shared prefix is saved
        h.scheduler.reset_prefix_cache()
        conn = h.scheduler_connector
        inner: Any = conn.store  # the Mooncake store the connector's lookups wrap
        real = inner.batch_is_exist

        def slow(keys: Sequence[str]) -> list[int]:  # TEST DOUBLE: a master answering after 0.2 s
            time.sleep(0.2)
            return real(keys)
        inner.batch_is_exist = slow
        try:
            h.run_pass(PROMPTS[1:3], 4, tag="b")
        finally:
            inner.batch_is_exist = real
        ss = conn.scheduler_side.steps
        assert conn.stats.total("lookups_deferred") >= 1 and conn.stats.total("lookups_past_deadline") == 0
        assert ss.stats.total("loads_emitted") >= 1  # the hit was loaded, not lost to a miss
        assert h.garbage == [] and h.check_at_rest() == []
