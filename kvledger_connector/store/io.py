"""The worker's store calls at the edge (etcd-raft's Ready/Advance): the step functions
(kvledger_connector/worker/steps.py) never call the store. A job's generator yields a `StoreCall`, a value
that says which batch call to make on which keys and buffers; whoever drives the generator makes it through
`StoreIO`, the one wrapper (an exception becomes CLIENT_EXCEPTION per key, each call timed and counted), and
sends the codes back in (the driver, `Stepped`, is kvledger_connector/worker/effects.py's).

The store behind `StoreIO` is any `KVStore` (kvledger_connector/store/contract.py): the Mooncake client with
its breaker (`store/breaker.py`: an open breaker answers at once, without the round trip), the scheduler's
bounded calls (`store/deadline.py`: a ``batch_is_exist`` call is a timed prefix lookup there), or a test
double put in its place (``io.store = ...``).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvledger.counts import Counter, Counts
from kvledger_connector.store.contract import KVStore, StoreCode

StoreOp = Literal["batch_is_exist", "batch_put", "batch_get", "wait"]
# the counters of the calls that move bytes: (calls, keys, seconds)
_COUNTED: dict[str, tuple[str, str, str]] = {"batch_put": ("puts", "put_keys", "put_s"),
                                             "batch_get": ("gets", "get_keys", "get_s")}


@dataclass(frozen=True)
class StoreCall:
    """One batch call a step asks for: ``op`` on ``keys``; a put or a get also names each key's buffers
    (``ptrs[i]``, ``sizes[i]``: the segments of key i's object, in order). Answered by one code per key.
    ``wait``: no call, a pause of ``wait_s`` before the step goes on (a put's retry into a full segment);
    answered by no codes."""
    op: StoreOp
    keys: tuple[str, ...]
    ptrs: tuple[list[int], ...] = ()
    sizes: tuple[list[int], ...] = ()
    wait_s: float = 0.0


class StoreIO:
    """Makes a `StoreCall` on ``store``: the codes as the store gives them (the steps check their count),
    or CLIENT_EXCEPTION for every key if the call raised (the Mooncake wrapper never does; a wrapped or test
    store may). Counts into ``counts`` (the connector's one sink): puts / gets, their keys and seconds (the
    store call alone), store_exceptions."""

    def __init__(self, store: KVStore, counts: Counter | None = None) -> None:
        self.store = store  # tests put a double in its place
        self.counts: Counter = counts if counts is not None else Counts()
        self._stopping = threading.Event()  # set at shutdown: a wait ends at once

    def stop(self) -> None:
        """Shutdown begun: every wait, now or later, ends at once (a retrying put gives up sooner)."""
        self._stopping.set()

    def __call__(self, call: StoreCall) -> list[int]:
        if call.op == "wait":
            self._stopping.wait(max(0.0, call.wait_s))
            return []
        t0 = time.perf_counter()
        store, keys = self.store, list(call.keys)
        try:
            if call.op == "batch_is_exist":
                res = list(store.batch_is_exist(keys))
            elif call.op == "batch_put":
                res = list(store.batch_put(keys, list(call.ptrs), list(call.sizes)))
            elif call.op == "batch_get":
                res = list(store.batch_get(keys, list(call.ptrs), list(call.sizes)))
            else:
                raise ValueError(f"StoreCall.op={call.op!r}: not a store call")
        except Exception:
            self.counts.add("store_exceptions")
            res = [int(StoreCode.CLIENT_EXCEPTION)] * len(call.keys)
        counted = _COUNTED.get(call.op)
        if counted is not None:
            calls, keys, seconds = counted
            self.counts.add(seconds, time.perf_counter() - t0)
            self.counts.add(calls)
            self.counts.add(keys, len(call.keys))
        return res

    def remove(self, keys: Sequence[str]) -> list[str]:
        """Removes each key's object by force (a reader's lease must not keep it). Best effort: returns one
        message per key whose removal raised."""
        errors: list[str] = []
        for k in keys:
            try:
                self.store.remove(k, True)
            except Exception as e:
                errors.append(f"remove {k}: {type(e).__name__}: {e}")
        return errors
