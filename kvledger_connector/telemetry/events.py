"""KV cache events for KV-aware routers: what the store holds of this engine's blocks, in vLLM's own event types.

vLLM's Scheduler collects ``connector.take_events()`` in ``update_from_output`` into the step's `KVEventBatch`,
next to its own GPU-pool events, and hands the batch to the configured publisher (``--kv-events-config``).
The scheduler-role connector owns one `StoreEvents` when ``kv_events_config.enable_kv_cache_events`` is set:

    BlockStored   after a store job is collected (every rank reported it: SchedulerLedger.collect released
                  its pins), for each block of the job's range whose key exists for EVERY tp/pp shard
                  (one ``batch_is_exist``: a rank reports a failed put too, so a report alone proves
                  nothing); one event per contiguous run, chained by ``parent_block_hash`` like vLLM's own
    BlockRemoved  for a block we announced that a later lookup finds missing on some shard (evicted,
                  removed), and for every announced block at ``reset_cache``

Per KV cache group, as vLLM's own events: a hybrid model's groups are announced and removed each on its own
(``group_idx``; a sliding-window group's block may be stored where a full-attention one is not), and a
BlockStored carries the group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` from vLLM's
``get_kv_cache_spec_kind`` / ``get_kv_cache_spec_sliding_window``. A key builder's group is the one its key
layout names (`KeyLayout.group`).
    AllBlocksCleared  at ``reset_cache`` instead, if more blocks were announced than `max_announced`
                  (we lost track of some; over-clearing a router only costs it hints, a stale hint costs a miss)

Medium: ``MEDIUM_CPU`` ("CPU", vLLM's constant, as the OffloadingConnector reports its CPU tier). Upstream's
Mooncake store connector sends the literal ``"cpu"``, from its workers (``get_kv_connector_kv_cache_events``,
aggregated so that only events every rank sent survive); here the scheduler emits them once, which needs no
cross-rank aggregation. Block hashes go through vLLM's ``maybe_convert_block_hash``, so they are the hashes
vLLM's own ``BlockStored`` events carry for the same blocks (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` included).

Bounded: pending events by `max_pending` (the oldest dropped, counted in ``kv_events_dropped``), the
announced-hash set by `max_announced` (oldest forgotten), per-job records by the ledger's job cap (one per
pinned store job, dropped when the job is collected or at shutdown).
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvledger.errors import LedgerInputError
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.telemetry.stats import StatsRecorder

logger = logging.getLogger(__name__)

MEDIUM = MEDIUM_CPU
DEFAULT_MAX_PENDING = 10_000
DEFAULT_MAX_ANNOUNCED = 65_536


@dataclass(frozen=True)
class _JobBlocks:
    """Blocks [start, end) of one store job, as the request held them when the job was opened."""

    start: int
    block_hashes: tuple[bytes, ...]  # hashes of blocks [start - 1 (parent, if start > 0), end)
    token_ids: tuple[int, ...]  # tokens of blocks [start, end)
    lora_id: int | None
    lora_name: str | None


class StoreEvents:
    def __init__(self, *, key_builders: Sequence[KeyBuilder], store: Any, block_size: int,
                 max_pending: int = DEFAULT_MAX_PENDING, max_announced: int = DEFAULT_MAX_ANNOUNCED,
                 stats: StatsRecorder | None = None,
                 group_specs: Sequence[tuple[str | None, int | None]] = ((None, None),)) -> None:
        """``group_specs``: per KV cache group, (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) for
        its BlockStored events (`spec_metadata`)."""
        for name, v in (("max_kv_events", max_pending), ("max_announced", max_announced)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LedgerInputError(name, v, "must be an int >= 1")
        self.group_specs = list(group_specs)
        self.key_builders = list(key_builders)
        self.store = store  # DeadlineStore.untimed(): these checks are not prefix lookups (kept out of lookup_s)
        self.block_size = block_size
        self.max_pending = max_pending
        self.max_announced = max_announced
        self.stats = stats or StatsRecorder()
        self._pending: deque[KVCacheEvent] = deque()
        self._jobs: dict[int, _JobBlocks] = {}
        self._announced: OrderedDict[tuple[int, bytes], None] = OrderedDict()  # (KV cache group, block hash)
        self.lost_track = False  # an announced hash was forgotten (cap): a reset must clear everything

    @property
    def key_builders(self) -> list[KeyBuilder]:
        return self._key_builders

    @key_builders.setter
    def key_builders(self, builders: Sequence[KeyBuilder]) -> None:
        """The scheduler's builders (a weights version switch replaces them); each one's KV cache group."""
        groups = [kb.layout.group for kb in builders]
        if any(not 0 <= g < len(self.group_specs) for g in groups):
            raise LedgerInputError("key_builders", sorted(set(groups)),
                                   f"name KV cache groups outside 0..{len(self.group_specs) - 1}")
        self._key_builders = list(builders)
        self._group_of = groups

    # ------------------------------------------------------------------ queue
    def _emit(self, event: KVCacheEvent) -> None:
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()  # oldest first: a router that lags loses history, not the present
            self.stats.add("kv_events_dropped")
        self._pending.append(event)

    def take(self) -> list[KVCacheEvent]:
        events = list(self._pending)
        self._pending.clear()
        return events

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_announced(self) -> int:
        return len(self._announced)

    # ------------------------------------------------------------------ stored
    def job_opened(self, job_id: int, request: Any, start: int, end: int) -> None:
        """EmitStore of `job_id` covering blocks [start, end) of `request` (called right after open_job)."""
        if end <= start:
            return
        bs = self.block_size
        lo = max(start - 1, 0)
        lora = request.lora_request
        self._jobs[job_id] = _JobBlocks(
            start=start, block_hashes=tuple(request.block_hashes[lo:end]),
            token_ids=tuple(request.all_token_ids[start * bs:end * bs]),
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None)

    def jobs_collected(self, completed: Mapping[int, int], still_pinned: Any) -> None:
        """After SchedulerLedger.collect: the reported jobs that are no longer pinned were reported by every
        rank. Announce their blocks the store holds for every shard."""
        done = [self._jobs.pop(j) for j in completed if j in self._jobs and not still_pinned(j)]
        if not done:
            return
        keys: list[str] = []
        spans: list[tuple[_JobBlocks, int, int]] = []  # (job, offset in keys, blocks)
        for job in done:
            hashes = job.block_hashes[1:] if job.start > 0 else job.block_hashes
            spans.append((job, len(keys), len(hashes)))
            keys.extend(k for kb in self.key_builders for k in kb.keys(hashes))
        try:
            res = self.store.batch_is_exist(keys)
        except Exception:  # a raising test double: announce nothing rather than fail the step
            return
        shards = len(self.key_builders)
        for job, off, n in spans:
            for g in range(len(self.group_specs)):
                mine = [s for s in range(shards) if self._group_of[s] == g]
                present = [bool(mine) and all(res[off + s * n + i] == 1 for s in mine) for i in range(n)]
                self._announce_runs(job, present, g)

    def _announce_runs(self, job: _JobBlocks, present: list[bool], group: int) -> None:
        bs = self.block_size
        hashes = job.block_hashes[1:] if job.start > 0 else job.block_hashes
        parent = job.block_hashes[0] if job.start > 0 else None
        kind, window = self.group_specs[group]
        i = 0
        n = len(present)
        while i < n:
            if not present[i] or (group, hashes[i]) in self._announced:
                parent = hashes[i]
                i += 1
                continue
            j = i
            while j < n and present[j] and (group, hashes[j]) not in self._announced:
                j += 1
            self._emit(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes[i:j]],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                token_ids=list(job.token_ids[i * bs:j * bs]), block_size=bs,
                lora_id=job.lora_id, medium=MEDIUM, lora_name=job.lora_name, group_idx=group,
                kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))
            for h in hashes[i:j]:
                self._remember(group, h)
            self.stats.add("kv_events_stored_blocks", j - i)
            parent = hashes[j - 1]
            i = j

    def _remember(self, group: int, h: bytes) -> None:
        self._announced[(group, h)] = None
        if len(self._announced) > self.max_announced:
            self._announced.popitem(last=False)
            self.lost_track = True

    # ------------------------------------------------------------------ removed
    def looked_up(self, hashes: Sequence[bytes], codes: Sequence[int]) -> None:
        """A prefix lookup's ``batch_is_exist`` answer (shard-major: `lookup_keys`' order): an announced
        block of a group that some shard of that group answered 0 for is gone (evicted or removed); an error
        code proves nothing."""
        if not self._announced:
            return
        n = len(hashes)
        shards = len(codes) // n if n else 0
        for g in range(len(self.group_specs)):
            mine = [s for s in range(shards) if self._group_of[s] == g]
            gone = [h for i, h in enumerate(hashes)
                    if (g, h) in self._announced and any(codes[s * n + i] == 0 for s in mine)]
            if gone:
                for h in gone:
                    del self._announced[(g, h)]
                self._emit(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in gone], medium=MEDIUM,
                                        group_idx=g))
                self.stats.add("kv_events_removed_blocks", len(gone))

    def store_reset(self) -> None:
        """Every key of this engine was removed (reset_cache)."""
        if self.lost_track:
            self._emit(AllBlocksCleared())
        else:
            for g in range(len(self.group_specs)):
                hs = [h for gi, h in self._announced if gi == g]
                if hs:
                    self._emit(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in hs], medium=MEDIUM,
                                            group_idx=g))
        if self._announced:
            self.stats.add("kv_events_removed_blocks", len(self._announced))
        self._announced.clear()
        self.lost_track = False

    def forget_jobs(self) -> None:
        """Shutdown (release_all): the jobs are released without reports; nothing is announced for them."""
        self._jobs.clear()


def spec_metadata(specs: Sequence[Any]) -> list[tuple[str | None, int | None]]:
    """(kind, sliding window) of each KV cache group's spec, as vLLM annotates its own BlockStored events."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    return [(get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs]
