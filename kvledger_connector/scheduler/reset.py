"""``reset_cache``: drop every key this engine's model writes, and nothing else.

vLLM calls ``connector.reset_cache()`` from ``Scheduler.reset_connector_cache`` (``reset_prefix_cache(...,
reset_connector=True)``, e.g. after an RL weight update, vllm #42694); True = done, False = refused (the
engine's pause-with-clear-cache raises then), None = not implemented (the worker role answers None: the
scheduler's store client does the removal; the workers hold no per-key state that a reset makes wrong).

What is removed: the keys matching exactly this engine's key shapes, one ``remove_by_regex`` on the master::

    ^(?:<prefix of shard 0>|<prefix of shard 1>|...)[0-9a-fn]+$

each prefix ``[<namespace>/]kvl2/<model>/<layout digest>/tp<r>of<n>-pp<p>of<m>/`` escaped (kvledger_connector/
shape/keys.py), the tail the block-hash alphabet of `keys._hash_hex`, anchored at both ends (the master *searches*
each key, so an unanchored prefix would also match inside another namespace's keys). Other models, other
layouts of the same model, other namespaces and other parallel shapes keep their keys. Upstream's Mooncake
store connector calls ``remove_all`` (every tenant's keys). Keys are content addressed: every engine of the
same model, layout, namespace and parallel shape shares these keys, so the reset drops them for all of them
(after a weight update they are all stale alike).

When the reset is refused (returns False, logged and counted in ``resets_refused``, nothing changed): while
anything of this engine could still write a pre-reset block under a key after the wipe, or feed one to a
request:

- a store job is in flight (pinned in the ledger until every rank reported it): its put may land after
  the wipe and re-create a key with pre-reset KV (first writer wins: it would then stay);
- a load is pending or pinned: its blocks are pre-reset KV the request would compute on;
- a live request holds computed KV (``num_computed_tokens > 0``): a later store job of it would save
  pre-reset blocks (workers resume from their own saved offset, so the scheduler cannot skip them).

vLLM's engine resets after draining (``pause_scheduler`` waits for ``has_requests()``, which includes our
``has_pending_push_work``; ``reset_running_requests=True`` preempts running requests before the connector is
reset), so these hold on its paths; a caller that resets mid-run gets False and may retry — as vLLM's own
``reset_prefix_cache`` answers False while blocks are in use. This rule keeps the ledger untouched: no pin,
job or load changes state, so the model (tla/) and its invariants are unaffected; the reset is a store-side
removal, like an eviction of many keys at once (`Evict(k)`).

Otherwise the reset is done at once, on the engine thread, without a store call::

    engine thread (reset_cache)                  kvledger-reset-removal thread (`StoreRemovals`)
    refusal? -> False
    move the keys (`keys_after_reset`)
    forget lookups, saves, KV events
    submit(old keys' pattern) ──── pending ────► remove_by_regex(pattern), up to REMOVAL_ATTEMPTS tries,
    -> True                                      waits of removal_backoff_s between; given up: logged, counted

Every reset moves the keys, so nothing the engine reads afterwards was stored before it:

- a runtime weights version (`weights_version_file`, re-read by the connector at each reset) that changed:
  the keys move to the new version (no epoch: engines that switch to the same version share keys again);
- otherwise the same version under a fresh random reset epoch (`keys.new_reset_epoch`, in every key's layout
  digest): removing the old keys alone is not enough, since the store is shared and first writer wins: a
  client that read an object before the reset and puts it back after the removal would have it loaded, with
  a valid tag (it is this engine's own object, under its own key). Under a new epoch that key is never built
  again. The price: after such a reset the engine shares keys with no engine that did not draw the same
  epoch (every other engine; a restart returns to the shared keys, no epoch).

The switch reaches lookups and KV events at once and every rank's jobs through the next step's metadata
(`weights_version`, `reset_epoch`). That is the one moment it is safe: the refusal rules above leave nothing
in flight that was keyed under the old keys. The old keys are then removed best-effort: a removal that fails
or lags costs store memory (the keys age out by eviction), never a read of pre-reset KV, since nothing reads
them any more. Another engine still on the old weights keeps writing old-version keys; this one never reads
them.

After any reset the scheduler side forgets what it learned from the store: cached lookup answers, save
trackers and deferred saves (every live request is at 0 computed tokens, so they re-save from block 0).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvledger.counts import Counter, Counts
from kvledger.errors import LedgerInputError
from kvledger_connector.shape.keys import KeyBuilder, new_reset_epoch
from kvledger_connector.store.contract import KVStore, StoreCode

if TYPE_CHECKING:
    from kvledger_connector.scheduler.steps import SchedulerSteps

logger = logging.getLogger(__name__)

#: tries of one removal, the first included, before it is given up (`reset_removals_given_up`)
REMOVAL_ATTEMPTS = 8
#: the wait after a removal's first failed try, doubled after each later one up to MAX_REMOVAL_BACKOFF_S
#: (1, 2, 4 ... 30 s: about a minute and a half of tries, past a master restart)
REMOVAL_BACKOFF_S = 1.0
MAX_REMOVAL_BACKOFF_S = 30.0
#: distinct patterns waiting for removal at once (one per reset, deduplicated); past it the oldest is dropped
#: and counted (`reset_removals_dropped`): resets come once per weight update, so more means a store long down
MAX_PENDING_REMOVALS = 4

_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")  # "/" and "-" are literal outside a class


def ecma_escape(text: str) -> str:
    """`text` as a literal in an ECMAScript regex (the master's std::regex): every syntax character escaped."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def engine_key_regex(key_builders: Sequence[KeyBuilder]) -> str:
    """The pattern matching exactly the keys `key_builders` build (one builder per tp/pp shard)."""
    if not key_builders:
        raise ValueError("key_builders is empty: no shard to reset")
    prefixes = sorted({kb.prefix for kb in key_builders})
    return "^(?:" + "|".join(ecma_escape(p) for p in prefixes) + ")[0-9a-fn]+$"


def removal_backoff_s(failed: int) -> float:
    """The wait after the `failed`-th failed try of one removal (1-based)."""
    if failed.__class__ is not int or failed < 1:
        raise LedgerInputError("failed", failed, "must be an int >= 1")
    return min(REMOVAL_BACKOFF_S * 2.0 ** min(failed - 1, 32), MAX_REMOVAL_BACKOFF_S)


class StoreRemovals:
    """The resets' ``remove_by_regex`` calls, off the engine thread (see the module doc's drawing).

    `submit` queues a pattern and returns at once; a thread of its own (started at the first submit) removes
    each pattern, oldest first, trying each at most REMOVAL_ATTEMPTS times. ``background=False``: no thread,
    the owner calls `run_pending` (probes, to be deterministic). ``wait(seconds) -> stop?``: the backoff
    wait (default: cut short by `stop`; a test passes a double that records the waits).

    Counted into ``stats`` (the connector's recorder; its own `Counts` when None), read as ``counts``:
    reset_removals (patterns removed), reset_removed_keys, reset_removal_retries, reset_removals_given_up,
    reset_removals_dropped."""

    def __init__(self, store: KVStore, *, stats: Counter | None = None, background: bool = True,
                 wait: Callable[[float], bool] | None = None) -> None:
        self.store = store
        self.counts: Counter = stats if stats is not None else Counts()
        self._background = background
        self._stopping = threading.Event()
        self.wait: Callable[[float], bool] = wait if wait is not None else self._stopping.wait
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a submit, a removal done, stop
        self._pending: OrderedDict[str, None] = OrderedDict()  # patterns, oldest first
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def can_remove(self) -> bool:
        return bool(self.store.removes_by_regex)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, regex: str) -> None:
        """Queue the removal of `regex`'s keys (keys the engine no longer builds)."""
        if not isinstance(regex, str) or not regex:
            raise LedgerInputError("regex", regex, "must be a non-empty pattern")
        with self._lock:
            self._pending[regex] = None  # a pattern already waiting keeps its place: it has not begun
            while len(self._pending) > MAX_PENDING_REMOVALS:
                dropped, _ = self._pending.popitem(last=False)
                self.counts.add("reset_removals_dropped")
                logger.warning("reset_cache: %d removals waiting; the oldest (%s) dropped: nothing reads its "
                               "keys, they age out by eviction", MAX_PENDING_REMOVALS + 1, dropped)
            self._changed.notify_all()
            start = self._background and self._thread is None and not self._stopping.is_set()
            if start:
                self._thread = threading.Thread(target=self._loop, name="kvledger-reset-removal", daemon=True)
        if start and self._thread is not None:
            self._thread.start()

    def _take(self) -> str | None:
        """The oldest pending pattern, marked running (under the lock); None when there is none."""
        if not self._pending:
            return None
        self._running = True
        return self._pending.popitem(last=False)[0]

    def _done(self) -> None:
        with self._lock:
            self._running = False
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopping.is_set():
                    self._changed.wait()
                if self._stopping.is_set():
                    return
                job = self._take()
            if job is not None:
                try:
                    self._remove(job)
                finally:
                    self._done()

    def run_pending(self) -> None:
        """Every pending removal, on the caller's thread (``background=False``)."""
        if self._background:
            raise LedgerInputError("background", True, "run_pending is for a StoreRemovals without a thread")
        while not self._stopping.is_set():
            with self._lock:
                job = self._take()
            if job is None:
                return
            try:
                self._remove(job)
            finally:
                self._done()

    def _remove(self, regex: str) -> None:
        for attempt in range(1, REMOVAL_ATTEMPTS + 1):
            try:
                rc = int(self.store.remove_by_regex(regex, True))  # force: a lease must not keep a stale key
            except Exception as e:  # the store wrapper returns codes; a raising double must not end the thread
                logger.warning("reset_cache: remove_by_regex raised %s: %s", type(e).__name__, e)
                rc = int(StoreCode.CLIENT_EXCEPTION)
            if rc >= 0:
                self.counts.add("reset_removals")
                self.counts.add("reset_removed_keys", rc)
                logger.info("reset_cache: removed %d keys matching %s", rc, regex)
                return
            if attempt == REMOVAL_ATTEMPTS:
                break
            wait = removal_backoff_s(attempt)
            self.counts.add("reset_removal_retries")
            logger.warning("reset_cache: remove_by_regex(%r) failed with %s (try %d of %d); again in %.0f s",
                           regex, StoreCode.label(rc), attempt, REMOVAL_ATTEMPTS, wait)
            if self.wait(wait):
                return  # stopped
        self.counts.add("reset_removals_given_up")
        logger.error("reset_cache: keys matching %s not removed after %d tries (last: %s); nothing reads them "
                     "any more: they age out by eviction", regex, REMOVAL_ATTEMPTS, StoreCode.label(rc))

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every submitted removal is done (removed or given up) within `timeout_s` (tests, shutdown)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending and not self._running, timeout_s)

    def stop(self) -> None:
        """No removal begins or is retried after this (a call inside the store returns when it does)."""
        self._stopping.set()
        with self._lock:
            self._changed.notify_all()


def refusal(steps: SchedulerSteps) -> str | None:
    """Why a reset now would be wrong (see the module doc), or None."""
    ledger = steps.ledger
    if ledger is not None and ledger.num_inflight_jobs:
        return f"{ledger.num_inflight_jobs} store jobs in flight (a put landing after the wipe would re-create a key)"
    if steps.has_pending_loads():
        return "loads of pre-reset KV pending or in flight"
    busy = steps.requests_with_computed_kv()
    if busy:
        return f"{len(busy)} live requests hold computed KV (e.g. {busy[0]!r}) that a later save would store"
    return None


def _refuse(steps: SchedulerSteps, why: str) -> bool:
    logger.warning("reset_cache refused: %s", why)
    steps.stats.add("resets_refused")
    return False


def keys_after_reset(weights_version: str, new_version: str | None) -> tuple[str, str]:
    """The (weights version, reset epoch) a reset moves the keys to: the new version with no epoch when the
    version changed (the version alone keeps them apart from the old weights' KV, and engines that switch
    together share keys again); otherwise the same version under a fresh epoch (module doc)."""
    if new_version is not None and new_version != weights_version:
        return new_version, ""
    return weights_version, new_reset_epoch()


def reset_scheduler_side(steps: SchedulerSteps, removals: StoreRemovals,
                         rekey: Callable[[str, str], Sequence[KeyBuilder]], new_version: str | None = None) -> bool:
    """The reset (module doc): move the keys (`keys_after_reset`; `rekey` builds the shards' key builders under
    a version and epoch), forget what the scheduler side learned from the store, and queue the removal of the
    keys it built until now on `removals`; no store call here. False (logged, counted, nothing changed) when
    refused."""
    why = refusal(steps)
    if why is None and not removals.can_remove:
        why = f"the store client {type(removals.store).__name__} cannot remove by pattern"
    if why is not None:
        return _refuse(steps, f"{why}; retry once the engine is drained")
    old = engine_key_regex(steps.key_builders)
    before = steps.weights_version
    version, epoch = keys_after_reset(before, new_version)
    try:
        steps.switch_keys(version, epoch, rekey(version, epoch))
    except LedgerInputError as e:
        return _refuse(steps, f"cannot switch to weights version {version!r}: {e}")
    logger.info("reset_cache: keys move to %s (weights version %r -> %r%s)",
                steps.key_builders[0].prefix if steps.key_builders else "?", before, version,
                f", reset epoch {epoch}" if epoch else "")
    steps.forget_store_knowledge()
    if steps.events is not None:
        steps.events.store_reset()
    removals.submit(old)
    steps.stats.add("resets")
    logger.info("reset_cache: keys matching %s queued for removal", old)
    return True
