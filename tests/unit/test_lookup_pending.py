"""A prefix lookup whose store answers late (vLLM's CPU engine starving the master and the lookup thread of
cores): past the step's deadline the lookup answers "not known yet" (vLLM skips the request for that step),
the call stays inside, and the request's next ask takes its late answer; only a call unanswered for
`pending_deadlines` deadlines is a miss that trips the breaker. Other checks keep their answers (a miss at
the deadline)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from conformance.probes_sched import BS, Req, sched
from kvledger_connector.scheduler.side import ask_store
from kvledger_connector.store.client import StoreCode
from kvledger_connector.store.deadline import DeadlineStore
from testbed.procs import wait_until

T = TypeVar("T")
LONG = 100_000  # deadlines a call may stay pending: never reached by these tests


class _SlowStore:
    """THIS IS A TEST DOUBLE: a live store that answers existence checks only once released (a master on a
    starved CPU); its breaker opens on `trip` and then answers at once, as the Mooncake wrapper does."""

    def __init__(self, present: Sequence[str] = ()) -> None:
        self.release = threading.Event()
        self.present = set(present)
        self.calls = 0
        self.trips = 0
        self.breaker_open = False

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if self.breaker_open:
            return [int(StoreCode.UNHEALTHY_SKIPPED)] * len(keys)
        self.calls += 1
        self.release.wait(30.0)
        return [1 if k in self.present else 0 for k in keys]

    def trip(self) -> None:
        self.trips += 1
        self.breaker_open = True


def _first_answer(ask: Callable[[], T | None]) -> T:
    """Asks again (as vLLM does each step) until ``ask`` answers something other than "not yet"."""
    got: list[T] = []

    def asked() -> bool:
        r = ask()
        if r is not None:
            got.append(r)
        return bool(got)
    assert wait_until(asked, 20.0, poll_s=0.005)
    return got[0]


def _answered(ds: DeadlineStore, keys: list[str]) -> list[int]:
    return _first_answer(lambda: ds.lookup(keys))


def test_a_late_lookup_answers_not_yet_and_the_next_ask_takes_its_answer() -> None:
    slow = _SlowStore(present=["a"])
    ds = DeadlineStore(slow, 0.01, pending_deadlines=LONG)
    try:
        assert ds.lookup(["a", "b"]) is None  # past the deadline: not known yet, the step goes on
        assert ds.lookup(["c"]) is None  # another request meanwhile: not yet, and not sent
        assert slow.calls == 1 and slow.trips == 0 and not slow.breaker_open
        slow.release.set()
        assert _answered(ds, ["a", "b"]) == [1, 0]  # the late answer, no second call
        assert slow.calls == 1
        counts = ds.counts
        assert counts.total("lookups_answered_late") == 1 and counts.total("lookups_past_deadline") == 0
        assert counts.total("lookups_pending") >= 2
        assert ds.lookup(["c"]) == [0]  # the store answers in time now
    finally:
        slow.release.set()
        ds.stop()


def test_a_lookup_unanswered_past_its_bound_misses_and_trips_the_breaker() -> None:
    slow = _SlowStore(present=["a"])
    ds = DeadlineStore(slow, 0.01, pending_deadlines=2)
    try:
        assert ds.lookup(["a"]) is None
        assert _answered(ds, ["a"]) == [int(StoreCode.RPC_TIMEOUT)]  # still inside after 2 deadlines
        assert slow.trips == 1 and ds.counts.total("lookups_past_deadline") == 1
        assert ds.lookup(["b"]) == [int(StoreCode.UNHEALTHY_SKIPPED)]  # breaker open: not sent
        assert slow.calls == 1
    finally:
        slow.release.set()
        ds.stop()


def test_other_existence_checks_still_miss_at_the_deadline() -> None:
    slow = _SlowStore(present=["a"])
    ds = DeadlineStore(slow, 0.01, pending_deadlines=LONG)
    try:
        assert ds.batch_is_exist(["a"]) == [int(StoreCode.RPC_TIMEOUT)]
        assert slow.trips == 1
    finally:
        slow.release.set()
        ds.stop()


def test_the_scheduler_asks_again_and_then_loads_the_hit() -> None:
    s = sched()
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    s.stored(req, 2)
    slow = _SlowStore(present=list(s.store.data))
    ds = DeadlineStore(slow, 0.01, pending_deadlines=LONG)
    try:
        assert ask_store(s.steps, ds, req, 0) is None  # vLLM: (None, False), the request waits a step
        assert s.steps.stats.total("lookups") == 0  # nothing answered, nothing cached
        slow.release.set()
        assert _first_answer(lambda: ask_store(s.steps, ds, req, 0)) == 2 * BS
        assert slow.calls == 1
        assert ask_store(s.steps, ds, req, 0) == 2 * BS  # cached as any answer
    finally:
        slow.release.set()
        ds.stop()
