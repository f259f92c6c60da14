"""The scheduler's store calls, in one wrapper (`DeadlineStore`): skipped while the store's breaker is open, each bounded by a deadline, the prefix lookups timed, every
outcome counted into the one counter sink. A store that does not answer costs an engine step at most
``lookup_timeout_ms``, once, then nothing until the store answers again.

A prefix lookup (`ask_exist`) holds an engine step at most ``wait_s`` (``lookup_wait_ms``): a store slower
than that, e.g. a master starved of CPU by the engine's own compute threads, answers None ("not known yet":
vLLM leaves the request waiting and asks again next step, when the same call is waited on again) instead of
a miss, and the engine goes on with its other requests meanwhile. Only a call unanswered ``timeout_s`` after
it was sent is answered as a miss and trips the breaker. Such a call is still wanted, not abandoned: an
existence check that is no lookup (`check_exist`) waits for it to leave the store, within its deadline.

    scheduler thread                         kvledger-lookup thread (one per scheduler side)
    batch_is_exist(keys) ──put──► queue ──► store.batch_is_exist(keys) ──► result ──► done.set()
         └─ done.wait(timeout_s) ─┬─ answered in time: the store's codes
                                  └─ past it: RPC_TIMEOUT per key (a miss), the store's breaker tripped
                                     (`MooncakeStore.trip`): later calls are skipped at once until its
                                     prober sees the master answer

In order, per call: a store whose breaker is open answers without the round trip through the thread;
otherwise the call goes through the thread, bounded. ``batch_is_exist`` is a prefix lookup: its duration goes
to ``lookup_s`` and its histogram; the KV-events
check goes through `untimed` (the same calls, not a prefix lookup, kept out of ``lookup_s``).

Only existence checks go through here: they read no GPU memory, so a call abandoned past its deadline may
finish whenever it does and harm nothing; its late answer is dropped. While the abandoned call is still
inside the client, new calls are not queued behind it: they answer UNHEALTHY_SKIPPED at once (counted in
``lookups_skipped_busy``), so at most one call is inside the store through here.

Why a thread and not Mooncake's own RPC timeout: a call to a master that just died spends ~4-5 s in
Mooncake's reconnect attempts (measured), well past `rpc_timeout_ms`, and `MC_RPC_TIMEOUT_MS` is
process-wide (the workers' puts share it in a one-process driver).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvledger.counts import Counter, Counts
from kvledger.errors import LedgerInputError
from kvledger_connector.store.contract import KVStore, StoreCode

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    keys: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[int] | None = None
    sent: float = field(default_factory=time.monotonic)


class DeadlineStore:
    """``store`` as the scheduler calls it (see the module doc). ``stats``: the counter sink (the connector's
    `StatsRecorder`; its own `Counts` when None), read as ``counts``. Everything else, attribute reads and
    writes included, is the wrapped store's own."""

    def __init__(self, store: KVStore, timeout_s: float, stats: Counter | None = None,
                 wait_s: float | None = None) -> None:
        for name, v in (("timeout_s", timeout_s), ("wait_s", timeout_s if wait_s is None else wait_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise LedgerInputError(name, v, "a store call's deadline and wait must be > 0 seconds")
        object.__setattr__(self, "_kvl_store", store)
        object.__setattr__(self, "_kvl_timeout_s", float(timeout_s))
        # a prefix lookup's wait inside one step (`ask_exist`); None: the whole deadline, as `check_exist`
        object.__setattr__(self, "_kvl_wait_s", float(timeout_s if wait_s is None else min(wait_s, timeout_s)))
        object.__setattr__(self, "_kvl_asked", None)  # the lookup `ask_exist` left in flight (a _Call)
        object.__setattr__(self, "_kvl_q", queue.SimpleQueue())
        object.__setattr__(self, "_kvl_busy", threading.Lock())  # held while a call is inside the store
        object.__setattr__(self, "_kvl_thread", None)
        object.__setattr__(self, "_kvl_stopped", False)
        object.__setattr__(self, "_kvl_stats", stats if stats is not None else Counts())

    @property
    def counts(self) -> Counter:
        """The counter sink these calls count into (lookup_s, lookups_past_deadline, lookups_skipped_busy)."""
        return self._kvl_stats

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """A prefix lookup: `check_exist`, its duration added to ``lookup_s`` (one call of its histogram)."""
        t0 = time.perf_counter()
        try:
            return self.check_exist(keys)
        finally:
            self._kvl_stats.add("lookup_s", time.perf_counter() - t0)

    def untimed(self) -> UntimedChecks:
        """These calls for existence checks that are not prefix lookups (the KV-events check)."""
        return UntimedChecks(self)

    def ask_exist(self, keys: Sequence[str]) -> list[int] | None:
        """A prefix lookup that holds the step at most ``wait_s``: the store's codes, or None while the call
        is in flight (the module doc). One lookup is in flight at a time: asked again with the same keys, it
        is waited on again; another lookup meanwhile answers None too (asked again next step), and once the
        call has answered, an answer nobody asked for again is dropped. Timed (``lookup_s``) once, when
        answered, from when the call was sent."""
        store = self._kvl_store
        if self._kvl_stopped or store.breaker_open:
            # a call left in flight is dropped: once the breaker closes its answer would be stale
            object.__setattr__(self, "_kvl_asked", None)
            return self.batch_is_exist(keys)
        want = list(keys)
        call: _Call | None = self._kvl_asked
        if call is not None and call.keys != want and call.done.is_set():
            call = None  # answered, never asked for again (the request went): dropped
        if call is None:
            call = self._send(want)
            if call is None:
                return [int(StoreCode.UNHEALTHY_SKIPPED)] * len(want)
            object.__setattr__(self, "_kvl_asked", call)
        elif call.keys != want:  # another request's lookup is in flight
            if time.monotonic() - call.sent < self._kvl_timeout_s:
                self._kvl_stats.add("lookups_deferred")
                return None
            object.__setattr__(self, "_kvl_asked", None)
            self._past_deadline(call, len(call.keys))
            return [int(StoreCode.RPC_TIMEOUT)] * len(keys)
        left = self._kvl_timeout_s - (time.monotonic() - call.sent)
        if not call.done.wait(max(0.0, min(self._kvl_wait_s, left))):
            if left > self._kvl_wait_s:
                self._kvl_stats.add("lookups_deferred")
                return None
            object.__setattr__(self, "_kvl_asked", None)
            self._kvl_stats.add("lookup_s", time.monotonic() - call.sent)
            return self._past_deadline(call, len(keys))
        object.__setattr__(self, "_kvl_asked", None)
        self._kvl_stats.add("lookup_s", time.monotonic() - call.sent)
        return call.result if call.result is not None else [int(StoreCode.CLIENT_EXCEPTION)] * len(keys)

    def check_exist(self, keys: Sequence[str]) -> list[int]:
        """The breaker-skipped, bounded ``batch_is_exist`` (module doc), not timed."""
        n = len(keys)
        store = self._kvl_store
        if self._kvl_stopped or store.breaker_open:
            return store.batch_is_exist(keys)  # closed or skipping: answers at once, no thread needed
        asked: _Call | None = self._kvl_asked
        if asked is not None:  # a lookup left in flight is inside the store, not abandoned: wait for it to leave
            asked.done.wait(max(0.0, self._kvl_timeout_s - (time.monotonic() - asked.sent)))
        call = self._send(keys)
        if call is None:
            return [int(StoreCode.UNHEALTHY_SKIPPED)] * n
        if call.done.wait(self._kvl_timeout_s):
            return call.result if call.result is not None else [int(StoreCode.CLIENT_EXCEPTION)] * n
        return self._past_deadline(call, n)

    def _send(self, keys: Sequence[str]) -> _Call | None:
        """``keys``' existence check handed to the helper thread; None (counted) while an abandoned call is
        still inside the store."""
        if not self._kvl_busy.acquire(blocking=False):
            self._kvl_stats.add("lookups_skipped_busy")
            return None
        call = _Call(list(keys))
        self._start()
        self._kvl_q.put(call)
        return call

    def _past_deadline(self, call: _Call, n: int) -> list[int]:
        """``call`` unanswered at its deadline: abandoned (its late answer is dropped), the breaker tripped,
        ``n`` misses."""
        self._kvl_stats.add("lookups_past_deadline")
        self._kvl_store.trip()
        logger.warning("store existence check of %d key(s) unanswered after %.0f ms: answered as a miss, "
                       "store calls skipped until the master answers a probe", len(call.keys),
                       self._kvl_timeout_s * 1e3)
        return [int(StoreCode.RPC_TIMEOUT)] * n

    def _start(self) -> None:
        if self._kvl_thread is None:
            t = threading.Thread(target=self._run, name="kvledger-lookup", daemon=True)
            object.__setattr__(self, "_kvl_thread", t)
            t.start()

    def _run(self) -> None:
        while True:
            call = self._kvl_q.get()
            if call is None:
                return
            try:
                call.result = self._kvl_store.batch_is_exist(call.keys)
            except Exception as e:  # the store wrapper returns codes; a raising double must not kill the thread
                logger.warning("store existence check raised %s: %s", type(e).__name__, e)
            finally:
                self._kvl_busy.release()
                call.done.set()

    def stop(self) -> None:
        """End the helper thread (it ends after a call still inside returns); later calls go direct."""
        object.__setattr__(self, "_kvl_stopped", True)
        self._kvl_q.put(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_kvl_store"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._kvl_store, name, value)


class UntimedChecks:
    """A `DeadlineStore`'s existence checks, not timed as prefix lookups (`DeadlineStore.untimed`)."""

    def __init__(self, calls: DeadlineStore) -> None:
        self._calls = calls

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._calls.check_exist(keys)
