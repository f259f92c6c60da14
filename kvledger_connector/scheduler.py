"""Scheduler side of the connector: lookups, load specs, store jobs with pins, reports.

Runs in vLLM's scheduler thread only (no lock). Per engine step, in vLLM's order::

    schedule()
      get_num_new_matched_tokens(req, n)  Lookup: longest run of stored blocks after n (all tp shards);
                                          cached per (req_id, generation, n): asking again is free
      update_state_after_alloc(req, ..)   EmitLoad: LoadSpec for the external range (async load); its
                                          destination blocks pinned through SchedulerLedger.pin_load
      build_connector_meta(out)           DropGeneration notices (preempted, finished), loads, and
                                          EmitStore: one SaveSpec per request whose computed full blocks
                                          grew, through SchedulerLedger.open_job (pins every block the job
                                          may read); None = the cap says DEFER: retried next steps
    update_from_output()
      update_connector_output(out)        Collect: merged completed_saves -> ledger releases pins;
                                          CollectLoad: finished_recving (every rank) -> load pins released
      request_finished(req, ..)           forget trackers; never delays the free (pins own the blocks)
    has_requests() -> has_pending_push_work()  while any pin is held

Every table here is bounded: trackers and deferred saves by the scheduler's live requests (dropped at
finish/preemption), pending loads by the requests admitted this step, the lookup cache by
`max_lookup_cache` (oldest entry evicted; a miss only costs a repeated `batch_is_exist`); load pins
(in the ledger) by the pool: a block is the destination of at most one pinned load.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from kvledger_connector.events import StoreEvents
from kvledger_connector.keys import KeyBuilder
from kvledger_connector.metadata import KVLedgerConnectorMetadata, KVLedgerWorkerMetadata, LoadSpec, SaveSpec
from kvledger_connector.stats import StatsRecorder
from kvledger_connector.store import KVStore
from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink


@dataclass
class _Tracker:
    """One generation of one request, scheduler side: blocks covered by emitted store jobs."""

    saved_blocks: int = 0
    deferred: bool = False


@dataclass(frozen=True)
class _Lookup:
    generation: int  # request.num_preemptions at the time of the lookup
    num_computed_tokens: int
    hit_tokens: int


class SchedulerSide:
    def __init__(self, *, block_size: int, world_size: int, key_builders: Sequence[KeyBuilder],
                 store: KVStore | None, max_inflight_jobs: int, max_pinned_blocks: int,
                 save_decode: bool = False, max_lookup_cache: int = 4096,
                 save_enabled: bool = True, load_enabled: bool = True,
                 stats: StatsRecorder | None = None, trace: TraceSink | None = None) -> None:
        if max_lookup_cache < 1:
            raise LedgerInputError("max_lookup_cache", max_lookup_cache, "must be >= 1")
        self.block_size = block_size
        self.world_size = world_size
        self.key_builders = list(key_builders)  # one per tensor-parallel shard: a hit needs every shard
        self.store = store
        self.max_inflight_jobs = max_inflight_jobs
        self.max_pinned_blocks = max_pinned_blocks
        self.save_decode = save_decode
        self.save_enabled = save_enabled  # kv_role kv_producer | kv_both
        self.load_enabled = load_enabled  # kv_role kv_consumer | kv_both
        self.max_lookup_cache = max_lookup_cache
        self.stats = stats or StatsRecorder()
        self.trace = trace
        self.ledger: SchedulerLedger | None = None
        self._kv_cache_manager: Any = None
        self._requests: dict[str, Any] = {}  # live requests (on_new_request .. request_finished)
        self._trackers: dict[str, _Tracker] = {}
        self._deferred: set[str] = set()
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._pending_loads: dict[str, LoadSpec] = {}
        self._finished_gen: dict[str, int] = {}  # finished since the last step (drained each step)
        # the destination blocks of each async load are pinned in the ledger (pin_load at EmitLoad) until
        # every rank finished the load (collect_loads): an aborted request frees its blocks at once, and a
        # load thread must not write into reused blocks (S9 LoadsPinned)
        self._step = 0
        # whole-run counters (demo report, tests)
        self.num_lookups = 0
        self.num_match_calls = 0  # vLLM's asks (repeats for a waiting request are answered from the cache)
        self.peak_lookup_cache = 0
        self.num_store_queries = 0
        self.num_loads = 0
        self.num_saves_dropped = 0  # saves given up: request finished while deferred, or job > cap
        self.num_resets = 0  # reset_cache calls that removed this engine's keys (kvledger_connector/reset.py)
        # KV events for routers (kvledger_connector/events.py); set by the connector when kv events are enabled
        self.events: StoreEvents | None = None

    # ------------------------------------------------------------------ binding
    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        self.ledger = SchedulerLedger(block_pool, world_size=self.world_size,
                                      max_inflight_jobs=self.max_inflight_jobs,
                                      max_pinned_blocks=self.max_pinned_blocks, trace=self.trace)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _ledger(self) -> SchedulerLedger:
        if self.ledger is None:
            raise LedgerInputError("block_pool", None, "bind_gpu_block_pool was not called")
        return self.ledger

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    # ------------------------------------------------------------------ Lookup
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that the store holds for every shard (block aligned, never
        the whole prompt: vLLM must compute at least one token). Same question, same answer: the result is
        cached per (req_id, generation, num_computed_tokens) while the request waits."""
        req_id = request.request_id
        self.num_match_calls += 1
        self._requests.setdefault(req_id, request)
        gen = request.num_preemptions
        hit = self._lookups.get(req_id)
        if hit is None or hit.generation != gen or hit.num_computed_tokens != num_computed_tokens:
            hit = _Lookup(gen, num_computed_tokens, self._query(request, num_computed_tokens))
            self._lookups[req_id] = hit
            self._lookups.move_to_end(req_id)
            while len(self._lookups) > self.max_lookup_cache:
                self._lookups.popitem(last=False)
            self.peak_lookup_cache = max(self.peak_lookup_cache, len(self._lookups))
        ext = hit.hit_tokens - num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def _query(self, request: Any, num_computed_tokens: int) -> int:
        self.num_lookups += 1
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if self.store is None or end <= start or not self.load_enabled:
            return num_computed_tokens
        hashes = request.block_hashes[start:end]
        keys = [k for kb in self.key_builders for k in kb.keys(hashes)]
        self.num_store_queries += 1
        self.stats.add("lookups")
        try:
            res = self.store.batch_is_exist(keys)
        except Exception:  # the store wrapper returns codes; a raising test double must not kill the step
            self.stats.fail_code(-9003, len(keys))
            return num_computed_tokens
        n = len(hashes)
        run = 0
        while run < n and all(res[s * n + run] == 1 for s in range(len(self.key_builders))):
            run += 1
        if self.events is not None:  # an announced block found missing: BlockRemoved
            self.events.looked_up(hashes, res)
        self.stats.add("lookup_hit_tokens", run * bs)
        return (start + run) * bs

    # ------------------------------------------------------------------ EmitLoad
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        hit = self._lookups.pop(req_id, None)
        if hit is None:
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"no lookup answered an external hit for {req_id!r}")
        bs = self.block_size
        first = hit.num_computed_tokens // bs
        last = -(-(hit.num_computed_tokens + num_external_tokens) // bs)
        block_ids = blocks.get_block_ids()[0]
        if last > len(block_ids) or last > len(request.block_hashes):
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"{req_id!r} has {len(block_ids)} blocks, {len(request.block_hashes)} hashes")
        dest = tuple(block_ids[first:last])
        self._ledger().pin_load(req_id, dest)  # EmitLoad: before the workers can be told of the load
        self._pending_loads[req_id] = LoadSpec(req_id, dest, tuple(request.block_hashes[first:last]))
        self.num_loads += 1
        self.stats.add("loaded_tokens", num_external_tokens)

    # ------------------------------------------------------------------ step
    def build_connector_meta(self, scheduler_output: Any) -> KVLedgerConnectorMetadata:
        self._step += 1
        meta = KVLedgerConnectorMetadata(step=self._step)
        meta.finished_req_ids = sorted(scheduler_output.finished_req_ids)
        meta.preempted_req_ids = sorted(scheduler_output.preempted_req_ids or ())
        trace = self.trace
        # request_finished already forgot each of these when it finished; forgetting again here would
        # wipe a NEW request that reuses the id and was admitted in this very step (its pending load,
        # lookup and save tracker): the notice is per generation, the state is not ours to drop
        for req_id in meta.finished_req_ids:
            if req_id in self._finished_gen:
                meta.drop_generations[req_id] = self._finished_gen[req_id]
            if trace is not None:  # the notice every rank gets (a DropGeneration each)
                trace.emit("sched", "Finish", {"req_id": req_id,
                                               "generation": meta.drop_generations.get(req_id)})
        self._finished_gen.clear()
        for req_id in meta.preempted_req_ids:
            # DropGeneration: the next admission is a new generation that saves from block 0
            request = self._requests.get(req_id)
            if request is not None:
                meta.drop_generations[req_id] = max(request.num_preemptions - 1, 0)
            if trace is not None:
                trace.emit("sched", "Preempt", {"req_id": req_id,
                                                "generation": meta.drop_generations.get(req_id)})
            self._trackers.pop(req_id, None)
            self._deferred.discard(req_id)
            self._lookups.pop(req_id, None)
        meta.loads = list(self._pending_loads.values())
        self._pending_loads.clear()

        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in list(self._deferred):  # retry saves the cap deferred, for requests not scheduled now
            if req_id not in scheduled:
                self._maybe_save(meta, req_id, 0, None)
        for req_id, n in scheduled.items():
            self._maybe_save(meta, req_id, n, block_state)
        ledger = self._ledger()
        self.stats.gauge("pins_in_flight", ledger.num_inflight_jobs)
        self.stats.gauge("pinned_blocks", ledger.num_pinned_blocks)
        return meta

    def _maybe_save(self, meta: KVLedgerConnectorMetadata, req_id: str, num_scheduled: int,
                    block_state: Any) -> None:
        if not self.save_enabled:
            return
        request = self._requests.get(req_id)
        if request is None:
            self._deferred.discard(req_id)
            return
        tracker = self._trackers.get(req_id)
        if tracker is None:
            tracker = self._trackers[req_id] = _Tracker()
        bs = self.block_size
        token_len = request.num_computed_tokens + num_scheduled  # KV that exists after this step
        limit = request.num_tokens if self.save_decode else request.num_prompt_tokens
        end = min(token_len, limit) // bs
        end = min(end, len(request.block_hashes))
        if end <= tracker.saved_blocks:
            return
        table = None
        if block_state is not None:
            ids = block_state.get_block_ids(req_id)
            table = ids[0] if ids else None
        if table is None and self._kv_cache_manager is not None:
            table = self._kv_cache_manager.get_block_ids(req_id)[0]
        if table is None or len(table) < end:
            return
        block_ids = list(table[:end])
        if len(block_ids) > self.max_pinned_blocks:  # could never be admitted: a cache miss, not an error
            self.num_saves_dropped += 1
            tracker.saved_blocks = end
            return
        job_id = self._ledger().open_job(req_id, block_ids, generation=request.num_preemptions)
        if job_id is None:  # DEFER: the cap is reached; the blocks stay the request's, retry later
            if not tracker.deferred:
                self.stats.add("deferrals")
            tracker.deferred = True
            self._deferred.add(req_id)
            return
        tracker.deferred = False
        self._deferred.discard(req_id)
        meta.saves.append(SaveSpec(req_id, job_id, request.num_preemptions, tracker.saved_blocks, end,
                                   tuple(block_ids),
                                   tuple(request.block_hashes[:end])))
        if self.events is not None:
            self.events.job_opened(job_id, request, tracker.saved_blocks, end)
        tracker.saved_blocks = end
        self.stats.add("store_jobs")

    # ------------------------------------------------------------------ Collect
    def update_connector_output(self, connector_output: Any) -> None:
        recv = connector_output.finished_recving
        if recv:  # vLLM reports a req_id here once every rank finished its load: all ranks at once
            world = self.world_size
            self._ledger().collect_loads({req_id: world for req_id in recv})
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVLedgerWorkerMetadata):
            raise LedgerInputError("kv_connector_worker_meta", type(meta).__name__,
                                   "expected KVLedgerWorkerMetadata")
        if meta.completed_saves:
            ledger = self._ledger()
            ledger.collect(meta.completed_saves)
            if self.events is not None:  # jobs every rank reported: BlockStored for what the store holds
                inflight = set(ledger.inflight_jobs())
                self.events.jobs_collected(meta.completed_saves, inflight.__contains__)

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Never delays the free: every store job pinned its own blocks."""
        req_id = request.request_id
        if req_id in self._deferred:
            self.num_saves_dropped += 1
        self._forget(req_id)
        self._finished_gen[req_id] = request.num_preemptions
        return False, None

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._deferred.discard(req_id)
        self._lookups.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def has_pending_push_work(self) -> bool:
        return self.ledger is not None and self.ledger.has_pending_work()

    def release_all(self) -> None:
        """Shutdown (workers stopped first): drop every store and load pin."""
        if self.ledger is not None:
            self.ledger.release_all()
        if self.events is not None:
            self.events.forget_jobs()

    @property
    def num_load_pins(self) -> int:
        return 0 if self.ledger is None else self.ledger.num_pinned_loads

    @property
    def num_tracked(self) -> int:
        return len(self._requests) + len(self._trackers) + len(self._deferred) + len(self._lookups)
