"""The live requests' states on the scheduler side: what it knows of each from its arrival (`on_new_request`)
to its finish, and the one rule of what a state forgets when a generation ends or the store is wiped.

One `_RequestState` per live request in `_RequestTable`, which keeps two indexes over them (requests with a
deferred save, in retry order; the lookup cache's LRU order), so a step costs O(scheduled + deferred), not
O(live requests). The generation is ``request.num_preemptions``, read in one place (`generation_of`).
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvledger_connector.scheduler.plan import generation_of


class Forget(enum.Enum):
    """Why a request's state forgets what it knew (`_RequestState.forget`, the one reset rule)."""
    GENERATION = "generation"  # a preemption ended the generation: its saves start again from block 0
    STORE = "store"  # the store was wiped (a reset): cached answers and save progress name keys now gone


@dataclass(frozen=True)
class _Lookup:
    generation: int
    num_computed_tokens: int
    hit_tokens: int
    tail_hash: bytes | None = None  # the partial tail counted in hit_tokens, if it was


@dataclass
class _RequestState:
    """What the scheduler side knows of one live request. The save fields are per generation."""

    # vLLM's Request (or the driver's `RequestLike`), read live: its computed tokens, block hashes and
    # preemptions move while it runs, and a step is handed req_ids only (`emit_stores`)
    request: Any
    generation: int  # the generation the save fields below describe
    saved_blocks: int = 0  # full blocks covered by emitted store jobs (this generation)
    sent_blocks: int = 0  # table blocks whose ids and hashes a SaveSpec of this generation carried
    tail_done: bool = False  # the prompt's partial tail was saved, loaded or given up (this generation)
    tail_stored: bool = False  # ... and it is in the store (saved or loaded): the model's chunk NumChunks
    deferred: bool = False  # the cap deferred its next save: retried in later steps
    defers: int = 0  # times a save of it was deferred (a held request's retry tells "deferred again" by it)
    lookup: _Lookup | None = None
    loaded_blocks: int = 0  # blocks [0, n) of a load from block 0 (this generation); see `load_done`
    loaded_tail: bool = False  # ... whose last block was the prompt's partial tail
    load_pending: bool = False  # that load's outcome is not applied yet
    prompt_saved: bool = False  # without save_decode: every block a job of this generation may save is covered
    load_dest: tuple[int, ...] = ()  # the destination blocks of its latest load ...
    load_first: int = 0  # ... the first of them being table block `load_first`
    load_failed_at: int | None = None  # the first block a load of this request failed on: lookups stop there
    requeue: bool = False  # an async load of it failed under "recompute": its next lookup answers "not yet" once
    # a deferred job's blocks that vLLM may give back before its retry (a Mamba group's offered states, a
    # sliding-window group's blocks): (group, block position) -> (block id, vLLM's prefix-cache record of
    # the block then); at most one per such group and block of the request (this generation)
    kept_blocks: dict[tuple[int, int], tuple[int, object]] = field(default_factory=dict)

    def forget(self, why: Forget) -> None:
        """The one reset rule: what this state forgets when its generation ends (a preemption) or the store
        was wiped. Either way the save progress, the cached lookup and a pending load's outcome go, and a
        deferred save is no longer retried. A new generation also starts sending its ids from block 0 and
        drops a pending requeue; a wiped store keeps what the ranks hold (sent ids) but forgets where a load
        failed (those keys are gone too), which a new generation keeps (its lookups still stop there)."""
        self.saved_blocks = 0
        self.tail_done = self.tail_stored = False
        self.deferred = False
        self.kept_blocks = {}
        self.lookup = None
        self.loaded_blocks = 0
        self.loaded_tail = self.load_pending = self.prompt_saved = False
        if why is Forget.GENERATION:
            self.sent_blocks = 0
            self.requeue = False
            self.generation = generation_of(self.request)
        else:
            self.load_failed_at = None


class _RequestTable:
    """The live requests' states, plus the deferred index and the lookup LRU order (both derived: only
    these methods change them)."""

    def __init__(self, max_lookups: int) -> None:
        self._states: dict[str, _RequestState] = {}
        self._deferred: dict[str, None] = {}  # insertion order = retry order
        self._lookup_lru: OrderedDict[str, None] = OrderedDict()
        self.max_lookups = max_lookups
        self.peak_lookups = 0

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def get(self, req_id: str) -> _RequestState | None:
        return self._states.get(req_id)

    def ensure(self, request: Any) -> _RequestState:
        st = self._states.get(request.request_id)
        if st is None:
            st = self._states[request.request_id] = _RequestState(request, generation_of(request))
        return st

    def current(self, st: _RequestState) -> _RequestState:
        """``st`` with its save fields of the request's current generation: a preemption the connector was
        not told of (``reset_prefix_cache(reset_running_requests=True)`` preempts outside ``schedule()``)
        still starts a new generation, seen here by the generation itself."""
        if st.generation != generation_of(st.request):
            self.new_generation(st.request.request_id)
        return st

    def items(self) -> Iterator[tuple[str, _RequestState]]:
        return iter(list(self._states.items()))

    def drop(self, req_id: str) -> _RequestState | None:
        self._deferred.pop(req_id, None)
        self._lookup_lru.pop(req_id, None)
        return self._states.pop(req_id, None)

    def new_generation(self, req_id: str) -> None:
        st = self._states.get(req_id)
        if st is not None:
            st.forget(Forget.GENERATION)
        self._deferred.pop(req_id, None)
        self._lookup_lru.pop(req_id, None)

    def set_deferred(self, st: _RequestState, deferred: bool) -> None:
        st.deferred = deferred
        if deferred:
            self._deferred[st.request.request_id] = None
        else:
            self._deferred.pop(st.request.request_id, None)

    def deferred_ids(self) -> list[str]:
        return list(self._deferred)

    def set_lookup(self, st: _RequestState, hit: _Lookup) -> None:
        req_id = st.request.request_id
        st.lookup = hit
        self._lookup_lru[req_id] = None
        self._lookup_lru.move_to_end(req_id)
        while len(self._lookup_lru) > self.max_lookups:
            old, _ = self._lookup_lru.popitem(last=False)
            old_st = self._states.get(old)
            if old_st is not None:
                old_st.lookup = None
        self.peak_lookups = max(self.peak_lookups, len(self._lookup_lru))

    def take_lookup(self, st: _RequestState) -> _Lookup | None:
        hit, st.lookup = st.lookup, None
        self._lookup_lru.pop(st.request.request_id, None)
        return hit

    def forget_lookups_and_saves(self) -> None:
        """After the store was wiped (reset_cache): cached answers and save progress describe keys that
        no longer exist."""
        for st in self._states.values():
            st.forget(Forget.STORE)
        self._deferred.clear()
        self._lookup_lru.clear()

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    @property
    def num_lookups(self) -> int:
        return len(self._lookup_lru)
