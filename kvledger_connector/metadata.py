"""What crosses the process boundary each engine step, in both directions.

    scheduler ──KVLedgerConnectorMetadata──▶ every worker rank      (built in build_connector_meta)
        weights_version: the keys' weights version (changed only by reset_cache)
        drops:     DropNotice per req_id finished or preempted  (DropGeneration, before this step's jobs)
        loads:     LoadSpec per request whose external hit was allocated (blocks, hashes)
        saves:     SaveSpec per store job opened this step (store_job_id, generation, end; only the blocks
                   no earlier job of the generation sent: each block id and hash crosses once)

    worker rank ──KVLedgerWorkerMetadata──▶ engine `aggregate` ──▶ scheduler.update_connector_output
        completed_saves: {store_job_id: number of ranks that reported it this step}   (Report → Collect)
        completed_loads: {req_id: number of ranks that finished its sync load}        (→ CollectLoad; an
                         async load is reported through vLLM's finished_recving instead)

Everything here is plain data (ints, strs, bytes, lists): picklable and msgspec-friendly, because vLLM
ships it between processes. Block hashes travel as bytes; keys are built per rank (each rank owns a
tensor-parallel shard, so the same hash names a different key on each rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvledger.errors import LedgerInputError
from kvledger.metadata import aggregate_loads_into, aggregate_into, check_completed, check_completed_loads


@dataclass(frozen=True)
class SaveSpec:
    """One store job (EmitStore): save `req_id`'s current generation up to `end_block`.

    A job may read every block [0, end_block) — a rank whose saved offset lags the scheduler's view (a
    failed put on that rank) resumes from it — and the scheduler pinned them all. Their ids and hashes
    cross once per generation: `block_ids` / `block_hashes` are blocks [start_block, end_block), the ones
    no earlier job of this generation sent; each rank keeps the rest (`jobs.SentBlocks`). start_block 0
    starts the generation's table afresh (its first job; a preempted or reused req_id starts over).
    """

    req_id: str
    store_job_id: int
    generation: int  # the scheduler's generation of the request (request.num_preemptions)
    start_block: int  # the first block whose id and hash this spec carries
    end_block: int
    block_ids: tuple[int, ...]  # blocks [start_block, end_block)
    block_hashes: tuple[bytes, ...]
    # > 0: block end_block - 1 is the prompt's partial tail holding this many tokens (its hash is the tail
    # key's, `keys.partial_tail_hash`); a rank's saved offset then stops before it, at a block boundary
    tail_tokens: int = 0
    # several KV cache groups (a hybrid model): `block_ids` holds one id per group for each block, block
    # major (block b, group g at (b - start_block) * num_groups + g), 0 where the group's table holds vLLM's
    # null block (a sliding-window group's blocks below its window: nothing to put)
    num_groups: int = 1
    # per group: its table holds null blocks below this block now. A sliding-window group frees the blocks
    # that leave its window; a rank resuming from an older offset must not read the ids an earlier spec sent
    null_before: tuple[int, ...] = ()

    @property
    def full_end_block(self) -> int:
        """One past the job's last full block: a rank's saved offset moves there once the put succeeded."""
        return self.end_block - (self.tail_tokens > 0)


@dataclass(frozen=True)
class DropNotice:
    """DropGeneration: `req_id`'s `generation` ended — finished (it closes once its jobs drained) or
    preempted (its queued jobs go stale). `generation` None: a req_id the scheduler side never saw."""

    req_id: str
    generation: int | None
    finished: bool
    # a held request's notice (`SchedulerSteps.release_held`): every rank answers it in finished_sending, so
    # vLLM frees the blocks it kept for the request's deferred save
    release: bool = False


@dataclass(frozen=True)
class LoadSpec:
    """One load (EmitLoad): fill `block_ids[i]` with the stored KV of `block_hashes[i]`.

    The blocks are the request's external-hit range, already allocated by vLLM; every block of this list
    that is not loaded must come back through `get_block_ids_with_load_errors` (S8). `sync`: vLLM
    schedules the request in this very step (the connector answered ``load_kv_async=False``), so every
    rank loads it in ``start_load_kv``, before the forward, and reports it in `completed_loads`; otherwise
    a load thread runs it and vLLM's ``finished_recving`` reports it.
    """

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    sync: bool = False
    # several KV cache groups: the group of each block (its key and its KV cache views); () = all group 0.
    # A block id is owned by one group at a time (one block pool), so ids stay unique within a load
    groups: tuple[int, ...] = ()
    # the scheduler could not plan this load (why): every block is reported failed, the store is not read
    refused: str = ""


@dataclass
class KVLedgerConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker payload of one step."""

    step: int = 0
    # the weights version the step's keys are built under: it changes only at a reset_cache that ran with
    # no store job or load in flight (kvledger_connector/reset.py), and every rank re-keys before its jobs
    weights_version: str = ""
    # in the order they happened (finished since the last step, then preempted in this one); each names
    # the generation it ends, so a late or duplicate notice cannot close a newer one
    drops: list[DropNotice] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KVLedgerWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler payload: which store jobs this rank finished (each exactly once, S5), and which
    sync loads.

    vLLM's executor folds the ranks' objects together with `aggregate` (mutating the first one), so the
    scheduler sees `{job: number of ranks that reported it this step}` and `{req_id: ranks}`.
    """

    __slots__ = ("completed_saves", "completed_loads")

    def __init__(self, completed_saves: dict[int, int] | None = None,
                 completed_loads: dict[str, int] | None = None) -> None:
        saves = dict(completed_saves or {})
        check_completed(saves)
        loads = dict(completed_loads or {})
        check_completed_loads(loads)
        self.completed_saves: dict[int, int] = saves
        self.completed_loads: dict[str, int] = loads

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLedgerWorkerMetadata:
        if not isinstance(other, KVLedgerWorkerMetadata):
            raise LedgerInputError("kv_connector_worker_meta", type(other).__name__,
                                   "cannot aggregate with KVLedgerWorkerMetadata")
        aggregate_into(self.completed_saves, other.completed_saves)  # kvledger's merge (sum per job)
        aggregate_loads_into(self.completed_loads, other.completed_loads)
        return self

    def __repr__(self) -> str:
        return f"KVLedgerWorkerMetadata({self.completed_saves!r}, {self.completed_loads!r})"

    def __reduce__(self):  # picklable despite __slots__ without __dict__
        return (KVLedgerWorkerMetadata, (self.completed_saves, self.completed_loads))
