"""``reset_cache``: drop every key this engine's model writes, and nothing else.

vLLM calls ``connector.reset_cache()`` from ``Scheduler.reset_connector_cache`` (``reset_prefix_cache(...,
reset_connector=True)``, e.g. after an RL weight update, vllm #42694); True = done, False = failed (the engine's
pause-with-clear-cache raises then), None = not implemented (the worker role answers None: the scheduler's
store client does the removal; the workers hold no per-key state that a reset makes wrong).

What is removed: the keys matching exactly this engine's key shapes, one ``remove_by_regex`` on the master::

    ^(?:<prefix of shard 0>|<prefix of shard 1>|...)[0-9a-fn]+$

each prefix ``[<namespace>/]kvl2/<model>/<layout digest>/tp<r>of<n>-pp<p>of<m>/`` escaped (kvledger_connector/
keys.py), the tail the block-hash alphabet of `keys._hash_hex`, anchored at both ends (the master *searches*
each key, so an unanchored prefix would also match inside another namespace's keys). Other models, other
layouts of the same model, other namespaces and other parallel shapes keep their keys. Upstream's Mooncake
store connector calls ``remove_all`` (every tenant's keys). Keys are content addressed: every engine of the
same model, layout, namespace and parallel shape shares these keys, so the reset drops them for all of them
(after a weight update they are all stale alike).

When the reset is refused (returns False, nothing removed): while anything of this engine could still write a
pre-reset block under a key after the wipe, or feed one to a request:

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

After the removal the scheduler side forgets what it learned from the store: cached lookup answers, save
trackers and deferred saves (every live request is at 0 computed tokens, so they re-save from block 0).

A runtime weights version (`weights_version_file`, re-read by the connector at each reset): when it changed,
the removal above takes the old version's keys (this engine's, as always) and then the keys move to the new
version — lookups, KV events, and every rank's jobs through the next step's metadata. That is the one
moment the switch is safe: the refusal rules above leave nothing in flight that was keyed under the old
version. Another engine still on the old weights keeps writing old-version keys; this one never reads them.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvledger_connector.keys import KeyBuilder

if TYPE_CHECKING:
    from kvledger_connector.scheduler import SchedulerSide

logger = logging.getLogger(__name__)

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


def refusal(side: SchedulerSide) -> str | None:
    """Why a reset now would be wrong (see the module doc), or None."""
    ledger = side.ledger
    if ledger is not None and ledger.num_inflight_jobs:
        return f"{ledger.num_inflight_jobs} store jobs in flight (a put landing after the wipe would re-create a key)"
    if side.has_pending_loads():
        return "loads of pre-reset KV pending or in flight"
    busy = side.requests_with_computed_kv()
    if busy:
        return f"{len(busy)} live requests hold computed KV (e.g. {busy[0]!r}) that a later save would store"
    return None


def reset_scheduler_side(side: SchedulerSide, store: Any,
                         new_keys: tuple[str, Sequence[KeyBuilder]] | None = None) -> bool:
    """Remove this engine's keys and forget what the scheduler side learned from the store. False (nothing
    removed) when refused or when the store fails. `new_keys`: (weights version, its key builders), switched
    to once the old version's keys are removed — a moment with nothing in flight, so no job or load keyed
    under the old version outlives the switch."""
    why = refusal(side)
    if why is not None:
        logger.warning("reset_cache refused: %s; retry once the engine is drained", why)
        side.stats.add("resets_refused")
        return False
    remove = getattr(store, "remove_by_regex", None)
    if remove is None:
        logger.warning("reset_cache: the store client %s cannot remove by pattern", type(store).__name__)
        return False
    regex = engine_key_regex(side.key_builders)
    rc = int(remove(regex, True))  # force: a lease (10 s after any put/get/exist) must not keep a stale key
    if rc < 0:
        logger.warning("reset_cache: remove_by_regex(%r) failed with code %d", regex, rc)
        side.stats.add("resets_failed")
        return False
    side.forget_store_knowledge()
    if side.events is not None:
        side.events.store_reset()
    if new_keys is not None and new_keys[0] != side.weights_version:
        logger.info("reset_cache: weights version %r -> %r: keys move to %s", side.weights_version, new_keys[0],
                    new_keys[1][0].prefix if new_keys[1] else "?")
        side.switch_weights_version(*new_keys)
    side.stats.add("resets")
    side.stats.add("reset_removed_keys", rc)
    side.num_resets += 1
    logger.info("reset_cache: removed %d keys matching %s", rc, regex)
    return True
