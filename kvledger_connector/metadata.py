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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

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
    rank loads it when the step begins (vLLM binds the metadata), before the forward, and reports it in
    `completed_loads`; otherwise a load thread runs it and vLLM's ``finished_recving`` reports it.
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


# ---------------------------------------------------------------- what a rank accepts (checked whole)
# A spec is checked whole before a rank acts on any of it (`WorkerSteps.admit_load`, `receive_save`,
# `receive_drop`): a bad one fails as one unit, never half-run. Each check raises a LedgerInputError naming
# the field and its value.
#: the most block ids one spec may name: 2^20 is a 1M-token request in blocks of 16 tokens, in 16 KV cache
#: groups; a spec past it is refused by its length before any id of it is looked at
MAX_SPEC_BLOCK_IDS = 1 << 20
#: the longest block hash a spec may carry (vLLM's are 32 bytes: SHA-256 or CBOR-SHA-256)
MAX_BLOCK_HASH_BYTES = 1024
#: duplicate ids named in a refusal (the count says how many there were)
_SHOWN_DUPLICATES = 8


def _int(v: Any) -> bool:
    return v.__class__ is int  # bool and int subclasses are not ids


def check_req_id(where: str, req_id: Any) -> None:
    if req_id.__class__ is not str or not req_id:
        raise LedgerInputError(f"{where} req_id", req_id, "must be a non-empty str")


def block_ids_error(where: str, block_ids: Any, num_blocks: int | None, *, null_ok: bool
                    ) -> LedgerInputError | None:
    """The first thing wrong with ``block_ids``, or None: a tuple or list of ints naming blocks of the
    registered KV cache (``num_blocks`` of them; None: a driver's buffers, no upper bound), vLLM's null
    block 0 only where ``null_ok`` (a group's blocks below its window), none twice (0 aside: two keys
    written into one block leave it holding only one of them)."""
    if not isinstance(block_ids, (tuple, list)):
        return LedgerInputError(f"{where} block_ids", block_ids, "must be a tuple of block ids")
    if len(block_ids) > MAX_SPEC_BLOCK_IDS:
        return LedgerInputError(f"{where} block_ids", f"{len(block_ids)} ids",
                                f"more than one spec may name ({MAX_SPEC_BLOCK_IDS})")
    low = 0 if null_ok else 1
    top = "" if num_blocks is None else f"..{num_blocks - 1}"
    for b in block_ids:
        if not _int(b) or b < low or (num_blocks is not None and b >= num_blocks):
            return LedgerInputError(f"{where} block_ids", b, f"not a block id of this rank's KV cache ({low}{top})")
    real = [b for b in block_ids if b != 0]
    if len(set(real)) != len(real):  # counted once, linear: the spec is checked on the model runner's thread
        twice = sorted(b for b, n in Counter(real).items() if n > 1)
        more = f" ({len(twice)} ids in all)" if len(twice) > _SHOWN_DUPLICATES else ""
        return LedgerInputError(f"{where} block_ids", twice[:_SHOWN_DUPLICATES], f"named twice in one spec{more}")
    return None


def _check_hashes(where: str, hashes: Any, n: int) -> None:
    if not isinstance(hashes, (tuple, list)) or len(hashes) != n:
        raise LedgerInputError(f"{where} block_hashes", hashes if not isinstance(hashes, (tuple, list))
                               else len(hashes), f"one per block ({n})")
    for h in hashes:
        if not isinstance(h, bytes) or not h:
            raise LedgerInputError(f"{where} block_hashes", h, "a block hash is non-empty bytes")
        if len(h) > MAX_BLOCK_HASH_BYTES:
            raise LedgerInputError(f"{where} block_hashes", f"{len(h)} bytes",
                                   f"a block hash is at most {MAX_BLOCK_HASH_BYTES} bytes")


def check_load_spec(spec: LoadSpec, *, num_blocks: int | None, num_groups: int) -> None:
    """A LoadSpec a rank may act on: a req_id; block ids of its KV cache, none null, none twice (one block
    pool: an id is one group's at a time); a hash per block (none for a refused load); a KV cache group
    per block (``num_groups`` of them) or none."""
    if not isinstance(spec, LoadSpec):
        raise LedgerInputError("LoadSpec", type(spec).__name__, "not a LoadSpec")
    check_req_id("LoadSpec", spec.req_id)
    where = f"LoadSpec {spec.req_id!r}"
    err = block_ids_error(where, spec.block_ids, num_blocks, null_ok=False)
    if err is not None:
        raise err
    n = len(spec.block_ids)
    if not spec.refused:
        _check_hashes(where, spec.block_hashes, n)
    groups = spec.groups
    if not isinstance(groups, (tuple, list)) or (groups and len(groups) != n):
        raise LedgerInputError(f"{where} groups", groups, f"one KV cache group per block id ({n}), or none")
    bad = [g for g in groups if not _int(g) or not 0 <= g < num_groups]
    if bad:
        raise LedgerInputError(f"{where} groups", bad, f"this rank's KV cache groups are 0..{num_groups - 1}")


def reportable_blocks(block_ids: Any, num_blocks: int | None) -> list[int]:
    """The ids of a spec that name real blocks of the KV cache, each once: what a refused load can report
    failed (anything else names no block vLLM holds)."""
    if not isinstance(block_ids, (tuple, list)):
        return []
    ok = [b for b in block_ids if _int(b) and b > 0 and (num_blocks is None or b < num_blocks)]
    return list(dict.fromkeys(ok))


def check_job_id(where: str, job_id: Any) -> None:
    if not _int(job_id) or job_id < 0:
        raise LedgerInputError(f"{where} store_job_id", job_id, "must be an int >= 0")


def check_save_spec(spec: SaveSpec, *, num_blocks: int | None = None, null_ok: bool = True) -> None:
    """A SaveSpec a rank may act on: a req_id, a job id and a generation (ints >= 0); a block range
    [start_block, end_block) with its partial tail, ``num_groups`` ids per block (block ids of the KV cache,
    ``null_ok``: vLLM's null block where a group's table holds it; none twice) and a hash per block;
    null_before one int >= 0 per group. ``num_blocks`` None: the ids' upper bound is not known here
    (`SentBlocks.resolve` checks the rest). Whether it continues what the rank holds is `SentBlocks`'."""
    if not isinstance(spec, SaveSpec):
        raise LedgerInputError("SaveSpec", type(spec).__name__, "not a SaveSpec")
    check_job_id("SaveSpec", spec.store_job_id)
    where = f"SaveSpec job {spec.store_job_id}"
    check_req_id(where, spec.req_id)
    where = f"{where} ({spec.req_id!r})"
    start, end, tail = spec.start_block, spec.end_block, spec.tail_tokens
    for name, v in (("start_block", start), ("end_block", end), ("tail_tokens", tail),
                    ("generation", spec.generation)):
        if not _int(v) or v < 0:
            raise LedgerInputError(f"{where} {name}", v, "must be an int >= 0")
    full_end = end - (tail > 0)
    if full_end < start:
        raise LedgerInputError(f"{where} start_block", start, f"past its last full block ({full_end})")
    g = spec.num_groups
    if not _int(g) or g < 1:
        raise LedgerInputError(f"{where} num_groups", g, "must be an int >= 1")
    err = block_ids_error(where, spec.block_ids, num_blocks, null_ok=null_ok)
    if err is not None:
        raise err
    if len(spec.block_ids) != (end - start) * g:
        raise LedgerInputError(f"{where} block_ids", len(spec.block_ids), f"{g} per block of [{start}, {end})")
    _check_hashes(where, spec.block_hashes, end - start)
    nb = spec.null_before
    if not isinstance(nb, (tuple, list)) or (nb and (len(nb) != g or any(not _int(n) or n < 0 for n in nb))):
        raise LedgerInputError(f"{where} null_before", nb, f"one int >= 0 per group ({g})")


def check_drop_notice(notice: DropNotice) -> None:
    """A DropNotice a rank may act on: a req_id, a generation (an int >= 0, or None: a req_id the
    scheduler side never saw), finished and release bools."""
    if not isinstance(notice, DropNotice):
        raise LedgerInputError("DropNotice", type(notice).__name__, "not a DropNotice")
    check_req_id("DropNotice", notice.req_id)
    where = f"DropNotice {notice.req_id!r}"
    if notice.generation is not None and (not _int(notice.generation) or notice.generation < 0):
        raise LedgerInputError(f"{where} generation", notice.generation, "must be an int >= 0 or None")
    for name in ("finished", "release"):
        if getattr(notice, name).__class__ is not bool:
            raise LedgerInputError(f"{where} {name}", getattr(notice, name), "must be a bool")


@dataclass
class KVLedgerConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker payload of one step."""

    step: int = 0
    # the weights version and reset epoch the step's keys are built under: they change only at a reset_cache
    # that ran with no store job or load in flight (kvledger_connector/scheduler/reset.py), and every rank
    # re-keys before its jobs
    weights_version: str = ""
    reset_epoch: str = ""  # "" until the first reset that kept the weights version, then RESET_EPOCH_HEX chars
    # in the order they happened (finished since the last step, then preempted in this one); each names
    # the generation it ends, so a late or duplicate notice cannot close a newer one
    drops: list[DropNotice] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # vLLM scheduled no token in this step (no forward: every request waits for a load or a save): a rank
    # waits, bounded, for its threads' next result before it reports (`WorkerSide.take_report`)
    idle: bool = False


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
