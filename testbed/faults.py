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

`FaultyStore` sits ABOVE the store wrapper (it wraps any KVStore). `FaultyMooncakeClient` sits BELOW it: it is
the raw client `MooncakeStore` wraps, over a real `MooncakeDistributedStore`, so the wrapper's own checks,
code handling and master-down breaker run on every injected answer. With `ManualClock` the breaker's wait moves
only when told, and its probe is sent only when asked for (no probe thread), so a replay is deterministic:

    clock = ManualClock()
    store, client = faulty_mooncake_store(cfg, embedded=mc, clock=clock)
    client.always(("exist", "put"), RawFault(code=StoreCode.TRANSFER_FAIL))   # until cleared (None)
    client.next_call("get", RawFault(keys={key: StoreCode.TRANSFER_FAIL}))    # one call; the rest forwarded
    with client.during(BATCH_OPS, RawFault(code=StoreCode.RPC_FAIL)): ...     # master down for the block
    clock.advance(cfg.unhealthy_backoff_ms / 1000); store.probe()             # the breaker closes
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import KVStore, StoreCode
from kvledger_connector.store.client import MooncakeStore, open_client

if TYPE_CHECKING:
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.store.rendezvous import AttachedMooncake

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

    @property
    def removes_by_regex(self) -> bool:
        return self.inner.removes_by_regex

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        return self.inner.remove_by_regex(regex, force)

    def healthy(self) -> bool:
        return self.inner.healthy()

    @property
    def breaker_open(self) -> bool:
        return self.inner.breaker_open

    def trip(self) -> None:
        self.inner.trip()

    @property
    def calls_inside(self) -> int:
        return self.inner.calls_inside

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


# ---------------------------------------------------------------- below the wrapper: the raw client
RawOp = Literal["exist", "put", "get", "remove", "health"]
#: the batch calls (what a store job or a load makes); with "remove" and "health", every call of the client
BATCH_OPS: tuple[RawOp, ...] = ("exist", "put", "get")
RAW_OPS: tuple[RawOp, ...] = ("exist", "put", "get", "remove", "health")


@dataclass(frozen=True)
class RawFault:
    """What one call of the raw client answers instead of the real client. Exactly one of:
    ``code``: every key of the call answers it (nothing is sent); ``keys``: these keys answer their code and
    are not sent, the call's other keys are forwarded; ``raises``: the call raises `InjectedFault`, nothing
    is sent. For "health" a code is health_check()'s answer, for "remove" the call's."""
    code: int | None = None
    keys: Mapping[str, int] = field(default_factory=dict)
    raises: bool = False

    def __post_init__(self) -> None:
        if (self.code is not None) + bool(self.keys) + self.raises != 1:
            raise ValueError(f"RawFault(code={self.code!r}, keys={dict(self.keys)!r}, raises={self.raises!r}): "
                             f"give exactly one of code, keys, raises")
        if self.code is not None and (self.code.__class__ is bool or not isinstance(self.code, int)):
            raise ValueError(f"RawFault.code={self.code!r}: must be an int")


@dataclass(frozen=True)
class RawCall:
    """One call that reached the client: its op, keys (the regex for remove_by_regex) and the fault it got."""
    op: RawOp
    keys: tuple[str, ...]
    fault: RawFault | None  # None: forwarded to the real client


class FaultyMooncakeClient:
    """THIS IS A TEST DOUBLE: the raw client under `MooncakeStore`, forwarding every call to a real
    `MooncakeDistributedStore` (``inner``) except the ones it is told to fault (see the module docstring).

    Per op, a call takes the next fault queued by `next_call` (one call each, in order), else the standing
    fault of `always` / `during`, else is forwarded. Every call is logged in `calls` (bounded: the newest
    ``log_limit``); `num_calls` counts them per op, so a test sees which calls the wrapper skipped."""

    def __init__(self, inner: Any, *, log_limit: int = 10_000) -> None:
        self.inner = inner
        self._lock = threading.Lock()  # store and load threads share one client
        self._next: dict[RawOp, deque[RawFault]] = {op: deque() for op in RAW_OPS}
        self._always: dict[RawOp, RawFault | None] = {op: None for op in RAW_OPS}
        self.calls: deque[RawCall] = deque(maxlen=log_limit)
        self.num_calls: dict[RawOp, int] = {op: 0 for op in RAW_OPS}

    # -- what to inject ------------------------------------------------------------------------------

    def next_call(self, op: RawOp, fault: RawFault) -> None:
        """The next call of `op` (after those already queued) answers `fault`."""
        with self._lock:
            self._next[_raw_op(op)].append(fault)

    def always(self, ops: RawOp | Iterable[RawOp], fault: RawFault | None) -> None:
        """Every call of `ops` answers `fault` from now on (None: forwarded again)."""
        with self._lock:
            for op in _raw_ops(ops):
                self._always[op] = fault

    @contextlib.contextmanager
    def during(self, ops: RawOp | Iterable[RawOp], fault: RawFault) -> Iterator[None]:
        """`always` for the block; then the standing faults from before are restored."""
        chosen = _raw_ops(ops)
        with self._lock:
            before = {op: self._always[op] for op in chosen}
            for op in chosen:
                self._always[op] = fault
        try:
            yield
        finally:
            with self._lock:
                self._always.update(before)

    def clear(self) -> None:
        """No fault queued or standing: every call is forwarded."""
        with self._lock:
            for op in RAW_OPS:
                self._next[op].clear()
                self._always[op] = None

    def _take(self, op: RawOp, keys: Sequence[str]) -> RawFault | None:
        with self._lock:
            queued = self._next[op]
            fault = queued.popleft() if queued else self._always[op]
            call = self.num_calls[op]
            self.num_calls[op] += 1
            self.calls.append(RawCall(op, tuple(keys), fault))
        if fault is not None and fault.raises:
            raise InjectedFault(f"injected fault: raw {op} call {call}")
        return fault

    def _batch(self, op: RawOp, call: Callable[..., Any], keys: Sequence[str],
               *lists: Sequence[Sequence[int]]) -> list[int]:
        fault = self._take(op, keys)
        if fault is None:
            return [int(r) for r in call(list(keys), *lists)]
        if fault.code is not None:
            return [fault.code] * len(keys)
        send = [i for i, k in enumerate(keys) if k not in fault.keys]
        out = [fault.keys.get(k, 0) for k in keys]
        if send:
            res = call([keys[i] for i in send], *[[lst[i] for i in send] for lst in lists])
            for i, r in zip(send, res):
                out[i] = int(r)
        return out

    def _single(self, op: RawOp, key: str, call: Callable[[], Any]) -> int:
        fault = self._take(op, (key,) if key else ())
        if fault is not None and fault.code is not None:
            return fault.code
        if fault is not None and key in fault.keys:
            return fault.keys[key]
        return int(call())

    # -- the raw client's calls, as MooncakeStore makes them -----------------------------------------

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._batch("exist", self.inner.batch_is_exist, keys)

    def batch_put_from_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                                     sizes: Sequence[Sequence[int]]) -> list[int]:
        return self._batch("put", self.inner.batch_put_from_multi_buffers, keys, ptrs, sizes)

    def batch_get_into_multi_buffers(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                                     sizes: Sequence[Sequence[int]]) -> list[int]:
        return self._batch("get", self.inner.batch_get_into_multi_buffers, keys, ptrs, sizes)

    def remove(self, key: str, force: bool = False) -> int:
        return self._single("remove", key, lambda: self.inner.remove(key, force))

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        return self._single("remove", regex, lambda: self.inner.remove_by_regex(regex, force))

    def health_check(self) -> int:
        return self._single("health", "", self.inner.health_check)

    def register_buffer(self, ptr: int, size: int) -> int:
        return int(self.inner.register_buffer(ptr, size))

    def unregister_buffer(self, ptr: int) -> int:
        return int(self.inner.unregister_buffer(ptr))

    def close(self) -> Any:
        return self.inner.close()


def _raw_op(op: str) -> RawOp:
    if op not in RAW_OPS:
        raise ValueError(f"raw op {op!r}: must be one of {RAW_OPS}")
    return op  # type: ignore[return-value]


def _raw_ops(ops: str | Iterable[str]) -> tuple[RawOp, ...]:
    return (_raw_op(ops),) if isinstance(ops, str) else tuple(_raw_op(op) for op in ops)


class ManualClock:
    """THIS IS A TEST DOUBLE: a monotonic clock (seconds) that moves only when told, for `MooncakeStore`'s
    ``clock`` (its breaker's wait), so a replay does not depend on how long its calls take."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"ManualClock.advance({seconds!r}): a monotonic clock never goes back")
        self.now += seconds


def faulty_mooncake_store(config: StoreConfig, *, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                          clock: Callable[[], float] = time.monotonic) -> tuple[MooncakeStore, FaultyMooncakeClient]:
    """The real `MooncakeStore` over a `FaultyMooncakeClient` over a real client of `config`'s master (or
    `embedded`'s): the wrapper under test, faults injected below it. Close the store as usual."""
    raw, config = open_client(config, embedded=embedded)
    client = FaultyMooncakeClient(raw)
    return MooncakeStore(client, config, embedded, clock=clock), client


def wrap_raw_clients(h: Any, **kw: Any) -> list[RawClientFaults]:
    """FAULT INJECTION: put `RawClientFaults` (``kw``: its faults) under every worker rank's store calls of a
    `testbed.harness.Harness`, ours or upstream's; returns the wrappers (their counts)."""
    wrapped = []
    for w in h.workers:
        if h.connector_kind == "ours":
            store = w.worker_side.io.store
            store._raw = RawClientFaults(store._raw, **kw)
            wrapped.append(store._raw)
        else:
            cw = w.connector_worker
            raw = RawClientFaults(cw.store, **kw)
            cw.store = raw
            cw.kv_send_thread.store = raw
            for t in cw.kv_recv_threads:
                t.store = raw
            wrapped.append(raw)
    return wrapped


class RawClientFaults:
    """THIS IS A TEST DOUBLE: the raw Mooncake client under either connector (ours: `MooncakeStore`'s client;
    upstream MooncakeStoreConnector: its worker's and threads' `store`), forwarding every call to the real
    `MooncakeDistributedStore` (``inner``), for bench.scheduler's fault workloads, the same below both:

    * ``put_delay_s``: every `batch_put_from_multi_buffers` call sleeps this long first (a slow store);
    * ``evict_before_get``: every key of a `batch_get_into_multi_buffers` call is removed from the real store
      (``remove(key, force=True)``) just before the call is forwarded, so the real store answers it as
      missing: keys that a lookup found are gone when the load runs.

    Every other call (and attribute) is the real client's."""

    def __init__(self, inner: Any, *, put_delay_s: float = 0.0, evict_before_get: bool = False) -> None:
        if not put_delay_s >= 0:
            raise ValueError(f"RawClientFaults put_delay_s={put_delay_s!r}: must be >= 0")
        self.inner = inner
        self.put_delay_s = put_delay_s
        self.evict_before_get = evict_before_get
        self.num_delayed_puts = 0
        self.num_evicted_keys = 0

    def batch_put_from_multi_buffers(self, keys: Sequence[str], *args: Any) -> Any:
        if self.put_delay_s:  # upstream passes its ReplicateConfig as a 4th argument: forwarded as given
            time.sleep(self.put_delay_s)
            self.num_delayed_puts += 1
        return self.inner.batch_put_from_multi_buffers(keys, *args)

    def batch_get_into_multi_buffers(self, keys: Sequence[str], *args: Any) -> Any:
        if self.evict_before_get:
            for k in keys:
                self.inner.remove(k, True)
                self.num_evicted_keys += 1
        return self.inner.batch_get_into_multi_buffers(keys, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_pass_with_a_failed_get(h: Any, prompts: list[list[int]], max_tokens: int, tag: str, rank: int = 0
                               ) -> FaultyStore:
    """FAULT INJECTION: a pass of `testbed.harness.Harness` (its outputs, S7 and rest checked by the harness)
    after a prefix-cache reset, whose first store get on ``rank`` returns TRANSFER_FAIL; returns the wrapper
    (``injected`` lists what fired). A hybrid model's failed load is reported per request: it recomputes."""
    from kvledger_connector.store.contract import StoreCode
    h.scheduler.reset_prefix_cache()
    io = h.workers[rank].worker_side.io
    faulty = FaultyStore(io.store, FaultPlan([FaultRule("get", "code", code=int(StoreCode.TRANSFER_FAIL),
                                                        max_fires=1)]))
    io.store = faulty
    h.run_pass(prompts, max_tokens, tag=tag)
    return faulty


@dataclass
class TamperLog:
    """What `run_pass_with_a_tampered_store` did: per round, the harness step it ran in, the keys it overwrote
    and the async loads that step had just parked (pinned, not started)."""

    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (step, keys overwritten, loads parked)

    @property
    def keys_overwritten(self) -> int:
        return sum(n for _, n, _ in self.rounds)


def stored_keys_of_requests(h: Any, parts: frozenset[int] | None = None) -> list[str]:
    """Every key the store may hold for the requests a `testbed.harness.Harness` has seen: each full block's
    (and, with ``save_partial_tail``, each prompt's partial tail's) key of every rank, KV cache group and
    part (only the parts in ``parts``, indexes into a rank's key builders, when given), in a stable order,
    each once."""
    from kvledger_connector.shape.keys import partial_tail_hash
    bs = h.block_size
    tails = h.scheduler_connector.scheduler_side.steps.save_partial_tail
    out: dict[str, None] = {}
    for req in h.requests.values():
        hashes = list(req.block_hashes)
        k, r = divmod(req.num_prompt_tokens, bs)
        if tails and r >= 2 and 1 <= k <= len(hashes):
            hashes.append(partial_tail_hash(hashes[k - 1], req.prompt_token_ids[k * bs:k * bs + r]))
        for w in h.workers:
            for part, kb in enumerate(w.worker_side.steps.block_shape().builders):
                if parts is None or part in parts:
                    out.update(dict.fromkeys(kb.keys(hashes)))
    return list(out)


def run_pass_with_a_tampered_store(h: Any, prompts: list[list[int]], max_tokens: int, tag: str, *,
                                   rounds: int = 4, seed: int = 0, check_outputs: bool = True,
                                   parts: frozenset[int] | None = None) -> TamperLog:
    """FAULT INJECTION: a pass of `testbed.harness.Harness` in which another store client (the harness's
    checker) overwrites EVERY stored value of the requests seen with same-size random bytes (remove, then
    put: the store is first-writer-wins), at the first ``rounds`` steps that park a request in
    WAITING_FOR_REMOTE_KVS: right after that step's ``schedule()`` (the lookup found the keys, the load is
    pinned) and before any rank starts a load, so every load that step parked reads forged bytes. Which steps
    it hits and what it writes are deterministic (``seed``); a put a rank has in flight at a round may land
    before or after it. With ``check_outputs`` the pass is `Harness.run_pass` (outputs, S7 and rest checked),
    else the requests only run to the end (policy "fail" ends some with an error: the caller checks).
    ``parts``: forge only these parts of each block (`stored_keys_of_requests`; a block stored as several keys,
    e.g. the TP-shared layout's head shards). Returns what it did. The integrity tag (the default) turns every
    forged object a load reads into a load error (and removes it)."""
    import torch
    store = h.checker()
    size = h.workers[0].worker_side.steps.key_bytes
    gen = torch.Generator().manual_seed(seed)
    buf = torch.empty(size, dtype=torch.uint8)
    store.register_buffer(buf.data_ptr(), size)
    h._tamper_buf = buf  # registered with the store: kept alive with the harness
    log = TamperLog()
    schedule = h.scheduler.schedule

    def tamper() -> int:
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
        keys = stored_keys_of_requests(h, parts)
        present = [k for k, c in zip(keys, store.batch_is_exist(keys)) if c == 1]
        for k in present:
            store.remove(k, True)
        res = store.batch_put(present, [[buf.data_ptr()]] * len(present), [[size]] * len(present))
        return sum(1 for c in res if c == 0)

    def schedule_then_tamper() -> Any:
        out = schedule()
        meta = out.kv_connector_metadata
        parked = sum(1 for s in meta.loads if not s.sync) if meta is not None else 0
        if parked and len(log.rounds) < rounds:
            log.rounds.append((h.stats.steps + 1, tamper(), parked))
        return out

    h.scheduler.schedule = schedule_then_tamper  # on the instance: the class's again below
    try:
        if check_outputs:
            h.run_pass(prompts, max_tokens, tag=tag)
        else:
            for i, p in enumerate(prompts):
                h.add_request(f"{tag}-{i}", p, max_tokens)
            h.run()
    finally:
        del h.scheduler.schedule
    return log


def stored_keys(mc: EmbeddedMooncake, key_part: str) -> list[str]:
    """The master's stored keys (its HTTP `/get_all_keys`, as any local client can ask) containing `key_part`,
    sorted."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{mc.metrics_port}/get_all_keys", timeout=10) as resp:
        listed = resp.read().decode()
    return sorted(k for k in listed.split() if key_part in k)


def forge_stored_values(mc: EmbeddedMooncake, key_part: str, *, seed: int = 0, every: int = 1) -> list[str]:
    """FAULT INJECTION from outside the engine: another client of the same master replaces every `every`-th
    stored object whose key contains `key_part` (the engine's model directory, say) with random bytes of the
    same size (remove, then put: the store is first-writer-wins). The keys are the master's own list (its
    HTTP `/get_all_keys`); a real engine's next loads of them read forged bytes. Returns the keys forged."""
    import torch
    keys = stored_keys(mc, key_part)[::every]
    store = MooncakeStore.connect(StoreConfig(master_server_address=mc.master_address,
                                              metadata_server=mc.metadata_server, global_segment_size=0))
    gen = torch.Generator().manual_seed(seed)
    forged: list[str] = []
    bufs: dict[int, torch.Tensor] = {}  # one registered buffer per object size, alive until the puts are done
    try:
        for k in keys:
            size = int(store.raw.get_size(k))
            if size <= 0:
                continue
            if size not in bufs:
                bufs[size] = torch.empty(size, dtype=torch.uint8)
                store.register_buffer(bufs[size].data_ptr(), size)
            buf = bufs[size]
            buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
            store.remove(k, True)
            if store.batch_put([k], [[buf.data_ptr()]], [[size]]) == [0]:
                forged.append(k)
    finally:
        store.close()
    return forged


class StoredCopies:
    """FAULT INJECTION from outside the engine: another client of the same master (any client of a shared
    store can) reads objects now (`take`) and puts each back under its own key later (`put_back`), where
    that key is empty by then (first writer wins): the replay a reset must make harmless. Its own store client
    (no segment of its own); `close` it."""

    def __init__(self, config: StoreConfig) -> None:
        self.store = MooncakeStore.connect(config.replace(global_segment_size=0))
        self.copies: dict[str, Any] = {}  # key -> a registered uint8 tensor holding the object

    def take(self, keys: Sequence[str]) -> list[str]:
        """Read every object of `keys` that exists; the keys read."""
        import torch
        for k in keys:
            size = int(self.store.raw.get_size(k))
            if size <= 0:
                continue
            buf = torch.empty(size, dtype=torch.uint8)
            self.store.register_buffer(buf.data_ptr(), size)
            if self.store.batch_get([k], [[buf.data_ptr()]], [[size]]) == [size]:
                self.copies[k] = buf
        return list(self.copies)

    def put_back(self) -> list[str]:
        """Put every copy back under its key; the keys where the put was applied (the key was empty)."""
        put: list[str] = []
        for k, buf in self.copies.items():
            if self.store.batch_is_exist([k]) == [0] and \
                    self.store.batch_put([k], [[buf.data_ptr()]], [[buf.numel()]]) == [0]:
                put.append(k)
        return put

    def close(self) -> None:
        self.store.close()
