"""The scheduler's store calls, in one wrapper (`DeadlineStore`): gated while a reset's removal is owed,
skipped while the store's breaker is open, each bounded by a deadline, the prefix lookups timed, every
outcome counted into the one counter sink. A store that does not answer costs an engine step at most
``lookup_timeout_ms``, once, then nothing until the store answers again.

    scheduler thread                         kvledger-lookup thread (one per scheduler side)
    batch_is_exist(keys) ──put──► queue ──► store.batch_is_exist(keys) ──► result ──► done.set()
         └─ done.wait(timeout_s) ─┬─ answered in time: the store's codes
                                  └─ past it: RPC_TIMEOUT per key (a miss), the store's breaker tripped
                                     (`MooncakeStore.trip`): later calls are skipped at once until its
                                     prober sees the master answer

In order, per call: the reset's gate (`StoreRemovals.gated`, kvledger_connector/scheduler/reset.py) answers every
key "missing" while the keys may still hold pre-reset KV; a store whose breaker is open answers without the
round trip through the thread; otherwise the call goes through the thread, bounded. ``batch_is_exist`` is a
prefix lookup: its duration (gated ones included) goes to ``lookup_s`` and its histogram; the KV-events
check goes through `untimed` (the same calls, not a prefix lookup, kept out of ``lookup_s``).

Only existence checks go through here: they read no GPU memory, so a call abandoned past its deadline may
finish whenever it does and harm nothing; its late answer is dropped. While the abandoned call is still
inside the client, new calls are not queued behind it: they answer UNHEALTHY_SKIPPED at once (counted in
``lookups_skipped_busy``), so at most one call is inside the store through here.

A prefix lookup answers "not known yet" instead (`lookup`, None: vLLM skips the request for this step and
asks again in the next): past the deadline the call stays inside and the step goes on; the request's next
ask takes the late answer (kept per key list, for PENDING_DEADLINES deadlines), and only a call still
unanswered after PENDING_DEADLINES deadlines is a miss that trips the breaker. On vLLM's CPU backend the
engine's compute threads take every core, so a live master and this thread can answer well past one step's
deadline: a miss and an open breaker there would cost every lookup its hit (a real model then recomputes
prompts the store holds), where a request waiting a few steps for its answer costs it only those steps.
Other requests' lookups while that call is inside answer "not yet" as well (one call inside at a time).

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
from typing import Any, Protocol

from kvledger.counts import Counter, Counts
from kvledger.errors import LedgerInputError
from kvledger_connector.store.client import StoreCode

logger = logging.getLogger(__name__)


class Gate(Protocol):
    """What the gate of these calls needs: True while the keys may still hold pre-reset KV."""

    @property
    def gated(self) -> bool: ...


# a lookup's call may stay inside this many deadlines (answering "not yet") before it counts as a master that
# does not answer; a late answer is kept as long for its request's next ask
PENDING_DEADLINES = 10
MAX_LATE_ANSWERS = 64  # late answers kept at once (oldest dropped: that request's next ask calls again)


@dataclass
class _Call:
    keys: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[int] | None = None
    started: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # its caller's deadline passed: a late answer is kept in `_kvl_late`


class DeadlineStore:
    """``store`` as the scheduler calls it (see the module doc). ``gate``: an object whose ``gated`` is True
    while a reset's removal is owed (`StoreRemovals`), or None. ``stats``: the counter sink (the connector's
    `StatsRecorder`; its own `Counts` when None), read as ``counts``. Everything else, attribute reads and
    writes included, is the wrapped store's own. ``pending_deadlines``: how many deadlines a lookup's call
    may stay inside answering "not yet" (`lookup`)."""

    def __init__(self, store: Any, timeout_s: float, stats: Counter | None = None, *,
                 gate: Gate | None = None, pending_deadlines: int = PENDING_DEADLINES) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise LedgerInputError("timeout_s", timeout_s, "a store call's deadline must be > 0 seconds")
        if pending_deadlines.__class__ is not int or pending_deadlines < 1:
            raise LedgerInputError("pending_deadlines", pending_deadlines, "must be an int >= 1")
        object.__setattr__(self, "_kvl_pending_deadlines", pending_deadlines)
        object.__setattr__(self, "_kvl_store", store)
        object.__setattr__(self, "_kvl_timeout_s", float(timeout_s))
        object.__setattr__(self, "_kvl_gate", gate)
        object.__setattr__(self, "_kvl_q", queue.SimpleQueue())
        object.__setattr__(self, "_kvl_busy", threading.Lock())  # held while a call is inside the store
        object.__setattr__(self, "_kvl_thread", None)
        object.__setattr__(self, "_kvl_stopped", False)
        object.__setattr__(self, "_kvl_stats", stats if stats is not None else Counts())
        # guards an abandoned call's hand-over: the caller marking it abandoned, the thread filing its answer
        object.__setattr__(self, "_kvl_mu", threading.Lock())
        object.__setattr__(self, "_kvl_pending", None)  # the abandoned call still inside, if any
        object.__setattr__(self, "_kvl_late", {})  # key tuple -> (answered at, codes), oldest first

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

    def gate_closed(self) -> bool:
        """Whether the reset's gate answers every key "missing" now."""
        gate = self._kvl_gate
        return gate is not None and bool(gate.gated)

    def lookup(self, keys: Sequence[str]) -> list[int] | None:
        """A prefix lookup that may answer "not known yet" (None; module doc): the codes of ``keys``, from a
        call made now within the deadline or from an earlier one that answered after it. Timed as
        `batch_is_exist` is."""
        t0 = time.perf_counter()
        try:
            return self._check(keys, pending=True)
        finally:
            self._kvl_stats.add("lookup_s", time.perf_counter() - t0)

    def check_exist(self, keys: Sequence[str]) -> list[int]:
        """The gated, breaker-skipped, bounded ``batch_is_exist`` (module doc), not timed."""
        codes = self._check(keys, pending=False)
        if codes is None:  # only a pending lookup answers None
            raise LedgerInputError("pending", False, "an existence check always answers codes")
        return codes

    def _check(self, keys: Sequence[str], *, pending: bool) -> list[int] | None:
        n = len(keys)
        if self.gate_closed():
            return [0] * n
        store = self._kvl_store
        if self._kvl_stopped or getattr(store, "breaker_open", False):
            return store.batch_is_exist(keys)  # closed or skipping: answers at once, no thread needed
        limit_s = self._kvl_pending_deadlines * self._kvl_timeout_s
        with self._kvl_mu:  # late answers are for lookups alone: other checks answer as they always did
            late = self._kvl_late.pop(tuple(keys), None) if pending else None
            inside: _Call | None = self._kvl_pending
        if late is not None and time.monotonic() - late[0] <= limit_s:
            self._kvl_stats.add("lookups_answered_late")
            return late[1]
        if not self._kvl_busy.acquire(blocking=False):  # an abandoned call is still inside
            if pending and inside is not None and time.monotonic() - inside.started < limit_s:
                self._kvl_stats.add("lookups_pending")
                return None
            if pending and inside is not None:
                return self._past_deadline(n, limit_s)
            self._kvl_stats.add("lookups_skipped_busy")
            return [int(StoreCode.UNHEALTHY_SKIPPED)] * n
        call = _Call(list(keys))
        self._start()
        self._kvl_q.put(call)
        if call.done.wait(self._kvl_timeout_s):
            return self._result(call)
        with self._kvl_mu:
            if call.done.is_set():  # answered just now
                return self._result(call)
            call.abandoned = True
            object.__setattr__(self, "_kvl_pending", call)
        if pending:
            self._kvl_stats.add("lookups_pending")
            return None
        return self._past_deadline(n, self._kvl_timeout_s)

    @staticmethod
    def _result(call: _Call) -> list[int]:
        return call.result if call.result is not None else [int(StoreCode.CLIENT_EXCEPTION)] * len(call.keys)

    def _past_deadline(self, n: int, waited_s: float) -> list[int]:
        """A call unanswered past its bound: a miss, and the store's breaker tripped."""
        self._kvl_stats.add("lookups_past_deadline")
        trip = getattr(self._kvl_store, "trip", None)
        if trip is not None:
            trip()
        logger.warning("store existence check of %d key(s) unanswered after %.0f ms: answered as a miss, "
                       "store calls skipped until the master answers a probe", n, waited_s * 1e3)
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
            result: list[int] | None = None
            try:
                result = self._kvl_store.batch_is_exist(call.keys)
            except Exception as e:  # the store wrapper returns codes; a raising double must not kill the thread
                logger.warning("store existence check raised %s: %s", type(e).__name__, e)
            finally:
                with self._kvl_mu:
                    call.result = result
                    if call.abandoned:
                        self._file_late(call)
                    call.done.set()
                self._kvl_busy.release()

    def _file_late(self, call: _Call) -> None:
        """An abandoned call's answer, kept for its keys' next ask (under ``_kvl_mu``)."""
        if self._kvl_pending is call:
            object.__setattr__(self, "_kvl_pending", None)
        if call.result is None or len(call.result) != len(call.keys):
            return  # no answer: the next ask calls again
        late = self._kvl_late
        late.pop(tuple(call.keys), None)
        late[tuple(call.keys)] = (time.monotonic(), call.result)
        while len(late) > MAX_LATE_ANSWERS:
            del late[next(iter(late))]

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
