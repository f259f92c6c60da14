"""Scheduler side of the connector: lookups, load specs, store jobs with pins, reports.

Runs in vLLM's scheduler thread only (no lock). Per engine step, in vLLM's order::

    schedule()
      get_num_new_matched_tokens(req, n)  Lookup: longest run of stored blocks after n (all tp shards),
                                          plus the prompt's partial tail when it is stored (opt-in);
                                          cached per (req_id, generation, n): asking again is free
      update_state_after_alloc(req, ..)   EmitLoad: LoadSpec for the external range (async load); its
                                          destination blocks pinned through SchedulerLedger.pin_load
      build_connector_meta(out)           DropGeneration notices (preempted, finished), loads, and
                                          EmitStore: one SaveSpec per request whose computed full blocks
                                          grew (or whose prompt's partial tail became final), through
                                          SchedulerLedger.open_job (pins every block the job may read, the
                                          tail as tail_block_ids); None = the cap says DEFER: retried later
    update_from_output()
      update_connector_output(out)        Collect: merged completed_saves -> ledger releases pins;
                                          CollectLoad: finished_recving (every rank) -> load pins released
      request_finished(req, ..)           forget the request; never delays the free (pins own the blocks)
    has_requests() -> has_pending_push_work()  while any pin is held

State: one `_RequestState` per live request (on_new_request .. request_finished) in `_RequestTable`, which
also keeps two indexes over it (requests with a deferred save; the lookup cache's LRU order) so a step
costs O(scheduled + deferred), not O(live requests). The generation is `request.num_preemptions`, read in
one place (`_generation`); a preemption starts a new generation: `_RequestState.new_generation`.
Outboxes (loads pinned this step, requests finished since the last step) are not per-request state: a
pinned load must reach the workers even if its request finishes first, or its pin would never be released.

Every table is bounded: request states by the scheduler's live requests (dropped at finish), the deferred
index by them, cached lookups by `max_lookup_cache` (oldest evicted; a miss only costs a repeated
`batch_is_exist`), the load outbox by the requests admitted this step; load pins (in the ledger) by the
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
prompt embeddings) never save or hit a tail: the tail key holds token ids only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kvledger_connector.config import ConnectorConfig
from kvledger_connector.events import StoreEvents
from kvledger_connector.keys import KeyBuilder, partial_tail_hash
from kvledger_connector.metadata import KVLedgerConnectorMetadata, KVLedgerWorkerMetadata, LoadSpec, SaveSpec
from kvledger_connector.stats import StatsRecorder
from kvledger_connector.store import KVStore
from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink


def _generation(request: Any) -> int:
    """The request's generation as the connector counts it: admissions that were preempted so far."""
    return int(request.num_preemptions)


@dataclass(frozen=True)
class _Lookup:
    generation: int
    num_computed_tokens: int
    hit_tokens: int
    tail_hash: bytes | None = None  # the partial tail counted in hit_tokens, if it was


@dataclass
class _RequestState:
    """What the scheduler side knows of one live request. The save fields are per generation."""

    request: Any
    saved_blocks: int = 0  # full blocks covered by emitted store jobs (this generation)
    tail_done: bool = False  # the prompt's partial tail was saved or given up (this generation)
    deferred: bool = False  # the cap deferred its next save: retried in later steps
    lookup: _Lookup | None = None

    def new_generation(self) -> None:
        self.saved_blocks = 0
        self.tail_done = False
        self.deferred = False
        self.lookup = None


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
            st = self._states[request.request_id] = _RequestState(request)
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
            st.tail_done = False
            st.deferred = False
        self._deferred.clear()
        self._lookup_lru.clear()

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    @property
    def num_lookups(self) -> int:
        return len(self._lookup_lru)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, *, key_builders: Sequence[KeyBuilder], store: KVStore | None,
                 stats: StatsRecorder | None = None, trace: TraceSink | None = None) -> None:
        if not isinstance(config, ConnectorConfig):
            raise LedgerInputError("config", type(config).__name__, "must be a ConnectorConfig")
        self.config = config
        self.block_size = config.block_size
        self.world_size = config.world_size
        self.key_builders = list(key_builders)  # one per tensor-parallel shard: a hit needs every shard
        self.store = store
        self.max_inflight_jobs = config.max_inflight_jobs
        self.max_pinned_blocks = config.max_pinned_blocks
        self.save_decode = config.save_decode
        self.save_partial_tail = config.save_partial_tail
        self.save_enabled = config.save_enabled  # kv_role kv_producer | kv_both
        self.load_enabled = config.load_enabled  # kv_role kv_consumer | kv_both
        self.max_lookup_cache = max_lookup_cache = config.max_lookup_cache
        self.stats = stats or StatsRecorder()
        self.trace = trace
        self.ledger: SchedulerLedger | None = None
        self._kv_cache_manager: Any = None
        self._reqs = _RequestTable(max_lookup_cache)
        # outboxes, drained by build_connector_meta
        self._loads_out: list[LoadSpec] = []  # loads pinned since the last step
        self._finished_out: dict[str, int] = {}  # req_id -> generation, finished since the last step
        self._step = 0
        # whole-run counters (demo report, tests)
        self.num_lookups = 0
        self.num_match_calls = 0  # vLLM's asks (repeats for a waiting request are answered from the cache)
        self.num_store_queries = 0
        self.num_loads = 0
        self.num_tail_saves = 0  # store jobs that carried a partial tail
        self.num_tail_hits = 0  # lookups answered with a partial tail
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
        self._reqs.ensure(request)

    # ------------------------------------------------------------------ partial tails
    def _tail_hash(self, request: Any, num_tokens: int, tokens: Sequence[int] | None) -> bytes | None:
        """The key hash of the first `num_tokens` tokens' partial last block, or None when it has none
        worth saving: fewer than 2 tokens past the last full block (a hit must leave one to compute), no
        full block before it (the parent hash carries the cache salt and LoRA of the chain), its full
        blocks not hashed yet, or hashes that cover more than token ids (multimodal, prompt embeddings)."""
        bs = self.block_size
        k, r = divmod(num_tokens, bs)
        if r < 2 or k < 1 or len(request.block_hashes) < k or tokens is None:
            return None
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None
        return partial_tail_hash(request.block_hashes[k - 1], tokens[k * bs:num_tokens])

    # ------------------------------------------------------------------ Lookup
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that the store holds for every shard (block aligned unless a
        partial tail hits; never the whole prompt: vLLM must compute at least one token). Same question,
        same answer: the result is cached per (req_id, generation, num_computed_tokens) while it waits."""
        self.num_match_calls += 1
        st = self._reqs.ensure(request)
        gen = _generation(request)
        hit = st.lookup
        if hit is None or hit.generation != gen or hit.num_computed_tokens != num_computed_tokens:
            hit = self._query(request, gen, num_computed_tokens)
            self._reqs.set_lookup(st, hit)
        ext = hit.hit_tokens - num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def _query(self, request: Any, gen: int, num_computed_tokens: int) -> _Lookup:
        self.num_lookups += 1
        bs = self.block_size
        miss = _Lookup(gen, num_computed_tokens, num_computed_tokens)
        if self.store is None or not self.load_enabled:
            return miss
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        hashes = list(request.block_hashes[start:end]) if end > start else []
        tail = None
        if self.save_partial_tail and end == request.num_tokens // bs:  # every full block is asked for
            tail = self._tail_hash(request, request.num_tokens, request.all_token_ids)
        if not hashes and tail is None:
            return miss
        asked = hashes + ([tail] if tail is not None else [])
        keys = [k for kb in self.key_builders for k in kb.keys(asked)]
        self.num_store_queries += 1
        self.stats.add("lookups")
        try:
            res = self.store.batch_is_exist(keys)
        except Exception:  # the store wrapper returns codes; a raising test double must not kill the step
            self.stats.fail_code(-9003, len(keys))
            return miss
        n, m = len(hashes), len(asked)
        shards = range(len(self.key_builders))
        run = 0
        while run < n and all(res[s * m + run] == 1 for s in shards):
            run += 1
        if self.events is not None and n:  # an announced block found missing: BlockRemoved
            self.events.looked_up(hashes, [res[s * m + i] for s in shards for i in range(n)])
        hit_tokens = (start + run) * bs
        if tail is not None and run == n and all(res[s * m + n] == 1 for s in shards):
            self.num_tail_hits += 1
            self.stats.add("lookup_hit_tokens", request.num_tokens - 1 - num_computed_tokens)
            return _Lookup(gen, num_computed_tokens, request.num_tokens - 1, tail)
        self.stats.add("lookup_hit_tokens", run * bs)
        return _Lookup(gen, num_computed_tokens, hit_tokens)

    # ------------------------------------------------------------------ EmitLoad
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        st = self._reqs.get(req_id)
        hit = self._reqs.take_lookup(st) if st is not None else None
        if hit is None:
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"no lookup answered an external hit for {req_id!r}")
        bs = self.block_size
        first = hit.num_computed_tokens // bs
        last = -(-(hit.num_computed_tokens + num_external_tokens) // bs)
        block_ids = blocks.get_block_ids()[0]
        hashes = list(request.block_hashes[first:last])
        if hit.tail_hash is not None and last == len(request.block_hashes) + 1:
            hashes.append(hit.tail_hash)  # the partial last block loads from the tail's key
        if last > len(block_ids) or len(hashes) != last - first:
            raise LedgerInputError("num_external_tokens", num_external_tokens,
                                   f"{req_id!r} has {len(block_ids)} blocks, {len(request.block_hashes)} hashes")
        dest = tuple(block_ids[first:last])
        self._ledger().pin_load(req_id, dest)  # EmitLoad: before the workers can be told of the load
        self._loads_out.append(LoadSpec(req_id, dest, tuple(hashes)))
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
        # wipe a NEW request that reuses the id and was admitted in this very step (its load, lookup and
        # save progress): the notice is per generation, the state is not ours to drop
        for req_id in meta.finished_req_ids:
            if req_id in self._finished_out:
                meta.drop_generations[req_id] = self._finished_out[req_id]
            if trace is not None:  # the notice every rank gets (a DropGeneration each)
                trace.emit("sched", "Finish", {"req_id": req_id,
                                               "generation": meta.drop_generations.get(req_id)})
        self._finished_out.clear()
        for req_id in meta.preempted_req_ids:
            # DropGeneration: the next admission is a new generation that saves from block 0
            st = self._reqs.get(req_id)
            if st is not None:
                meta.drop_generations[req_id] = max(_generation(st.request) - 1, 0)
            if trace is not None:
                trace.emit("sched", "Preempt", {"req_id": req_id,
                                                "generation": meta.drop_generations.get(req_id)})
            self._reqs.new_generation(req_id)
        meta.loads, self._loads_out = self._loads_out, []

        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in self._reqs.deferred_ids():  # retry saves the cap deferred, for requests not scheduled now
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
        st = self._reqs.get(req_id)
        if st is None:
            return
        request = st.request
        bs = self.block_size
        token_len = request.num_computed_tokens + num_scheduled  # KV that exists after this step
        limit = request.num_tokens if self.save_decode else request.num_prompt_tokens
        end = min(min(token_len, limit) // bs, len(request.block_hashes))
        tail = None
        if self.save_partial_tail and not st.tail_done and token_len >= request.num_prompt_tokens:
            k = request.num_prompt_tokens // bs
            tail = self._tail_hash(request, request.num_prompt_tokens, request.prompt_token_ids)
            if tail is None or end > k:  # none, or decode already filled block k: saved whole instead
                st.tail_done, tail = True, None
        if end <= st.saved_blocks and tail is None:
            return
        reach = end + (tail is not None)  # table blocks the job reads (the tail is block `end`)
        table = None
        if block_state is not None:
            ids = block_state.get_block_ids(req_id)
            table = ids[0] if ids else None
        if table is None and self._kv_cache_manager is not None:
            table = self._kv_cache_manager.get_block_ids(req_id)[0]
        if table is None or len(table) < reach:
            return
        block_ids = list(table[:end])
        tail_ids = list(table[end:reach])
        if reach > self.max_pinned_blocks:  # could never be admitted: a cache miss, not an error
            self.num_saves_dropped += 1
            st.saved_blocks, st.tail_done = end, True
            return
        gen = _generation(request)
        job_id = self._ledger().open_job(req_id, block_ids, tail_ids, generation=gen)
        if job_id is None:  # DEFER: the cap is reached; the blocks stay the request's, retry later
            if not st.deferred:
                self.stats.add("deferrals")
            self._reqs.set_deferred(st, True)
            return
        self._reqs.set_deferred(st, False)
        hashes = tuple(request.block_hashes[:end]) + ((tail,) if tail is not None else ())
        meta.saves.append(SaveSpec(req_id, job_id, gen, st.saved_blocks, reach, tuple(block_ids + tail_ids),
                                   hashes, tail_tokens=request.num_prompt_tokens % bs if tail else 0))
        if self.events is not None and end > st.saved_blocks:  # routers hear of full blocks only
            self.events.job_opened(job_id, request, st.saved_blocks, end)
        st.saved_blocks = end
        if tail is not None:
            st.tail_done = True
            self.num_tail_saves += 1
            self.stats.add("tail_saves")
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
        st = self._reqs.drop(req_id)
        if st is not None and st.deferred:
            self.num_saves_dropped += 1
        self._finished_out[req_id] = _generation(request)
        return False, None

    def has_pending_push_work(self) -> bool:
        return self.ledger is not None and self.ledger.has_pending_work()

    def release_all(self) -> None:
        """Shutdown (workers stopped first): drop every store and load pin."""
        if self.ledger is not None:
            self.ledger.release_all()
        if self.events is not None:
            self.events.forget_jobs()

    # ------------------------------------------------------------------ for reset_cache (reset.py)
    def has_pending_loads(self) -> bool:
        """A load pinned but not yet sent to the workers, or one still pinned (in flight)."""
        return bool(self._loads_out) or (self.ledger is not None and self.ledger.num_pinned_loads > 0)

    def requests_with_computed_kv(self) -> list[str]:
        return [r for r, st in self._reqs.items() if getattr(st.request, "num_computed_tokens", 0) > 0]

    def forget_store_knowledge(self) -> None:
        self._reqs.forget_lookups_and_saves()

    # ------------------------------------------------------------------ introspection
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
