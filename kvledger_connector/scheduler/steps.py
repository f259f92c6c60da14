"""The scheduler side's decisions as synchronous, thread-free step functions over plain values.

The twin of kvledger_connector/worker/steps.py (the worker side's steps). Nothing here imports vLLM or starts a
thread: a request is read through :class:`RequestLike` (vLLM's ``Request`` is one; the conformance driver
brings its own), block tables and scheduled token counts arrive as plain ids and ints. The connector's
:class:`~kvledger_connector.scheduler.side.SchedulerSide` adapts vLLM's ``SchedulerOutput`` and
``KVConnectorOutput`` to these calls; the replay driver (conformance/kvdriver.py) makes the same calls one
model action at a time, bringing only the schedule and the store. There is no second copy of a rule::

    model action      step                                  decision
    Lookup(r)         SchedulerSteps.ask(req, n) -> keys,    longest run of blocks every shard holds, plus
                      .answer(req, ask, codes)               the prompt's partial tail (opt-in); cached
    EmitLoad(r)       SchedulerSteps.emit_load(req, ids, n)  destination blocks -> SchedulerLedger.pin_load
    EmitStore(r)      SchedulerSteps.emit_stores(sched, tbl) `save_end`, `StoreRange`, `plan_store`: which blocks a
                                                             job pins (the tables' full blocks, then the tail);
                                                             DEFER at the caps, retried in later steps
    Preempt / Finish  SchedulerSteps.notices(fin, pre)       the generation each DropGeneration closes
    Collect           SchedulerSteps.collect(completed)      pins released, ascending job id order
    CollectLoad(r)    SchedulerSteps.collect_loads(req_ids)  load pins released (every rank reported)
                      SchedulerSteps.collect_sync_loads(..)  ... of sync loads, from the ranks' worker metadata

State: one `_RequestState` per live request (on_new_request .. request_finished) in `_RequestTable`, which
keeps two indexes over it (requests with a deferred save; the lookup cache's LRU order) so a step costs
O(scheduled + deferred), not O(live requests). The generation is ``request.num_preemptions``, read in one
place (`generation_of`); a preemption starts a new generation (`_RequestState.new_generation`). Outboxes
(loads pinned this step, requests finished since the last step) are not per-request state: a pinned load
must reach the workers even if its request finishes first, or its pin would never be released.

Every table is bounded: request states by the scheduler's live requests (dropped at finish), the deferred
index by them, cached lookups by ``max_lookup_cache`` (oldest evicted; a miss only costs a repeated
``batch_is_exist``), the load outbox by the requests admitted in a step; load pins (in the ledger) by the
pool: a block is the destination of at most one pinned load.

Partial tails (``save_partial_tail``, off by default, as upstream's): a prompt of L tokens with
r = L mod block_size >= 2 and at least one full block keeps r tokens of KV in its table block k = L // bs.
Once the prompt is computed, the store job that reaches it also puts block k under the tail's own key
(`keys.partial_tail_hash`: the parent block's hash and the r token ids), pinned through the ledger's
``tail_block_ids``. A later request with the same prompt then loads L - 1 tokens instead of k * bs: vLLM
computes the last token itself and overwrites slot r - 1; slots r.. of the loaded block are never read
before decode writes them. The table block is read in place (no copy-on-write): while a job's pin holds
it, nothing rewrites its first r slots — decode writes only slots r.., and a preempted or finished
request's block stays out of the free queue until every rank reported (S1 NoPollution, model: the tail of
tla/KVLedger.tla, mutant NoTailPin). Requests whose hashes carry more than token ids (multimodal inputs,
prompt embeddings) never save or hit a tail: the tail key holds token ids only. A block stored as several
keys (a hybrid model's KV cache groups, the TP-shared layout's head shards) has a tail key per part, each
pinned as a tail block of its group; a tail hits only when every part's key exists. Not for a model with a
Mamba group (refused by `ConnectorConfig`): its state at a partial end is vLLM's copy-on-write hand-off.

Sync loads (``sync_load_max_tokens``): a load of at most that many tokens is answered ``load_kv_async=False``
(`load_is_async`): vLLM schedules its request in the same step and every rank loads it before the forward,
instead of parking the request in WAITING_FOR_REMOTE_KVS. vLLM 0.32 admits waiting requests while fewer
than ``max_num_seqs`` are RUNNING, so parked loaders pile up past that bound, each holding its blocks while
it waits for a slot: under pool pressure that cost the engine steps (a loader held its blocks 17–21 steps on
average). The load is pinned all the same (EmitLoad) and released by the ranks' ``completed_loads``; the
request's save waits until then (the model's EmitStore needs its load done: a save must not read blocks
a failed load left wrong). A req_id that still has a load pinned loads asynchronously: a report applies to
the oldest pinned load of its req_id, and two channels must not race for it. While more than half of the
last ``LOAD_OUTCOME_WINDOW`` loads failed (keys evicted between lookup and get, a holder gone), loads are
async too: a failed sync load spends its get inside the step and saves the request nothing, an async one
fails beside the forward. Async loads report outcomes as well, so loads turn sync again once they succeed.

Loads are sync only under ``kv_load_failure_policy`` "fail" (vLLM's default): vLLM caches a sync load's
blocks in its prefix cache when it allocates them, and on a failed block it evicts them only under "fail";
under "recompute" it leaves them cached, counting on the request to recompute them in its next step — a
preemption first frees them with their hashes, and every later prefix-cache hit (the request's own
resumption too) reads the bytes the failed load left (vLLM 0.32 and 0.33, `Scheduler._handle_invalid_blocks`;
`make demo`'s faults hit it). An async load's blocks are cached only once it finished, its kept prefix only.
Another request scheduled in the same step can hit a sync load's blocks in the prefix cache before they are
loaded; its save waits too while any block it reads is a pinned load's destination.

Loaded blocks count as saved: a load from block 0 whose blocks vLLM kept (its ``num_computed_tokens``
after the load, failed blocks already cut off by ``kv_load_failure_policy``) came from keys the store
holds, so no store job re-reads them (the model's HandleLoadErrors: emitted := kept).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.shape.keys import KeyBuilder, dense_table, partial_tail_hash
from kvledger_connector.metadata import DropNotice, LoadSpec, SaveSpec
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import StoreCode


class RequestLike(Protocol):
    """What the steps read of a request (vLLM's ``vllm.v1.request.Request`` has each field)."""

    request_id: str
    num_preemptions: int
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: Sequence[bytes]
    all_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int] | None


def _leading_nulls(table: Sequence[int], end: int) -> int:
    """How many of a table's first ``end`` blocks are vLLM's null block (0) before its first real one: a
    sliding-window group's blocks below its window, freed by vLLM."""
    for i in range(min(end, len(table))):
        if table[i] != 0:
            return i
    return min(end, len(table))


def generation_of(request: RequestLike) -> int:
    """The request's generation as the connector counts it: admissions that were preempted so far."""
    return int(request.num_preemptions)


def tail_hash(request: RequestLike, num_tokens: int, tokens: Sequence[int] | None, block_size: int
              ) -> bytes | None:
    """The key hash of the first ``num_tokens`` tokens' partial last block, or None when it has none worth
    saving: fewer than 2 tokens past the last full block (a hit must leave one to compute), no full block
    before it (the parent hash carries the cache salt and LoRA of the chain), its full blocks not hashed
    yet, or hashes that cover more than token ids (multimodal, prompt embeddings)."""
    k, r = divmod(num_tokens, block_size)
    if r < 2 or k < 1 or len(request.block_hashes) < k or tokens is None:
        return None
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    return partial_tail_hash(request.block_hashes[k - 1], tokens[k * block_size:num_tokens])


def lookup_keys(key_builders: Sequence[KeyBuilder], hashes: Sequence[bytes]) -> list[str]:
    """The keys a lookup asks ``batch_is_exist`` for, shard-major: every hash's key under builder 0, then
    under builder 1, ... (`shard_answers` reads the answers back in this order)."""
    return [k for kb in key_builders for k in kb.keys(hashes)]


def shard_answers(res: Sequence[int], num_builders: int, num_hashes: int) -> list[Sequence[int]]:
    """``batch_is_exist``'s answers to `lookup_keys`, one row per key builder: ``rows[s][i]`` answers builder
    ``s``'s key of hash ``i``."""
    if len(res) != num_builders * num_hashes:
        raise LedgerInputError("batch_is_exist", len(res), f"one answer per key ({num_builders * num_hashes})")
    return [res[s * num_hashes:(s + 1) * num_hashes] for s in range(num_builders)]


@dataclass(frozen=True)
class StoreRange:
    """What EmitStore pins and puts for one request: the table's blocks [0, end) (every one: a rank resumes
    from its own saved offset, which can lag), then, when ``tail`` is set, table block ``end``, the
    prompt's partial tail, stored under the tail key ``tail``."""

    start: int  # full blocks already covered by earlier jobs (or a load) of this generation
    end: int
    tail: bytes | None
    tail_tokens: int

    @property
    def reach(self) -> int:
        """Table blocks the job reads."""
        return self.end + (self.tail is not None)


def save_end(*, token_len: int, num_prompt_tokens: int, num_tokens: int, num_hashes: int, block_size: int,
             save_decode: bool) -> int:
    """EmitStore's end: the full blocks whose KV exists once ``token_len`` tokens are computed (the
    prompt's, or every token's with ``save_decode``) and have a hash."""
    limit = num_tokens if save_decode else num_prompt_tokens
    return min(min(token_len, limit) // block_size, num_hashes)


@dataclass(frozen=True)
class StorePlan:
    """One store job's blocks (`plan_store`)."""

    rows: tuple[tuple[int, ...], ...]  # each KV cache group's table as the job reads it (null: nothing there)
    pins: tuple[int, ...]  # blocks of [0, end) the job pins, group by group
    tail_pins: tuple[int, ...]  # the partial tail's block, one per group that holds one
    sent_ids: tuple[int, ...]  # ids of blocks [sent_blocks, reach) the ranks get, block major, one per group
    null_before: tuple[int, ...]  # per group, its null blocks before its first real one in [0, end); () dense
    kept_used: int  # null positions filled from a deferred job's kept blocks
    kept_expired: tuple[tuple[int, int], ...]  # kept blocks due here whose prefix-cache record changed


def plan_store(rng: StoreRange, tables: Sequence[Sequence[int]], *, sent_blocks: int, block_size: int,
               dense: bool, state_groups: frozenset[int], offers: Sequence[tuple[int, int, int]],
               kept: Mapping[tuple[int, int], tuple[int, bool]], reachable: Mapping[int, Sequence[bool]]
               ) -> StorePlan:
    """EmitStore's choice of blocks for the job of `rng`, from plain values: the request's tables (one per KV
    cache group, each at least ``rng.reach`` long), the blocks [0, sent_blocks) whose ids the ranks hold
    already, vLLM's Mamba hand-offs of this step (``offers``: (group, block id, boundary tokens)), a deferred
    job's kept blocks ((group, block) -> (block id, its prefix-cache record unchanged)) and each sliding-window
    group's mask of blocks [sent_blocks, end) a later hit can use. The rows are rewritten in that order (state
    offers, kept blocks, masks). Null ids are nothing to pin: dropped here, the one place (the ledger refuses
    them); with ``dense`` (one full-attention group, `keys.dense_table`) the table is the request's every
    block and the ranks get no null positions."""
    lo, hi = sent_blocks, rng.end
    rows = _state_rows(tables, offers, lo, hi, block_size, state_groups)
    rows, kept_used, kept_expired = _with_kept_blocks(rows, kept, lo, hi)
    rows = _reachable_rows(rows, reachable, lo, hi)
    pins = tuple(b for t in rows for b in t[:hi] if b != 0)
    tail_pins = tuple(t[p] for t in rows for p in range(hi, rng.reach) if t[p] != 0)
    null_before = () if dense else tuple(_leading_nulls(t, hi) for t in rows)
    sent_ids = tuple(t[p] for p in range(lo, rng.reach) for t in rows)
    return StorePlan(tuple(tuple(t) for t in rows), pins, tail_pins, sent_ids, null_before, kept_used, kept_expired)


def _state_rows(tables: Sequence[Sequence[int]], offers: Sequence[tuple[int, int, int]], lo: int, hi: int,
                block_size: int, state_groups: frozenset[int]) -> list[Sequence[int]]:
    """The tables with each Mamba group's row replaced by this step's offered states in blocks [lo, hi):
    block p holds the id vLLM handed off for the state after (p + 1) * block_size tokens, else null.
    vLLM's align-mode row is not the states by position (it keeps a running state and nulls the rest),
    and vLLM promises an offered block's bytes only for its step: an earlier step's offer is used only
    as a deferred job's kept block (`_with_kept_blocks`), so a lagging rank never reads a state block
    that was given back."""
    if not state_groups:
        return list(tables)
    at = {(g, tokens // block_size - 1): b for g, b, tokens in offers
          if g in state_groups and tokens > 0 and tokens % block_size == 0 and lo < tokens // block_size <= hi}
    return [[at.get((k, p), 0) for p in range(len(t))] if k in state_groups else t for k, t in enumerate(tables)]


def _with_kept_blocks(tables: list[Sequence[int]], kept: Mapping[tuple[int, int], tuple[int, bool]], lo: int,
                      hi: int) -> tuple[list[Sequence[int]], int, tuple[tuple[int, int], ...]]:
    """The tables with the null positions of [lo, hi) filled from a deferred job's kept blocks whose
    prefix-cache record is unchanged, how many were filled, and the kept blocks due here whose record
    changed (evicted, or the entry moved: not saved)."""
    if not kept:
        return tables, 0, ()
    out = [list(t) for t in tables]
    filled, expired = 0, []
    for (g, p), (block_id, live) in kept.items():
        if not lo <= p < min(hi, len(out[g])) or out[g][p] != 0:
            continue
        if live:
            out[g][p] = block_id
            filled += 1
        else:
            expired.append((g, p))
    return out, filled, tuple(expired)


def _reachable_rows(tables: list[Sequence[int]], reachable: Mapping[int, Sequence[bool]], lo: int, hi: int
                    ) -> list[Sequence[int]]:
    """The tables with each sliding-window group's blocks [lo, hi) that no later hit can use (its mask in
    ``reachable``) made null: nothing to pin or put. Blocks before ``lo`` were sent already and keep what
    they were sent as."""
    if not reachable or hi <= lo:
        return tables
    out = list(tables)
    for k, mask in reachable.items():
        if len(mask) != hi - lo:
            raise LedgerInputError("reachable_blocks", len(mask), f"one per block of [{lo}, {hi})")
        row = list(tables[k])
        for i, keep in enumerate(mask):
            if not keep:
                row[lo + i] = 0
        out[k] = row
    return out


@dataclass(frozen=True)
class _Lookup:
    generation: int
    num_computed_tokens: int
    hit_tokens: int
    tail_hash: bytes | None = None  # the partial tail counted in hit_tokens, if it was


@dataclass(frozen=True)
class LookupAsk:
    """The store call a lookup needs (`SchedulerSteps.ask`): `batch_is_exist` of ``keys``, in `lookup_keys`'
    order, for the blocks ``hashes`` from block ``start`` and the partial ``tail``."""
    keys: tuple[str, ...]
    generation: int
    num_computed_tokens: int
    start: int
    hashes: tuple[Any, ...]
    tail: bytes | None


@dataclass
class _RequestState:
    """What the scheduler side knows of one live request. The save fields are per generation."""

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

    def new_generation(self) -> None:
        self.saved_blocks = self.sent_blocks = 0
        self.tail_done = self.tail_stored = False
        self.deferred = False
        self.kept_blocks = {}
        self.lookup = None
        self.loaded_blocks = 0
        self.loaded_tail = self.load_pending = self.prompt_saved = False
        self.requeue = False


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
            st.new_generation()
            st.generation = generation_of(st.request)
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
            st.lookup = None
            st.saved_blocks = 0
            st.tail_done = st.tail_stored = False
            st.deferred = False
            st.kept_blocks = {}
            st.loaded_blocks = 0
            st.loaded_tail = st.load_pending = st.prompt_saved = False
            st.load_failed_at = None  # the keys a load failed on are gone too
        self._deferred.clear()
        self._lookup_lru.clear()

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    @property
    def num_lookups(self) -> int:
        return len(self._lookup_lru)


#: the step errors kept for the adapter's log (`SchedulerSteps.errors`)
MAX_STEP_ERRORS = 64
#: a refused load's reason as the ranks get it (`LoadSpec.refused`)
MAX_REFUSAL_CHARS = 200

# the loads whose outcomes decide whether a short load may still run inside the step (`load_is_async`)
LOAD_OUTCOME_WINDOW = 16

#: a request's block tables (one per KV cache group, as vLLM's ``get_block_ids()``) by req_id, or None when
#: the scheduler has none for it now
TableOf = Callable[[str], "Sequence[Sequence[int]] | None"]


class SchedulerSteps:
    """The scheduler side's state and decisions. Called from one thread (vLLM's scheduler, or the replay
    driver): no lock. ``ledger`` is bound once the block pool is known (`bind_ledger`)."""

    def __init__(self, config: ConnectorConfig, *, key_builders: Sequence[KeyBuilder],
                 stats: StatsRecorder | None = None, trace: TraceSink | None = None,
                 weights_version: str = "") -> None:
        """``config``: the connector's, checked whole where it was built (`ConnectorConfig`): every setting
        these steps read is its, under its name."""
        if not isinstance(config, ConnectorConfig):
            raise LedgerInputError("config", type(config).__name__, "must be a ConnectorConfig")
        self.config = config
        self.sync_load_max_tokens = config.sync_load_max_tokens
        self.kv_load_failure_policy = config.kv_load_failure_policy
        self.block_size = config.block_size
        self.world_size = config.world_size
        self.key_builders = list(key_builders)  # one per tensor-parallel shard: a hit needs every shard
        self.weights_version = weights_version  # the key builders' (in every step's metadata for the workers)
        self.reset_epoch = ""  # the key builders' reset epoch (scheduler/reset.py; in every step's metadata)
        # KV cache groups of a hybrid model: block tables come one per group (vLLM's tuple of lists), a
        # block's keys one per group (key_builders holds every shard's and group's), and every load is
        # asynchronous (vLLM takes a failed load of several groups per request, not per block)
        self.num_groups = config.num_groups
        # Mamba groups in vLLM's "align" mode: a block holds the state after its last token, saved only from
        # the exact blocks vLLM offers (`emit_stores`' boundary_states) and needed only at a hit's end
        self.state_groups = frozenset(kb.layout.group for kb in self.key_builders if kb.layout.is_state)
        self.sliding_groups = frozenset(kb.layout.group for kb in self.key_builders if kb.layout.window is not None)
        # one full-attention group (`keys.dense_table`): a table is the request's every block; else every
        # group's rule applies (null ids nothing to pin or load, loads async and failed per request)
        self.dense_table = dense_table(kb.layout for kb in self.key_builders)
        # vLLM's own rule for which of a sliding-window group's blocks a later hit can use (the blocks its
        # local prefix cache keeps: `reachable_block_mask`): (request, group, start block, end block) -> a
        # mask of blocks [start, end), or None for all. Set by the connector from vLLM's KV cache manager;
        # None here: every block is saved
        self.reachable_blocks: Callable[[Any, int, int, int], Sequence[bool] | None] | None = None
        # vLLM's prefix-cache record of a block (block id -> its `block_hash` while the cache holds the block's
        # bytes, None once evicted; an entry vLLM moves away before overwriting the block leaves it too). A
        # deferred job keeps the blocks vLLM may give back before its retry (Mamba state offers, which live
        # one step; sliding-window blocks, freed once outside the window) and uses each while its record is
        # unchanged: the block still holds those bytes, as for vLLM's own prefix hits. Set by the connector
        # from vLLM's BlockPool; None here: a deferred job saves only what its request still holds
        self.block_hash_of: Callable[[int], object | None] | None = None
        self.max_pinned_blocks = config.max_pinned_blocks
        self.save_enabled = config.save_enabled  # kv_role kv_producer | kv_both
        self.load_enabled = config.load_enabled  # kv_role kv_consumer | kv_both
        self.save_decode = config.save_decode
        self.save_partial_tail = config.save_partial_tail
        self.max_lookup_cache = config.max_lookup_cache
        self.stats = stats or StatsRecorder()
        self.trace = trace
        self.ledger: SchedulerLedger | None = None
        self._reqs = _RequestTable(config.max_lookup_cache)
        # outboxes, drained once per step
        self._loads_out: list[LoadSpec] = []  # loads pinned since the last step
        self._finished_out: dict[str, int] = {}  # req_id -> generation, finished since the last step
        # Held requests: finished while the caps deferred their save, kept by vLLM (`request_finished` delayed
        # the free) until that save is stored. req_id -> the store job of it (None: still deferred; -1:
        # nothing left in flight). Then released: its finish notice goes out with ``release`` (every rank
        # answers finished_sending, vLLM frees the blocks), and it waits in ``_freeing`` until vLLM reports
        # it so. Both bounded together by ``max_held_requests``.
        self.max_held_requests = config.max_held_requests
        self._held: dict[str, int | None] = {}
        self._freeing: dict[str, None] = {}
        # whole-run counts with no counter in kvledger_connector.telemetry.stats.COUNTERS yet (tests, demo report)
        self._load_outcomes: deque[bool] = deque(maxlen=LOAD_OUTCOME_WINDOW)  # True: the load failed
        self._failed_loads: set[str] = set()  # req_ids of pinned loads with a noted load error
        self.peak_held_requests = 0  # most held (deferred, or released and not yet freed) at once
        # inputs a step could not serve, newest last (the adapter logs them); bounded: the count is in stats
        self.errors: deque[str] = deque(maxlen=MAX_STEP_ERRORS)
        # KV events for routers (kvledger_connector/telemetry/events.py); set by the connector when kv events
        # are enabled
        self.events: Any = None

    # ------------------------------------------------------------------ binding
    def bind_ledger(self, ledger: SchedulerLedger) -> None:
        self.ledger = ledger

    def _ledger(self) -> SchedulerLedger:
        if self.ledger is None:
            raise LedgerInputError("block_pool", None, "bind_gpu_block_pool was not called")
        return self.ledger

    def on_new_request(self, request: RequestLike) -> None:
        self._reqs.ensure(request)

    def _due_tail(self, st: _RequestState, token_len: int, end: int) -> bytes | None:
        """The prompt's partial tail hash when this job should carry it: tails on, not done this generation,
        the prompt computed by the end of this step. Gives the tail up (done) when there is none or decode
        already filled block k (saved whole instead)."""
        request = st.request
        if not self.save_partial_tail or st.tail_done or token_len < request.num_prompt_tokens:
            return None
        k = request.num_prompt_tokens // self.block_size
        tail = tail_hash(request, request.num_prompt_tokens, request.prompt_token_ids, self.block_size)
        if tail is None or end > k:
            st.tail_done = True
            return None
        return tail

    # ------------------------------------------------------------------ Lookup
    def requeue_after_failed_load(self, request: RequestLike) -> bool:
        """Whether this lookup must answer "not known yet" (vLLM: ``None``, the request is skipped for this
        step), once after an async load of the request failed under ``recompute``. vLLM (0.32, 0.33) then
        frees every block of a request whose load failed as a whole (several KV cache groups; a failure at the
        hit's first block) but leaves it at the head of its queue of requests holding KV blocks
        (``kv_holding_waiting``), where it must now fit its whole prompt: when it does not, ``schedule()``
        stops there every step and never reaches the parked requests behind it whose blocks it would need,
        though their loads finished (running 0: a stall). Skipped without blocks, vLLM moves it to its
        ``waiting`` queue, so the parked requests behind it are promoted and go on."""
        st = self._reqs.get(request.request_id)
        if st is None or not self._reqs.current(st).requeue:
            return False
        st.requeue = False
        self.stats.add("failed_load_requeues")
        return True

    def ask(self, request: RequestLike, num_computed_tokens: int) -> int | LookupAsk:
        """Lookup, first half: the answer when there is one without the store (tokens beyond
        ``num_computed_tokens``: 0 with loads off or nothing to ask; the cached answer of the same question,
        per (req_id, generation, num_computed_tokens) while it waits), else the one store call to make
        (`LookupAsk`), whose codes go to `answer`. The steps make no store call: the caller does
        (`kvledger_connector.scheduler.side.ask_store`)."""
        st = self._reqs.ensure(request)
        if not self.load_enabled:  # nothing to ask, nothing to cache
            return 0
        gen = generation_of(request)
        hit = st.lookup
        if hit is not None and hit.generation == gen and hit.num_computed_tokens == num_computed_tokens:
            return max(hit.hit_tokens - num_computed_tokens, 0)
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if st.load_failed_at is not None:  # see `note_load_errors`
            end = min(end, st.load_failed_at)
        hashes = tuple(request.block_hashes[start:end]) if end > start else ()
        tail = None
        if self.save_partial_tail and end == request.num_tokens // bs:  # every full block is asked for
            tail = tail_hash(request, request.num_tokens, request.all_token_ids, bs)
        if not hashes and tail is None:
            self._reqs.set_lookup(st, _Lookup(gen, num_computed_tokens, num_computed_tokens))
            return 0
        asked = list(hashes) + ([tail] if tail is not None else [])
        return LookupAsk(tuple(lookup_keys(self.key_builders, asked)), gen, num_computed_tokens, start, hashes, tail)

    def answer(self, request: RequestLike, ask: LookupAsk, codes: Sequence[int] | None) -> int:
        """Lookup, second half: the store's codes for ``ask.keys`` (None: the call raised) -> the tokens
        beyond ``ask.num_computed_tokens`` that every shard holds (block aligned unless a partial tail hits;
        never the whole prompt: vLLM must compute at least one token), cached for the same question."""
        st = self._reqs.ensure(request)
        hit = self._hit(request, ask, codes)
        self._reqs.set_lookup(st, hit)
        return max(hit.hit_tokens - ask.num_computed_tokens, 0)

    def _hit(self, request: RequestLike, ask: LookupAsk, codes: Sequence[int] | None) -> _Lookup:
        bs, gen, start = self.block_size, ask.generation, ask.start
        self.stats.add("lookups")
        if codes is None:  # the store wrapper returns codes; only a raising test double gets here
            self.stats.fail_code(int(StoreCode.CLIENT_EXCEPTION), len(ask.keys))
            return _Lookup(gen, ask.num_computed_tokens, ask.num_computed_tokens)
        n = len(ask.hashes)
        rows = shard_answers(codes, len(self.key_builders), n + (ask.tail is not None))
        run = self._hit_run(rows, start, n)
        if self.events is not None and n:  # an announced block found missing: BlockRemoved
            self.events.looked_up(list(ask.hashes), [row[i] for row in rows for i in range(n)])
        if ask.tail is not None and run == n and all(row[n] == 1 for row in rows):
            self.stats.add("tail_hits")
            self.stats.add("lookup_hit_tokens", request.num_tokens - 1 - ask.num_computed_tokens)
            return _Lookup(gen, ask.num_computed_tokens, request.num_tokens - 1, ask.tail)
        self.stats.add("lookup_hit_tokens", run * bs)
        return _Lookup(gen, ask.num_computed_tokens, (start + run) * bs)

    def _hit_run(self, rows: Sequence[Sequence[int]], start: int, n: int) -> int:
        """The hit, in blocks past ``start``, from the lookup's answers (`shard_answers`), by vLLM's
        allocation rule: the longest h such that every full-attention key of blocks [start, start + h)
        exists and, for each sliding-window group of span W (a hybrid model), every key of the blocks vLLM
        leaves non-null for a hit ending at H = (start + h) * bs: those holding positions from H - W + 1 on;
        for each Mamba group ("align" mode), the state key of block start + h - 1 (the state after H
        tokens: vLLM's hit is that one snapshot). A sliding or state key below that never shortens the hit.
        Without sliding or state groups: the longest run every builder holds."""
        bs = self.block_size
        windows = [kb.layout.window for kb in self.key_builders]
        state = [s for s, kb in enumerate(self.key_builders) if kb.layout.is_state]
        full = [s for s, w in enumerate(windows) if w is None and s not in state]
        top = 0
        while top < n and all(rows[s][top] == 1 for s in full):
            top += 1
        sliding = [(s, w) for s, w in enumerate(windows) if w is not None]
        for h in range(top, 0, -1):
            end = start + h
            if all(rows[s][h - 1] == 1 for s in state) and all(
                    rows[s][i] == 1 for s, w in sliding
                    for i in range(max(start, (end * bs - w + 1) // bs) - start, h)):
                return h
        return 0

    def load_is_async(self, req_id: str, num_external_tokens: int) -> bool:
        """vLLM's ``load_kv_async`` for an external hit of ``num_external_tokens``: False (loaded inside the
        step that schedules the request) up to ``sync_load_max_tokens`` under the "fail" policy, unless the
        req_id still has a load pinned (its reports would race), or while most recent loads failed. See the
        module's notes for each."""
        return (num_external_tokens > self.sync_load_max_tokens or self.kv_load_failure_policy != "fail"
                or not self.dense_table
                or (self.ledger is not None and self.ledger.has_pinned_load(req_id))
                or self.loads_mostly_fail())

    def loads_mostly_fail(self) -> bool:
        """More than half of the last ``LOAD_OUTCOME_WINDOW`` loads' outcomes were failures."""
        return 2 * sum(self._load_outcomes) > len(self._load_outcomes)

    # ------------------------------------------------------------------ EmitLoad
    def emit_load(self, request: RequestLike, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> LoadSpec | None:
        """EmitLoad: the destination blocks of the lookup's external hit (``block_ids``: the request's tables
        as allocated for it, one per KV cache group), pinned in the ledger before any worker can be told (S9
        LoadsPinned); the LoadSpec waits in the outbox for the step's metadata. None when there is nothing to
        load. With several groups every non-null block of the hit's positions loads
        (a sliding-window group's blocks below its window are vLLM's null block: nothing to load)."""
        if num_external_tokens <= 0:
            return None
        req_id = request.request_id
        st = self._reqs.get(req_id)
        hit = st.lookup if st is not None else None  # taken once the load is pinned (else `refuse_load` reads it)
        if st is None or hit is None or hit.generation != generation_of(request):
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"no lookup answered an external hit for {req_id!r}")
        bs = self.block_size
        first = hit.num_computed_tokens // bs
        last = -(-(hit.num_computed_tokens + num_external_tokens) // bs)
        hashes = list(request.block_hashes[first:last])
        tail = hit.tail_hash is not None and last == len(request.block_hashes) + 1
        if tail:
            hashes.append(hit.tail_hash)  # the partial last block loads from the tail's key
        tables = self._tables(block_ids)
        if last > min(len(t) for t in tables) or len(hashes) != last - first:
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"{req_id!r} has {len(tables[0])} blocks, {len(request.block_hashes)} hashes")
        groups: tuple[int, ...] = ()
        if self.dense_table:
            dest = tuple(tables[0][first:last])
        else:  # a Mamba group loads the one state block at the hit's end (vLLM reads the state there)
            at = [(g, p) for g, t in enumerate(tables) for p in range(first, last) if t[p] != 0
                  and (g not in self.state_groups or p == last - 1)]
            dest = tuple(tables[g][p] for g, p in at)
            hashes = [hashes[p - first] for _, p in at]
            groups = tuple(g for g, _ in at)
        self._reqs.current(st)
        # the answer `get_num_new_matched_tokens` gave in this schedule() (nothing is collected in between),
        # taken before this load's own pin
        sync = not self.load_is_async(req_id, num_external_tokens)
        if not sync and num_external_tokens <= self.sync_load_max_tokens and self.loads_mostly_fail():
            self.stats.add("async_after_failures")  # a short load made async: most recent loads failed
        self._ledger().pin_load(req_id, dest)  # EmitLoad: before the workers can be told of the load
        self._reqs.take_lookup(st)
        st.load_dest, st.load_first = dest, first
        spec = LoadSpec(req_id, dest, tuple(hashes), sync=sync, groups=groups)
        self._loads_out.append(spec)
        self.stats.add("sync_loads", int(sync))
        if first == 0:  # blocks before `first` are local prefix-cache hits, not known to be stored
            st.loaded_blocks, st.loaded_tail, st.load_pending = last, tail, True
        self.stats.add("loads_emitted")
        self.stats.add("loaded_tokens", num_external_tokens)
        return spec

    def refuse_load(self, request: RequestLike, block_ids: Any, num_external_tokens: int, reason: str
                    ) -> LoadSpec | None:
        """A load `emit_load` could not plan (an input it cannot serve), after vLLM was told of the hit: its
        request must neither wait for ever (an async load) nor compute on blocks never loaded. Every block of
        the request's tables that a load may be pinned to (real, unique, not another load's destination) is
        pinned and the ranks report each failed without reading the store (`LoadSpec.refused`); vLLM then
        recomputes them (or fails the request, by its policy). The blocks are those of the hit's positions
        when its lookup is known (vLLM's local prefix hit before them is other requests' too: reporting it
        would fail them as well), else every block. None when no block could be pinned."""
        req_id = request.request_id
        st = self._reqs.get(req_id)
        hit = self._reqs.take_lookup(st) if st is not None else None
        first, last = 0, None
        if hit is not None and num_external_tokens.__class__ is int:
            first = hit.num_computed_tokens // self.block_size
            last = -(-(hit.num_computed_tokens + num_external_tokens) // self.block_size)
        self.stats.add("refused_loads")
        self.errors.append(f"load of {req_id!r} ({num_external_tokens} tokens) refused: {reason}")
        ledger = self._ledger()
        try:
            tables = self._tables(block_ids)
        except LedgerInputError:
            tables = []
        dest: list[int] = []
        for t in tables:
            for b in list(t)[first:last] if isinstance(t, (list, tuple)) else ():
                if b.__class__ is int and b > 0 and b not in dest and ledger.load_owner(b) is None:
                    dest.append(b)
        sync = not self.load_is_async(req_id, num_external_tokens)
        try:
            ledger.pin_load(req_id, dest)
        except LedgerInputError as e:  # nothing in the pool to pin: the ranks could not report it either
            self.errors.append(f"refused load of {req_id!r}: no block to report failed: {e}")
            return None
        spec = LoadSpec(req_id, tuple(dest), (), sync=sync, refused=reason[:MAX_REFUSAL_CHARS])
        self._loads_out.append(spec)
        return spec

    def _tables(self, tables: Any) -> list[Sequence[int]]:
        """The request's block tables, one per KV cache group (vLLM's ``KVCacheBlocks.get_block_ids()``)."""
        if not isinstance(tables, (list, tuple)) or len(tables) != self.num_groups:
            got = len(tables) if isinstance(tables, (list, tuple)) else type(tables).__name__
            raise LedgerInputError("block_ids", got, f"one table per KV cache group ({self.num_groups})")
        return list(tables)

    def take_loads(self) -> list[LoadSpec]:
        """The loads pinned since the last step, for this step's metadata."""
        out, self._loads_out = self._loads_out, []
        return out

    def load_done(self, request: RequestLike) -> None:
        """The load's outcome is applied: vLLM cut the failed blocks off (``kv_load_failure_policy``), so
        ``num_computed_tokens`` counts only the loaded blocks it kept. Those came from keys the store holds:
        they count as saved (no store job re-reads them; the model's HandleLoadErrors: emitted := kept).
        The connector calls it at the request's first save after its load pin was released (vLLM
        applies the outcome in the step that reports the load finished, before it schedules the request
        again); the replay driver where the model handles the load's errors."""
        st = self._reqs.get(request.request_id)
        if st is None or not self._reqs.current(st).load_pending:
            return
        kept = min(st.loaded_blocks, request.num_computed_tokens // self.block_size)
        if st.loaded_tail and request.num_computed_tokens >= request.num_prompt_tokens - 1:
            st.tail_done = st.tail_stored = True  # the tail was loaded whole: nothing to save again
        st.saved_blocks = max(st.saved_blocks, kept)
        st.loaded_blocks, st.loaded_tail, st.load_pending = 0, False, False

    def emitted_blocks(self, req_id: str) -> int:
        """Blocks of the request's current generation in the store or on their way: full blocks, plus the
        partial tail (the model's ``emitted``)."""
        st = self._reqs.get(req_id)
        if st is None:
            return 0
        st = self._reqs.current(st)
        return st.saved_blocks + st.tail_stored

    # ------------------------------------------------------------------ Preempt / Finish
    def notices(self, finished_req_ids: Sequence[str], preempted_req_ids: Sequence[str]) -> list[DropNotice]:
        """This step's DropGeneration notices, in the order they happened (the finishes since the last
        step, then this step's preemptions), each with the generation it closes: a finished req_id's as it
        was when it finished (`request_finished`), a preempted one's the generation that just ended (vLLM
        counted the preemption already); None for a req_id never seen. A preempted request starts a new
        generation that saves from block 0. A finished req_id is not forgotten here: `request_finished` did
        that when it finished, and forgetting again would wipe a NEW request reusing the id, admitted in
        this very step."""
        trace = self.trace
        drops: list[DropNotice] = []
        for req_id in finished_req_ids:
            if req_id in self._held or req_id in self._freeing:
                continue  # held: its notice goes out when it is released (ranks still take its save)
            drops.append(DropNotice(req_id, self._finished_out.get(req_id), True))
            if trace is not None:  # the notice every rank gets (a DropGeneration each)
                trace.emit("sched", "Finish", {"req_id": req_id, "generation": drops[-1].generation})
        self._finished_out.clear()
        for req_id in preempted_req_ids:
            st = self._reqs.get(req_id)
            drops.append(DropNotice(req_id, max(generation_of(st.request) - 1, 0) if st is not None else None,
                                    False))
            if trace is not None:
                trace.emit("sched", "Preempt", {"req_id": req_id, "generation": drops[-1].generation})
            self._reqs.new_generation(req_id)
        return drops

    def request_finished(self, request: RequestLike, *, may_hold: bool = True) -> bool:
        """Finish: True when vLLM must keep the request's blocks (delay their free): the caps deferred its
        save, and fewer than ``max_held_requests`` are held. It is then held (`held_release_due`) until that
        save is stored or given up. Otherwise it is forgotten and its notice goes out with the next step; its
        store jobs pinned their own blocks. Past the bound the deferred save is given up (counted), and so
        when ``may_hold`` is False (vLLM ended the request with an error: its blocks may hold what a failed
        load left, never to be stored)."""
        req_id = request.request_id
        st = self._reqs.get(req_id)
        if (may_hold and st is not None and st.deferred and req_id not in self._held
                and len(self._held) + len(self._freeing) < self.max_held_requests):
            self._held[req_id] = None
            self.peak_held_requests = max(self.peak_held_requests, self.num_held_requests)
            self.stats.add("held_requests")
            return True
        st = self._reqs.drop(req_id)
        if st is not None and st.deferred:
            self._give_up_save()
        self._finished_out[req_id] = generation_of(request)
        return False

    def releases(self) -> list[DropNotice]:
        """ReleaseHeld for every held request due (`held_release_due`): their notices, after the step's others."""
        return [self.release_held(req_id) for req_id in self.held_release_due()]

    def held_release_due(self) -> list[str]:
        """ReleaseHeld is due for these held requests: their save was opened and every rank reported it
        (its job's pins released), or nothing of it is left to save."""
        ledger = self._ledger()
        return [req_id for req_id, job in self._held.items()
                if job is not None and (job < 0 or not ledger.is_job_pinned(job))]

    def give_up_held(self, req_id: str) -> None:
        """A held request's deferred save given up (counted): it is released at the next step."""
        st = self._reqs.get(req_id)
        if self._held.get(req_id, 0) is not None or st is None:
            raise LedgerInputError("req_id", req_id, "is not a held request whose save is deferred")
        self._reqs.set_deferred(st, False)
        self._give_up_save()
        self._held[req_id] = -1

    def release_held(self, req_id: str) -> DropNotice:
        """ReleaseHeld: the held request's finish notice, with ``release``: every rank answers it in
        finished_sending, and vLLM frees the blocks it kept (`note_freed` hears of it)."""
        job = self._held.get(req_id)
        if job is None or (job >= 0 and self._ledger().is_job_pinned(job)):
            raise LedgerInputError("req_id", req_id, "is not a held request whose save is done")
        del self._held[req_id]
        st = self._reqs.drop(req_id)
        gen = generation_of(st.request) if st is not None else None
        self._freeing[req_id] = None
        if self.trace is not None:
            self.trace.emit("sched", "Finish", {"req_id": req_id, "generation": gen})
        return DropNotice(req_id, gen, True, release=True)

    def note_freed(self, finished_sending: Iterable[str] | None) -> None:
        """vLLM's merged ``finished_sending``: these released requests' blocks are freed now."""
        for req_id in finished_sending or ():
            self._freeing.pop(req_id, None)

    @property
    def num_held_requests(self) -> int:
        """Held requests, deferred or released and not yet freed by vLLM."""
        return len(self._held) + len(self._freeing)

    # ------------------------------------------------------------------ EmitStore
    def emit_stores(self, scheduled: Mapping[str, int], table_of: TableOf,
                    boundary_states: Mapping[str, Sequence[tuple[int, int, int]]] | None = None) -> list[SaveSpec]:
        """EmitStore for this step: first the saves the cap deferred, of requests not scheduled now, then
        every scheduled request (``scheduled``: req_id -> tokens scheduled this step). ``boundary_states``:
        vLLM's Mamba hand-offs of this step, req_id -> [(group, block id, boundary tokens)]
        (``KVConnectorBlockState.boundary_state_offloads``), the only blocks a Mamba group saves from."""
        saves: list[SaveSpec] = []
        if self.save_enabled:
            offers = boundary_states or {}
            for req_id in self._reqs.deferred_ids():
                if req_id not in scheduled:
                    saves += self.emit_request_store(req_id, 0, table_of, offers.get(req_id, ()))
            for req_id, n in scheduled.items():
                saves += self.emit_request_store(req_id, n, table_of, offers.get(req_id, ()))
        ledger = self._ledger()
        self.stats.gauge("pins_in_flight", ledger.num_inflight_jobs)
        self.stats.gauge("pinned_blocks", ledger.num_pinned_blocks)
        return saves

    def emit_request_store(self, req_id: str, num_scheduled: int, table_of: TableOf,
                           boundary_states: Sequence[tuple[int, int, int]] = ()) -> list[SaveSpec]:
        """One request's part of `emit_stores` (the replay drives it alone: the model's EmitStore(r) is one
        request's, whatever else is deferred): its job, if one opened."""
        saves: list[SaveSpec] = []
        self._emit_store_guarded(saves, req_id, num_scheduled, table_of, boundary_states)
        return saves

    def _emit_store_guarded(self, saves: list[SaveSpec], req_id: str, num_scheduled: int, table_of: TableOf,
                            boundary_states: Sequence[tuple[int, int, int]]) -> None:
        """`emit_store`, where an input it cannot serve (a table or hashes vLLM's scheduler would never hand
        over) costs that request's save only: given up and counted, the step's other saves go out. A job,
        once opened, is in ``saves`` before anything else can raise: no pin is left without its report. A held
        request's retry that is not deferred again opened its job (released once that is reported) or has
        nothing left to save (released at the next step)."""
        held = self._reqs.get(req_id) if req_id in self._held else None
        n, defers = len(saves), held.defers if held is not None else 0
        try:
            self.emit_store(saves, req_id, num_scheduled, table_of, boundary_states)
        except Exception as e:
            self.errors.append(f"save of {req_id!r} given up: {type(e).__name__}: {e}")
            self.stats.add("save_errors")
            st = self._reqs.get(req_id)
            if st is not None:
                self._reqs.set_deferred(st, False)
                st.kept_blocks = {}
                st.prompt_saved = True  # nothing more of this generation: the same input would fail again
            self._give_up_save()
        if held is not None and held.defers == defers:
            self._reqs.set_deferred(held, False)
            self._held[req_id] = saves[-1].store_job_id if len(saves) > n else -1

    def _kept_blocks(self, st: _RequestState) -> dict[tuple[int, int], tuple[int, bool]]:
        """The blocks a deferred job of this generation kept (`_keep_blocks`), each with whether vLLM's
        prefix-cache record of it is still the one it had then (the block still holds those bytes)."""
        of = self.block_hash_of
        return {at: (block_id, of is not None and of(block_id) == record)
                for at, (block_id, record) in st.kept_blocks.items()}

    def _reachable_masks(self, request: RequestLike, lo: int, hi: int) -> dict[int, Sequence[bool]]:
        """Each sliding-window group's mask of blocks [lo, hi) that a later hit can use, by vLLM's rule
        (`reachable_blocks`); a group without a mask saves every block."""
        if self.reachable_blocks is None or hi <= lo:
            return {}
        masks: dict[int, Sequence[bool]] = {}
        for k in sorted(self.sliding_groups):
            mask = self.reachable_blocks(request, k, lo, hi)
            if mask is not None:
                masks[k] = mask
        return masks

    def _give_up_save(self) -> None:
        self.stats.add("saves_dropped")

    def _defer(self, st: _RequestState, tables: Sequence[Sequence[int]], end: int) -> None:
        """DEFER: the save is retried in a later step, keeping what vLLM may give back meanwhile."""
        self._reqs.set_deferred(st, True)
        st.defers += 1
        self._keep_blocks(st, tables, st.sent_blocks, end)

    def _keep_blocks(self, st: _RequestState, tables: Sequence[Sequence[int]], lo: int, hi: int) -> None:
        """A deferred job's blocks [lo, hi) of its Mamba and sliding-window groups, kept with vLLM's record of
        each (`block_hash_of`) for its retry; a block the prefix cache does not record is not kept
        (nothing would say its bytes stayed)."""
        kept: dict[tuple[int, int], tuple[int, object]] = {}
        if self.block_hash_of is not None:
            for g in self.state_groups | self.sliding_groups:
                row = tables[g]
                for p in range(lo, min(hi, len(row))):
                    if row[p] != 0 and (record := self.block_hash_of(row[p])) is not None:
                        kept[(g, p)] = (row[p], record)
        st.kept_blocks = kept

    def emit_store(self, saves: list[SaveSpec], req_id: str, num_scheduled: int, table_of: TableOf,
                   boundary_states: Sequence[tuple[int, int, int]] = ()) -> None:
        """One request's EmitStore: `save_end` and the due tail make the `StoreRange`, `plan_store` the blocks
        its job pins (the tail block as ``tail_block_ids``) and sends, opened by `SchedulerLedger.open_job`; or
        DEFER at the caps (the blocks stay the request's; retried in a later step), or dropped when the job
        could never be admitted (a cache miss)."""
        st = self._reqs.get(req_id)
        if st is None or st.prompt_saved and st.generation == generation_of(st.request):
            return  # decode steps of a saved prompt: nothing to decide
        if self._ledger().has_pinned_load(req_id):
            return  # a sync load (this step's or earlier) not reported yet: its outcome is not known
        request = st.request
        bs = self.block_size
        token_len = request.num_computed_tokens + num_scheduled  # KV that exists after this step
        end = save_end(token_len=token_len, num_prompt_tokens=request.num_prompt_tokens,
                       num_tokens=request.num_tokens, num_hashes=len(request.block_hashes), block_size=bs,
                       save_decode=self.save_decode)
        if st.load_pending:
            self.load_done(request)  # first: a loaded tail is done
        saved = self._reqs.current(st).saved_blocks
        tail = self._due_tail(st, token_len, end)
        if end <= saved and tail is None:
            self._note_prompt_saved(st)
            return
        rng = StoreRange(saved, end, tail, request.num_prompt_tokens % bs if tail is not None else 0)
        found = table_of(req_id)
        if found is None:
            return
        tables = self._tables(found)
        if min(len(t) for t in tables) < rng.reach:
            return
        plan = plan_store(rng, tables, sent_blocks=st.sent_blocks, block_size=bs, dense=self.dense_table,
                          state_groups=self.state_groups, offers=boundary_states, kept=self._kept_blocks(st),
                          reachable=self._reachable_masks(request, st.sent_blocks, rng.end))
        for at in plan.kept_expired:  # evicted, or its entry moved: that block is not saved
            del st.kept_blocks[at]
            self.stats.add("expired_kept_blocks")
        ledger = self._ledger()
        if ledger.num_load_pinned_blocks and ledger.any_load_destination(plan.pins + plan.tail_pins):
            # another request's sync load of this step writes a block this save reads (a prefix-cache hit
            # on it): its bytes are not known until the ranks report; retried in a later step
            self._defer(st, plan.rows, rng.end)
            return
        if len(plan.pins) + len(plan.tail_pins) > self.max_pinned_blocks:  # never admitted: a cache miss
            self._give_up_save()
            st.saved_blocks, st.tail_done = rng.end, True
            st.kept_blocks = {}
            self._note_prompt_saved(st)
            return
        gen = generation_of(request)
        sent = st.sent_blocks  # the ranks hold the ids and hashes of blocks [0, sent) of this generation
        hashes = tuple(request.block_hashes[sent:rng.end]) + ((rng.tail,) if rng.tail is not None else ())
        job_id = ledger.open_job(req_id, list(plan.pins), list(plan.tail_pins), generation=gen)
        if job_id is None:  # DEFER: the cap is reached; the blocks stay the request's, retry later
            if not st.deferred:
                self.stats.add("deferrals")
            self._defer(st, plan.rows, rng.end)
            return
        # sent at once: a job opened is pinned until every rank reports it, so it must reach the ranks
        saves.append(SaveSpec(req_id, job_id, gen, sent, rng.reach, plan.sent_ids, hashes,
                              tail_tokens=rng.tail_tokens, num_groups=len(plan.rows), null_before=plan.null_before))
        self._reqs.set_deferred(st, False)
        if plan.kept_used:  # this job pins the ones still held; none is kept past it
            self.stats.add("kept_blocks", plan.kept_used)
        st.kept_blocks = {}
        st.sent_blocks = rng.end
        if self.events is not None and rng.end > rng.start:  # routers hear of full blocks only
            self.events.job_opened(job_id, request, rng.start, rng.end)
        st.saved_blocks = rng.end
        if rng.tail is not None:
            st.tail_done = st.tail_stored = True
            self.stats.add("tail_saves")
        self.stats.add("store_jobs")
        self._note_prompt_saved(st)

    def _note_prompt_saved(self, st: _RequestState) -> None:
        """Without save_decode, once the prompt's full blocks are covered and its tail is done (or tails
        are off), no later step of this generation saves anything: the next ones skip the decision."""
        request = st.request
        st.prompt_saved = (not self.save_decode and not st.load_pending
                           and st.saved_blocks >= request.num_prompt_tokens // self.block_size
                           and (st.tail_done or not self.save_partial_tail))

    # ------------------------------------------------------------------ Collect / CollectLoad
    def collect(self, completed_saves: Mapping[int, int]) -> int:
        """Collect: the ranks' merged reports ``{job: ranks}`` released in ascending job id order (each
        released job frees its blocks with its own free call, so the order is the free queue's)."""
        if not completed_saves:
            return 0
        ledger = self._ledger()
        released = ledger.collect(dict(sorted(completed_saves.items())))
        if self.events is not None:  # jobs every rank reported: BlockStored for what the store holds
            inflight = set(ledger.inflight_jobs())
            self.events.jobs_collected(completed_saves, inflight.__contains__)
        return released

    def note_failed_loads(self, failed_recving: Iterable[str] | None) -> None:
        """Loads vLLM is told failed as a whole (several KV cache groups: no block-level report). Each one's
        request answers its later lookups short of its load's first block, as `note_load_errors` does."""
        ledger = self.ledger
        if not failed_recving or ledger is None:
            return
        for req_id in failed_recving:
            if not ledger.has_pinned_load(req_id):
                continue  # not a load of ours
            self._failed_loads.add(req_id)
            st = self._reqs.get(req_id)
            if st is not None and st.load_dest:
                at = st.load_first
                st.load_failed_at = at if st.load_failed_at is None else min(st.load_failed_at, at)
                st.requeue = self.kv_load_failure_policy == "recompute"

    def note_load_errors(self, invalid_block_ids: Iterable[int] | None) -> None:
        """The blocks vLLM is told failed to load this step (before the loads' pins are collected): each
        one's request answers its later lookups short of the first of them. Under ``recompute`` vLLM sends
        a request whose async load failed back to its queue and asks again; a key that exists but whose
        get keeps failing would be hit, loaded and failed again without end."""
        ledger = self.ledger
        if not invalid_block_ids or ledger is None:
            return
        for b in invalid_block_ids:
            req_id = ledger.load_owner(b)
            if req_id is None:
                continue  # not a block of a pinned load of ours (another connector's)
            self._failed_loads.add(req_id)  # a pinned load's (its request may be gone: "fail" ended it)
            st = self._reqs.get(req_id)
            if st is None or b not in st.load_dest:
                continue  # a load of an earlier request under a reused id
            i = st.load_first + st.load_dest.index(b)
            st.load_failed_at = i if st.load_failed_at is None else min(st.load_failed_at, i)
            st.requeue = self.kv_load_failure_policy == "recompute"

    def _note_load_outcomes(self, req_ids: Iterable[str]) -> None:
        """Each load released by this report counts once in the recent outcomes (`loads_mostly_fail`)."""
        ledger = self._ledger()
        for req_id in req_ids:
            if not ledger.has_pinned_load(req_id):
                self._load_outcomes.append(req_id in self._failed_loads)
                self._failed_loads.discard(req_id)

    def collect_loads(self, finished_recving: Sequence[str] | set[str]) -> int:
        """CollectLoad: vLLM reports a req_id in ``finished_recving`` once every rank finished its load, so
        each counts all ranks at once; its load pins are released."""
        if not finished_recving:
            return 0
        world = self.world_size
        released = self._ledger().collect_loads({req_id: world for req_id in finished_recving})
        self._note_load_outcomes(finished_recving)
        return released

    def collect_sync_loads(self, completed_loads: Mapping[str, int]) -> int:
        """CollectLoad of sync loads: the ranks' merged ``completed_loads`` ``{req_id: ranks}``; a load's pins
        are released once every rank reported it (a rank that reports later releases it then)."""
        if not completed_loads:
            return 0
        released = self._ledger().collect_loads(dict(completed_loads))
        self._note_load_outcomes(completed_loads)
        return released

    # ------------------------------------------------------------------ queries, shutdown
    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this holds: pins, or held requests not yet freed."""
        return bool(self._held or self._freeing) or (self.ledger is not None and self.ledger.has_pending_work())

    def release_all(self) -> None:
        """Shutdown (workers stopped first): drop every store and load pin."""
        if self.ledger is not None:
            self.ledger.release_all()
        self._failed_loads.clear()
        if self.events is not None:
            self.events.forget_jobs()

    def has_pending_loads(self) -> bool:
        """A load pinned but not yet sent to the workers, or one still pinned (in flight)."""
        return bool(self._loads_out) or (self.ledger is not None and self.ledger.num_pinned_loads > 0)

    def requests_with_computed_kv(self) -> list[str]:
        return [r for r, st in self._reqs.items() if getattr(st.request, "num_computed_tokens", 0) > 0]

    def forget_store_knowledge(self) -> None:
        self._reqs.forget_lookups_and_saves()

    def switch_keys(self, weights_version: str, reset_epoch: str, key_builders: Sequence[KeyBuilder]) -> None:
        """Build keys under `weights_version` and `reset_epoch` from now on (lookups, KV events, and through the
        metadata every rank's jobs). Only with nothing in flight that was keyed under the old ones: no store job
        (its put would land under the old key after the switch, fine, but its pins and report would outlive
        the keys it names) and no load (its blocks hold pre-reset KV)."""
        ledger = self.ledger
        if (ledger is not None and ledger.num_inflight_jobs) or self.has_pending_loads():
            raise LedgerInputError("weights_version", weights_version, "switched while store jobs or loads "
                                   "are in flight (only a successful reset_cache may switch it)")
        if len(key_builders) != len(self.key_builders):
            raise LedgerInputError("key_builders", len(key_builders), f"one per shard ({len(self.key_builders)})")
        self.key_builders = list(key_builders)
        if weights_version != self.weights_version:
            self.stats.add("weights_version_switches")
        self.weights_version, self.reset_epoch = weights_version, reset_epoch
        if self.events is not None:
            self.events.key_builders = list(key_builders)

    @property
    def num_load_pins(self) -> int:
        return 0 if self.ledger is None else self.ledger.num_pinned_loads

    @property
    def num_live_requests(self) -> int:
        return len(self._reqs)

    @property
    def num_deferred(self) -> int:
        return self._reqs.num_deferred

    @property
    def num_cached_lookups(self) -> int:
        return self._reqs.num_lookups

    @property
    def peak_lookup_cache(self) -> int:
        return self._reqs.peak_lookups

    @property
    def num_tracked(self) -> int:
        """Live request states plus the indexes over them (0 once the engine drained)."""
        return len(self._reqs) + self._reqs.num_deferred + self._reqs.num_lookups
