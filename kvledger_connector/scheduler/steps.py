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

The steps are one object split by subject, each module over the state declared in base.py: pure plan
functions (plan.py), request lifetimes with their one reset rule (requests.py), Lookup (lookup.py),
EmitStore (saves.py), held requests as a state machine (held.py), Collect (collect.py), and here EmitLoad,
Preempt / Finish and the queries. Outboxes (loads pinned this step, requests finished since the last step)
are not per-request state: a pinned load must reach the workers even if its request finishes first, or
its pin would never be released.

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

from collections import deque
from typing import Any, Callable, Iterable, Sequence

from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.metadata import DropNotice, LoadSpec
from kvledger_connector.scheduler.collect import CollectSteps
from kvledger_connector.scheduler.held import HeldRequests, HeldState
from kvledger_connector.scheduler.lookup import LOAD_OUTCOME_WINDOW, LookupSteps
from kvledger_connector.scheduler.plan import RequestLike, generation_of
from kvledger_connector.scheduler.requests import _RequestTable
from kvledger_connector.scheduler.saves import SaveSteps
from kvledger_connector.shape.group_kind import GroupKind, GroupKinds
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.telemetry.stats import StatsRecorder

#: the step errors kept for the adapter's log (`SchedulerSteps.errors`)
MAX_STEP_ERRORS = 64
#: a refused load's reason as the ranks get it (`LoadSpec.refused`)
MAX_REFUSAL_CHARS = 200


class SchedulerSteps(LookupSteps, SaveSteps, CollectSteps):
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
        # each group's kind carries its rules (kvledger_connector/shape/group_kind.py): how its table is read
        # (null ids nothing to pin or load), what a hit needs, how a failed load is reported (by block only
        # for one full-attention group: else loads are async and failed per request)
        self.kinds = GroupKinds.of_layouts(kb.layout for kb in self.key_builders)
        # Mamba groups in vLLM's "align" mode: a block holds the state after its last token, saved only from
        # the exact blocks vLLM offers (`emit_stores`' boundary_states) and needed only at a hit's end
        self.state_groups = self.kinds.groups(GroupKind.MAMBA_STATE)
        self.sliding_groups = self.kinds.groups(GroupKind.SLIDING_WINDOW)
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
        # held requests: finished while the caps deferred their save, kept by vLLM until it is stored, then
        # released and freed (kvledger_connector/scheduler/held.py: the one owner of their state)
        self.held = HeldRequests(config.max_held_requests)
        # whole-run counts with no counter in kvledger_connector.telemetry.stats.COUNTERS yet (tests, demo report)
        self._load_outcomes: deque[bool] = deque(maxlen=LOAD_OUTCOME_WINDOW)  # True: the load failed
        self._failed_loads: set[str] = set()  # req_ids of pinned loads with a noted load error
        # inputs a step could not serve, newest last (the adapter logs them); bounded: the count is in stats
        self.errors: deque[str] = deque(maxlen=MAX_STEP_ERRORS)
        # KV events for routers (kvledger_connector/telemetry/events.py); set by the connector when kv events
        # are enabled
        self.events: Any = None

    # ------------------------------------------------------------------ binding
    def bind_ledger(self, ledger: SchedulerLedger) -> None:
        self.ledger = ledger

    def on_new_request(self, request: RequestLike) -> None:
        self._reqs.ensure(request)

    # ------------------------------------------------------------------ EmitLoad
    def emit_load(self, request: RequestLike, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> LoadSpec | None:
        """EmitLoad: the destination blocks of the lookup's external hit (``block_ids``: the request's tables
        as allocated for it, one per KV cache group), pinned in the ledger before any worker can be told (S9
        LoadsPinned); the LoadSpec waits in the outbox for the step's metadata. None when there is nothing to
        load. Unless the tables are one read as it comes (`GroupKinds.one_table`), each group's table is read
        by its kind (`GroupKind.load_positions`); a null id (a sliding-window group's blocks below its window)
        is nothing to load."""
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
        kinds = self.kinds
        if kinds.one_table:
            dest = tuple(tables[0][first:last])
        else:  # each group's positions by its kind (a Mamba group: the one state block at the hit's end)
            at = [(g, p) for g, t in enumerate(tables) for p in kinds.kind(g).load_positions(first, last)
                  if t[p] != 0]
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

    def take_loads(self) -> list[LoadSpec]:
        """The loads pinned since the last step, for this step's metadata."""
        out, self._loads_out = self._loads_out, []
        return out

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
            if req_id in self.held:
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
        if may_hold and st is not None and st.deferred and self.held.can_hold(req_id):
            self.held.hold(req_id, generation_of(request))
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
        return self.held.due(self._ledger().is_job_pinned)

    def give_up_held(self, req_id: str) -> None:
        """A held request's deferred save given up (counted): it is released at the next step."""
        st = self._reqs.get(req_id)
        if self.held.state(req_id) is not HeldState.DEFERRED or st is None:
            raise LedgerInputError("req_id", req_id, "is not a held request whose save is deferred")
        self._reqs.set_deferred(st, False)
        self._give_up_save()
        self.held.give_up(req_id)

    def release_held(self, req_id: str) -> DropNotice:
        """ReleaseHeld: the held request's finish notice, with ``release``: every rank answers it in
        finished_sending, and vLLM frees the blocks it kept (`note_freed` hears of it)."""
        gen = self.held.release(req_id, self._ledger().is_job_pinned)
        self._reqs.drop(req_id)
        if self.trace is not None:
            self.trace.emit("sched", "Finish", {"req_id": req_id, "generation": gen})
        return DropNotice(req_id, gen, True, release=True)

    def note_freed(self, finished_sending: Iterable[str] | None) -> None:
        """vLLM's merged ``finished_sending``: these released requests' blocks are freed now."""
        self.held.freed(finished_sending or ())

    @property
    def num_held_requests(self) -> int:
        """Held requests, deferred or released and not yet freed by vLLM."""
        return len(self.held)

    @property
    def max_held_requests(self) -> int:
        return self.held.max_held

    @property
    def peak_held_requests(self) -> int:
        """Most held (deferred, or released and not yet freed) at once."""
        return self.held.peak

    # ------------------------------------------------------------------ queries, shutdown
    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this holds: pins, or held requests not yet freed."""
        return bool(self.held) or (self.ledger is not None and self.ledger.has_pending_work())

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
