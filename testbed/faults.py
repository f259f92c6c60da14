"""Fault injection around a real store. THIS IS A TEST DOUBLE (the project's only allowed fake): it exists
to make failures happen on a deterministic schedule; every call it does not fault goes to the real store.

    store = FaultyStore(MooncakeStore.connect(cfg, embedded=mc), FaultPlan([
        FaultRule("get", "evict", keys=frozenset({k})),          # real remove(force=True) before the get
        FaultRule("put", "code", code=StoreCode.NO_AVAILABLE_HANDLE, calls=frozenset({0})),
        FaultRule("get", "raise", probability=0.1),
    ], seed=7))

Actions:
  * ``code``  — the matched keys are not sent; they get `code` (a put stores nothing, a get writes nothing).
  * ``raise`` — the whole call raises `InjectedFault` before anything is sent (a client exception).
  * ``evict`` — the matched keys are removed from the real store with ``remove(force=True)`` just before the
    call is forwarded, so the real store answers (-704 on get, 0 on exist): eviction between lookup and load.

Matching is by operation (``exist`` / ``put`` / ``get``), optional key set or key substring, optional call
numbers (0-based, per operation) and a probability drawn from one `random.Random(seed)`: the same plan and
the same sequence of calls inject the same faults. Every injection is appended to `FaultyStore.injected`
(bounded: the newest `FaultPlan.log_limit` events; `injected_total` counts them all).
"""
from __future__ import annotations

import random
from collections import deque
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvledger_connector.store import KVStore, StoreCode

Op = Literal["exist", "put", "get"]
Action = Literal["code", "raise", "evict"]
_OPS = ("exist", "put", "get")
_ACTIONS = ("code", "raise", "evict")


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` rule: stands for any exception escaping the store client."""


@dataclass(frozen=True)
class FaultRule:
    op: Op
    action: Action
    code: int = int(StoreCode.TRANSFER_FAIL)
    keys: frozenset[str] | None = None  # only these keys (None: every key)
    key_contains: str | None = None  # only keys containing this substring
    calls: frozenset[int] | None = None  # only these call numbers of `op` (0-based)
    probability: float = 1.0  # per matched key (per call for "raise")
    max_fires: int | None = None  # stop after this many injections

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"FaultRule.op={self.op!r}: must be one of {_OPS}")
        if self.action not in _ACTIONS:
            raise ValueError(f"FaultRule.action={self.action!r}: must be one of {_ACTIONS}")
        if self.action == "code" and int(self.code) >= 0:
            raise ValueError(f"FaultRule.code={self.code!r}: an injected code must be negative")
        if self.action == "evict" and self.op == "put":
            raise ValueError("FaultRule: action 'evict' applies to 'exist' or 'get', not 'put'")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"FaultRule.probability={self.probability!r}: must be in [0, 1]")

    def matches_key(self, key: str) -> bool:
        return (self.keys is None or key in self.keys) and (self.key_contains is None or self.key_contains in key)


@dataclass(frozen=True)
class FaultPlan:
    rules: Sequence[FaultRule] = ()
    seed: int = 0
    log_limit: int = 10_000  # FaultyStore.injected keeps the newest this many events (a long fuzz run)

    def __post_init__(self) -> None:
        if isinstance(self.log_limit, bool) or not isinstance(self.log_limit, int) or self.log_limit < 1:
            raise ValueError(f"FaultPlan.log_limit={self.log_limit!r}: must be an int >= 1")


@dataclass(frozen=True)
class FaultEvent:
    op: Op
    call: int  # call number of this op
    action: Action
    key: str | None  # None for "raise"
    code: int | None


@dataclass
class FaultyStore:
    """A `KVStore` that forwards to `inner` except where `plan` injects a fault (see module docstring)."""

    inner: KVStore
    plan: FaultPlan = field(default_factory=FaultPlan)
    injected: deque[FaultEvent] = field(init=False)  # newest plan.log_limit events
    injected_total: int = field(init=False, default=0)  # every event ever, including dropped ones

    def __post_init__(self) -> None:
        self.injected = deque(maxlen=self.plan.log_limit)
        self._rng = random.Random(self.plan.seed)
        self._calls = {op: 0 for op in _OPS}
        self._fires = [0] * len(self.plan.rules)
        self._lock = threading.Lock()  # store and load threads share one FaultyStore

    # -- the decision --------------------------------------------------------------------------------

    def _decide(self, op: Op, keys: Sequence[str]) -> tuple[dict[int, int], list[int]]:
        """(index -> injected code, indices to evict), or raises InjectedFault. Deterministic per plan."""
        with self._lock:
            call = self._calls[op]
            self._calls[op] += 1
            codes: dict[int, int] = {}
            evict: list[int] = []
            for r, rule in enumerate(self.plan.rules):
                if rule.op != op or (rule.calls is not None and call not in rule.calls):
                    continue
                if rule.action == "raise":
                    if self._can_fire(r) and self._rng.random() < rule.probability:
                        self._fires[r] += 1
                        self._log(FaultEvent(op, call, "raise", None, None))
                        raise InjectedFault(f"injected fault: {op} call {call} (rule {r})")
                    continue
                for i, k in enumerate(keys):
                    if i in codes or not rule.matches_key(k) or not self._can_fire(r):
                        continue
                    if self._rng.random() >= rule.probability:
                        continue
                    self._fires[r] += 1
                    if rule.action == "code":
                        codes[i] = int(rule.code)
                        self._log(FaultEvent(op, call, "code", k, int(rule.code)))
                    else:
                        evict.append(i)
                        self._log(FaultEvent(op, call, "evict", k, None))
            return codes, evict

    def _log(self, event: FaultEvent) -> None:
        self.injected.append(event)
        self.injected_total += 1

    def _can_fire(self, r: int) -> bool:
        cap = self.plan.rules[r].max_fires
        return cap is None or self._fires[r] < cap

    def _forward(self, op: Op, keys: Sequence[str], call: Callable[..., list[int]],
                 *lists: Sequence[Sequence[int]]) -> list[int]:
        for lst in lists:
            if len(lst) != len(keys):
                raise ValueError(f"batch lengths differ: keys={len(keys)} vs {len(lst)}")
        codes, evict = self._decide(op, keys)
        for i in evict:
            self.inner.remove(keys[i], True)
        send = [i for i in range(len(keys)) if i not in codes]
        out = [0] * len(keys)
        if send:
            res = call([keys[i] for i in send], *[[lst[i] for i in send] for lst in lists])
            for i, r in zip(send, res):
                out[i] = r
        for i, c in codes.items():
            out[i] = c
        return out

    # -- KVStore -------------------------------------------------------------------------------------

    def register_buffer(self, ptr: int, size: int) -> None:
        self.inner.register_buffer(ptr, size)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._forward("exist", keys, self.inner.batch_is_exist)

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        return self._forward("put", keys, self.inner.batch_put, ptrs, sizes)

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        return self._forward("get", keys, self.inner.batch_get, ptrs, sizes)

    def evict_now(self, keys: Sequence[str]) -> list[int]:
        """Remove `keys` from the real store immediately (force), outside any call. Returns the codes."""
        return [self.inner.remove(k, True) for k in keys]

    def remove(self, key: str, force: bool = False) -> int:
        return self.inner.remove(key, force)

    def healthy(self) -> bool:
        return self.inner.healthy()

    def close(self) -> None:
        self.inner.close()


class HeldPuts:
    """Holds every put until `gate` is set. A TEST DOUBLE around the real store, only to keep a store job in
    flight (a rank's report back) on a deterministic schedule; every call goes to the real store."""

    def __init__(self, store: Any, gate: threading.Event, timeout_s: float = 60.0) -> None:
        self._store, self._gate, self._timeout_s = store, gate, timeout_s

    def batch_put(self, *args: Any) -> Any:
        if not self._gate.wait(self._timeout_s):
            raise TimeoutError(f"gate never opened in {self._timeout_s}s")
        return self._store.batch_put(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
