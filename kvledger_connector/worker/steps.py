"""The worker side's per-job work as synchronous step functions: plan → store calls → outcome into the
ledgers. No threads. Each job's orchestration is ONE resumable function, a generator that stops at the
model's action boundaries: the connector's store and load threads drain it (``run_save``, ``run_load``),
the replay/fuzz driver (conformance/kvdriver.py) advances it one model action at a time. There is no
second copy of this orchestration.

    model action   step                                    ledger calls (under ``lock``)
    Receive        WorkerSteps.receive_save(spec) -> job   WorkerLedger.register; the job's blocks [0, end)
                                                           from `SentBlocks` (each id crosses once)
    DropGeneration WorkerSteps.drop_generation(req_id, ..) WorkerLedger.drop_generation, SentBlocks.drop
    Collect        WorkerSteps.take_reports()              WorkerLedger.take_completed (this rank's part)
    (a save job)   gen = WorkerSteps.save_steps(io, ...)   started, stopped at START: nothing done yet
    DmaRead        next(gen) -> SaveStep(DMA_READ)         begin_save: WorkerLedger.begin, saved_offset
                   gen.throw(exc) -> SaveStep(DMA_READ)    the handler raised: fail_save (record_failed)
    Put            next(gen) -> SaveStep(PUT)              put: this rank's share (kvledger.put_positions),
                                                           batch_is_exist, batch_put of the missing;
                                                           record_put: kvledger.codes.classify_put ->
                                                           record_saved | record_failed
    Report         next(gen) -> SaveStep(REPORT)           report_save: WorkerLedger.finish (exactly once)
    EmitLoad       next(lg) -> LoadStep(EMIT_LOAD)         lg = load_steps(io, ...): LoadLedger.begin_load
    Load           next(lg) -> LoadStep(LOAD)              one sub-batch: batch_get, LoadLedger.record_results;
                                                           the last one also finishes the load (fail_pending,
                                                           finish_load)
    HandleLoadErrors  WorkerSteps.take_load_errors()       LoadLedger.take_errors

Every spec is checked whole before any of the above runs for it (kvledger_connector/metadata.py's checks):
`admit_load` (a malformed or refused load: every real block reported failed, the load finished, nothing
read), `receive_save` (a malformed save: its job reported at once through `WorkerLedger.refuse`, nothing
put), `receive_drop`. An object a load finds failing its integrity tag is queued (`queue_removal`) and
removed by the store's own threads (`take_removals`).

No store call is made here (I/O at the edge): where an action needs one, the job's generator yields a
`StoreCall` and is sent the codes; `Stepped` (kvledger_connector/store/io.py) makes each through the caller's
`StoreIO`, outside the lock, where a call that raises counts as CLIENT_EXCEPTION for each of its keys. Any
other exception fails the job, which is still reported (S5) / whose blocks are still reported failed
(S8). So does abandoning a generator (``close()``, or its collection): see ``save_steps``, ``load_steps``.

Counting: every event is counted once, into ``stats`` (kvledger_connector/telemetry/stats.py), which feeds vLLM's
stats, Prometheus and the whole-run totals.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence, TypeVar

from kvledger import codes
from kvledger.counts import Counter, Counts
from kvledger.errors import LedgerError, LedgerInputError, LedgerInvariantError
from kvledger.load import LoadLedger, LoadResult, load_order
from kvledger.worker import Verdict, WorkerLedger, put_positions
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.metadata import (DropNotice, LoadSpec, SaveSpec, check_drop_notice, check_job_id,
                                         check_load_spec, check_req_id, check_save_spec, reportable_blocks)
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.io import StoreCall, StoreIO, Stepped

if TYPE_CHECKING:
    from kvledger_connector.shape.integrity import BlockSeal

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_ERRORS_KEPT = 64  # handler errors remembered for inspection (bounded)
# objects that failed their integrity tag, waiting for the store's own thread to remove them (bounded: one
# left out fails its next load again and is queued then)
MAX_PENDING_REMOVALS = 256

# (ptrs, sizes) per (block id, part of a block), as the store's batch calls take them: the connector's KV cache
# plans, or a driver's
Buffers = Callable[[list[int], list[int]], tuple[list[list[int]], list[list[int]]]]


class JobAction(enum.Enum):
    """The model action (tla/KVLedger.tla) a job's generator has just done; the value is its name there.
    START is not a model action: a save job taken from the queue, nothing done yet."""
    START = "Start"
    DMA_READ = "DmaRead"
    PUT = "Put"
    REPORT = "Report"
    EMIT_LOAD = "EmitLoad"
    LOAD = "Load"


@dataclass(frozen=True)
class SavePlan:
    """What DmaRead decided for one store job: its verdict and the block positions to put."""
    job_id: int
    verdict: Verdict
    start: int  # first block position of the request to put (from the rank's saved offset)
    end: int  # one past the last

    @property
    def run(self) -> bool:
        return self.verdict is Verdict.RUN

    @property
    def positions(self) -> range:
        return range(self.start, self.end) if self.run else range(0)


@dataclass(frozen=True)
class SaveStep:
    """Where a save job's generator stopped: the action just done and what it decided."""
    action: JobAction
    job_id: int
    verdict: Verdict | None = None  # from DMA_READ on (None if the job failed before the verdict)
    plan: SavePlan | None = None  # DMA_READ: the block positions the put reads
    outcome: codes.PutOutcome | None = None  # PUT: the put's classified outcome
    error: str | None = None  # the job failed in this action: the handler raised (or an exception was thrown in)


@dataclass(frozen=True)
class LoadStep:
    """Where a load's generator stopped: the action just done."""
    action: JobAction
    load_id: int
    failed: tuple[tuple[int, int], ...] = ()  # LOAD: (block id, code) of each block of the sub-batch not loaded
    result: LoadResult | None = None  # set on the step that finished the load (then the generator ends)


@dataclass(frozen=True)
class SaveJob:
    """A received store job, its blocks [0, end_block) resolved (`SentBlocks.resolve`): what the store
    thread runs (`WorkerSteps.run_save`)."""
    req_id: str
    job_id: int
    end_block: int
    full_end_block: int
    block_ids: tuple[int, ...]  # an id per KV cache group of a block, block major (SaveSpec.num_groups)
    block_hashes: tuple[Any, ...]


class SentBlocks:
    """One rank's copy of what the scheduler's SaveSpecs sent: per req_id, the ids and hashes of its current
    generation's full table blocks, in table order. A SaveSpec carries only the blocks no earlier job of
    the generation sent; a job may read any block before its end (the rank resumes from its own saved
    offset), so the rank resolves them here. A full-attention group's table never changes while its
    generation lives (vLLM only appends to it), so a job keeps the ids it resolved even after its
    generation's table is dropped or replaced. A sliding-window group's table turns null below the window
    (vLLM frees those blocks, which no job then pins): each spec says where (`SaveSpec.null_before`) and the
    ids kept below it become 0, never read again.

    Bounded by ``max_requests`` tables (the oldest table is dropped to make room; a later spec continuing
    it is refused as input error, and its job reported at once: a cache miss, never a wrong block) and each
    by the request's table."""

    def __init__(self, max_requests: int, counts: Counter | None = None) -> None:
        if max_requests.__class__ is not int or max_requests <= 0:
            raise LedgerInputError("max_requests", max_requests, "must be an int > 0")
        self.max_requests = max_requests
        self._tables: dict[str, tuple[int, list[int], list[Any]]] = {}  # req_id -> (generation, ids, hashes)
        self.counts: Counter = counts if counts is not None else Counts()  # sent_tables_evicted

    def __len__(self) -> int:
        return len(self._tables)

    def resolve(self, spec: SaveSpec) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The job's blocks [0, spec.end_block): the table's, extended by the spec's new full blocks, then
        its partial tail if it has one. Refuses (LedgerInputError, the table unchanged) a spec whose
        blocks do not continue its generation's table."""
        check_save_spec(spec)  # its fields; the block ids' range is the worker's to check (it knows the cache)
        start, g = spec.start_block, spec.num_groups
        where = f"SaveSpec job {spec.store_job_id} ({spec.req_id!r})"
        full_end = spec.full_end_block
        known = self._tables.get(spec.req_id)
        if start == 0:
            ids: list[int] = []
            hashes: list[Any] = []
        elif known is None or known[0] != spec.generation or len(known[2]) < start:
            have = "none" if known is None else f"generation {known[0]}, {len(known[2])} blocks"
            raise LedgerInputError(f"{where} start_block", start,
                                   f"continues generation {spec.generation}'s blocks, this rank holds {have}")
        else:
            ids, hashes = known[1], known[2]
            del ids[start * g:], hashes[start:]  # a spec may resend blocks; they are the same blocks
        n_new = full_end - start
        ids.extend(spec.block_ids[:n_new * g])
        hashes.extend(spec.block_hashes[:n_new])
        for grp, below in enumerate(spec.null_before):  # freed by vLLM since they were sent: never read
            for b in range(min(below, len(hashes))):
                ids[b * g + grp] = 0
        if known is None or start == 0:
            self._tables.pop(spec.req_id, None)
            if len(self._tables) >= self.max_requests:
                del self._tables[next(iter(self._tables))]  # the oldest: its next spec is refused
                self.counts.add("sent_tables_evicted")
        self._tables[spec.req_id] = (spec.generation, ids, hashes)
        return (tuple(ids) + tuple(spec.block_ids[n_new * g:]),
                tuple(hashes) + tuple(spec.block_hashes[n_new:]))

    def drop(self, req_id: str, generation: int | None) -> None:
        """DropGeneration: forget ``req_id``'s table unless it is of a newer generation (a late notice)."""
        known = self._tables.get(req_id)
        if known is not None and (generation is None or known[0] <= generation):
            del self._tables[req_id]


# a job's generator: its model steps, and the store calls it needs made (each answered by ``send(codes)``)
SaveCalls = Generator["SaveStep | StoreCall", "list[int] | None", None]
LoadCalls = Generator["LoadStep | StoreCall", "list[int] | None", None]
Codes = Generator[StoreCall, "list[int] | None", list[int]]  # one store call's part of a job: its codes


class WorkerSteps:
    """One rank's step functions over its ledgers. They make no store call: a job's generator yields each
    `StoreCall` and is sent its codes (kvledger_connector/store/io.py); ``io`` arguments are the caller's
    `StoreIO`, which makes them. ``lock`` guards the ledgers (the connector shares it with the model runner
    thread); store calls run outside it."""

    def __init__(self, config: ConnectorConfig, *, ledger: WorkerLedger, loads: LoadLedger, buffers: Buffers,
                 tp_rank: int, key_bytes: int = 0, shape: BlockShape | None = None,
                 stats: StatsRecorder | None = None, lock: ContextManager[Any] | None = None,
                 stripe: tuple[int, int] | None = None, num_blocks: int | None = None) -> None:
        """``config``: the connector's, checked whole where it was built (its ``block_size``, and its store's
        ``load_sub_batch_keys``). ``ledger.max_requests`` also bounds the `SentBlocks` tables (one per request generation).
        ``shape``: this rank's block (kvledger_connector/shape/block_shape.py), its parts' key builders; None: no
        keys, every job fails. ``buffers`` takes each entry's block id and part. ``stripe``: (this rank's
        replica index, replicas) among ranks that share keys (`kvledger.put_positions`); default the shape's,
        else (0, 1). ``num_blocks``: blocks of the registered KV cache, the range a spec's block ids are
        checked against (0: none registered, every id refused; None: a driver's own buffers, ids not bounded
        above)."""
        if not isinstance(config, ConnectorConfig):
            raise LedgerInputError("config", type(config).__name__, "must be a ConnectorConfig")
        if shape is not None and not isinstance(shape, BlockShape):
            raise LedgerInputError("shape", type(shape).__name__, "must be a BlockShape")
        self.ledger = ledger
        self.loads = loads
        self.buffers = buffers
        self.tp_rank = tp_rank
        self.block_size = config.block_size
        self.key_bytes = key_bytes  # set once the KV cache is registered (with the trailer, under a seal)
        self.seal: BlockSeal | None = None  # integrity tags (kvledger_connector/shape/integrity.py); None: off
        # swapped whole by a weights-version switch (`BlockShape.rekeyed`); the threads read it once per job
        self.shape = shape
        if stripe is None:
            stripe = shape.stripe if shape is not None else (0, 1)
        put_positions(0, 0, *stripe)  # checks it
        self.stripe = stripe
        self.sub_batch = config.store.load_sub_batch_keys
        # a full memory segment with the disk tier frees room each heartbeat: its keys are put again (bounded)
        self.full_retries = config.store.full_put_retries if config.store.disk_offload else 0
        self.full_retry_s = config.store.full_put_retry_ms / 1000
        self.stats = stats or StatsRecorder()
        self.sent = SentBlocks(ledger.max_requests, counts=self.stats)
        self.lock: ContextManager[Any] = lock if lock is not None else threading.Lock()
        self.num_blocks = num_blocks
        # keys of objects that failed their integrity tag, in order, each once (bounded): removed by
        # the store's own thread (`take_removals`), never on the thread that loaded (a sync load runs on
        # the model runner's)
        self.removals: dict[str, None] = {}
        # loads finished and not yet reported, in order (bounded by loads in flight); a list, not a set: two
        # loads of one reused req_id may finish before a step takes them, and each must be reported
        self.finished_loads: list[str] = []
        # sync loads (run inside the step, before the forward) finished and not yet reported, in order;
        # reported in the worker metadata's completed_loads, not through vLLM's finished_recving
        self.finished_sync_loads: list[str] = []
        # async loads finished with a block not loaded, in order (several KV cache groups: reported per
        # request in vLLM's failed_recving, with the load's finished_recving)
        self.failed_loads: list[str] = []
        self.errors: list[str] = []  # handler errors (bounded); tests assert it stays empty

    @property
    def dense_table(self) -> bool:
        """One full-attention group (`BlockShape.dense_table`, the scheduler side's rule too): a job's ids are
        its every block and a failed load is reported by block; else null ids are nothing to put and a
        failed load is reported per request."""
        return self.shape is None or self.shape.dense_table

    @property
    def num_groups(self) -> int:
        """KV cache groups of this rank's blocks (a SaveSpec's ids per block, a LoadSpec's group range)."""
        return self.shape.num_groups if self.shape is not None else 1

    @property
    def keys_per_block(self) -> int:
        """A block's keys in its KV cache group (`BlockShape.keys_per_block`)."""
        return self.shape.keys_per_block if self.shape is not None else 1

    def block_shape(self) -> BlockShape:
        if self.shape is None:
            raise LedgerInputError("shape", None, "a BlockShape (its parts' KeyBuilders) is needed to turn block "
                                   "hashes into keys")
        return self.shape

    def note_error(self, msg: str) -> None:
        logger.error("kvledger worker r%d: %s", self.tp_rank, msg)
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(msg)

    def has_pending_work(self) -> bool:
        """A job not yet reported, or a load not finished or not yet taken by a step."""
        with self.lock:
            return (self.ledger.has_pending_work() or bool(self.finished_loads)
                    or bool(self.finished_sync_loads) or self.loads.num_inflight_loads > 0)

    def busy(self) -> bool:
        """A job not yet reported or a load not yet finished (results waiting to be taken do not count)."""
        with self.lock:
            return self.ledger.num_live_jobs > 0 or self.loads.num_inflight_loads > 0

    # ------------------------------------------------------------------ saves
    def receive(self, req_id: str, job_id: int, generation: int | None) -> None:
        """Receive: the job joins its generation's live set (before it is queued, so a drop sees it)."""
        with self.lock:
            self.ledger.register(req_id, job_id, generation)

    def receive_save(self, spec: SaveSpec) -> SaveJob | None:
        """Receive of one SaveSpec, checked whole first (`check_save_spec`: against this rank's KV cache; a
        job id no job of this rank has), then `receive`, then the job's blocks resolved from what earlier
        specs of its generation sent (`SentBlocks`). A malformed spec, or one that does not continue them,
        is bad input: nothing runs and None is returned; its job is reported at once (its pins are
        released; a cache miss), unless its id is not a job id or another job's (that report would count
        twice: the spec is dropped, kept in ``errors``)."""
        try:
            check_save_spec(spec, num_blocks=self.num_blocks, null_ok=not self.dense_table)
            if spec.num_groups != self.num_groups:
                raise LedgerInputError(f"SaveSpec job {spec.store_job_id} num_groups", spec.num_groups,
                                       f"this rank's blocks are of {self.num_groups} KV cache group(s)")
            with self.lock:
                known = self.ledger.knows_job(spec.store_job_id)
            if known:
                raise LedgerInputError(f"SaveSpec job {spec.store_job_id} store_job_id", spec.store_job_id,
                                       "another job of this rank has it")
            # a job its request cannot join (this rank holds `max_requests` request states): refused alike
            self.receive(spec.req_id, spec.store_job_id, spec.generation)
        except LedgerInputError as e:
            self._refuse_save(spec, e)
            return None
        try:
            with self.lock:
                ids, hashes = self.sent.resolve(spec)
        except LedgerInputError as e:
            self.note_error(f"refused: {e}")
            self.reject_save(spec.store_job_id)
            return None
        return SaveJob(spec.req_id, spec.store_job_id, spec.end_block, spec.full_end_block, ids, hashes)

    def _refuse_save(self, spec: Any, err: LedgerInputError) -> None:
        """A malformed SaveSpec: its job, where its id can be reported, registered in no generation and
        reported at once (`WorkerLedger.refuse`); no block is read, nothing is put."""
        self.stats.add("refused_specs")
        job_id: Any = getattr(spec, "store_job_id", None)
        req_id: Any = getattr(spec, "req_id", None)
        try:
            check_job_id("SaveSpec", job_id)
            with self.lock:
                self.ledger.refuse(req_id if req_id.__class__ is str else repr(req_id), job_id)
        except LedgerError as e:  # no job to report: its id is not one, or another job's
            self.note_error(f"refused, not reported ({e}): {err}")
            return
        self.note_error(f"refused: {err}")
        self.reject_save(job_id)

    def receive_drop(self, notice: DropNotice) -> bool:
        """DropGeneration of one DropNotice, checked whole first (`check_drop_notice`). Returns whether the
        notice releases a held request (the rank answers it in finished_sending). A malformed notice with a
        req_id closes that req_id's open generation, whichever it is (its queued jobs go stale: a cache miss
        at worst, never a stale job's effect) and still releases a held request, so it never waits for
        ever; the error is kept in ``errors``."""
        try:
            check_drop_notice(notice)
        except LedgerInputError as e:
            self.stats.add("refused_specs")
            self.note_error(f"malformed, applied as a preemption of whatever generation is open: {e}")
            req_id: Any = getattr(notice, "req_id", None)
            try:
                check_req_id("DropNotice", req_id)
            except LedgerInputError:
                return False
            self.drop_generation(req_id, finished=False, generation=None)
            return getattr(notice, "release", False) is True
        self.drop_generation(notice.req_id, finished=notice.finished, generation=notice.generation)
        return notice.release

    def drop_generation(self, req_id: str, *, finished: bool, generation: int | None) -> None:
        """DropGeneration: the scheduler preempted or finished ``req_id`` (its generation's jobs go stale,
        or it closes when its last job reports); the blocks its specs sent are forgotten."""
        with self.lock:
            self.ledger.drop_generation(req_id, finished=finished, generation=generation)
            self.sent.drop(req_id, generation)

    def take_reports(self) -> dict[int, int]:
        """The jobs reported since the last call, ``{job: 1}``: this rank's part of the step's
        ``completed_saves`` (the engine sums the ranks' parts)."""
        with self.lock:
            return self.ledger.take_completed()

    def begin_save(self, job_id: int, end_block: int) -> SavePlan:
        """DmaRead: the ledger's verdict; a running job puts from the rank's saved offset to ``end_block``."""
        with self.lock:
            verdict = self.ledger.begin(job_id)
            offset = self.ledger.saved_offset(job_id)
        self.stats.add({Verdict.RUN: "run_jobs", Verdict.STALE: "stale_jobs", Verdict.SKIP: "skipped_jobs"}[verdict])
        return SavePlan(job_id, verdict, min(offset // self.block_size, end_block), end_block)

    def put(self, keys: Sequence[str], ids: Sequence[int], before_read: Callable[[], None] | None = None,
            tails: Sequence[int] = (), parts: Sequence[int] | None = None) -> Codes:
        """Put: the keys not in the store yet are put from ``buffers(ids, parts)`` (``before_read``: wait for
        the forward's writes first); ``tails``: the indices of a partial tail block's keys (one per part of the
        block), whose later slots decode may still write; ``parts``: each key's part of a block (default part
        0). Yields its store calls; returns one code per key (0 for a key already present)."""
        keys = list(keys)
        if len(ids) != len(keys):
            raise LedgerInputError("ids", len(ids), f"one buffer id per key ({len(keys)} keys)")
        parts = [0] * len(keys) if parts is None else list(parts)
        if len(parts) != len(keys):
            raise LedgerInputError("parts", len(parts), f"one part per key ({len(keys)} keys)")
        if not keys:
            return []
        exist = yield StoreCall("batch_is_exist", tuple(keys))
        todo = codes.missing(exist, len(keys))
        out = [int(codes.STORED)] * len(keys)
        if not todo:
            return out
        if before_read is not None:
            before_read()
        put_keys, put_ids = [keys[j] for j in todo], [ids[j] for j in todo]
        put_parts = [parts[j] for j in todo]
        ptrs, sizes = self.buffers(put_ids, put_parts)
        if self.seal is None:
            res = yield from self._put_until_room(put_keys, ptrs, sizes)
        else:  # each object ends in its trailer (kvledger_connector/shape/integrity.py), tagged from the blocks read
            with self.seal.slot(len(todo)) as slot:
                stages = [j for j, i in enumerate(todo) if i in tails]
                trailers, staged = self.seal.seal(slot, put_keys, put_ids, stages, put_parts)
                for j, ptr in zip(stages, staged):  # a tail is sent from the copy its tag was computed over
                    ptrs[j], sizes[j] = [ptr], [self.seal.block_bytes]
                res = yield from self._put_until_room(put_keys, [p + [t] for p, t in zip(ptrs, trailers)],
                                                      [s + [self.seal.trailer_bytes] for s in sizes])
        for j, c in zip(todo, res):
            out[j] = c
        self.stats.add("put_bytes", self.key_bytes * sum(1 for c in res if c == codes.STORED))
        return out

    def _put_until_room(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> Codes:
        """The batch put of ``keys``; the keys the store had no room for (NO_AVAILABLE_HANDLE) put again after
        a wait, up to ``full_retries`` times (the disk tier frees memory as it writes objects out). Returns
        each key's last code."""
        res = yield StoreCall("batch_put", tuple(keys), tuple(ptrs), tuple(sizes))
        codes.check_count("batch_put codes", res, len(keys))
        out = list(res)
        for _ in range(self.full_retries):
            full = [j for j, c in enumerate(out) if c == codes.NO_AVAILABLE_HANDLE]
            if not full:
                break
            self.stats.add("full_put_retries")
            self.stats.add("full_put_retried_keys", len(full))
            yield StoreCall("wait", (), wait_s=self.full_retry_s)
            res = yield StoreCall("batch_put", tuple(keys[j] for j in full), tuple(ptrs[j] for j in full),
                                  tuple(sizes[j] for j in full))
            codes.check_count("batch_put codes", res, len(full))
            for j, c in zip(full, res):
                out[j] = c
        return out

    def record_put(self, job_id: int, put_codes: Sequence[int], num_keys: int, saved_tokens: int
                   ) -> codes.PutOutcome:
        """The put's outcome into the ledger: stored (the offset moves to ``saved_tokens``) only if every
        key is stored; otherwise failed, under pressure if the store had no space."""
        out = codes.classify_put(put_codes, num_keys)
        if not out.stored:
            self.stats.add("failed_jobs")
            self.stats.add("put_failed_keys", len(out.failed_codes))
            for c in out.failed_codes:
                self.stats.fail_code(c)
        with self.lock:
            if out.stored:
                self.ledger.record_saved(job_id, saved_tokens)
            else:
                self.ledger.record_failed(job_id, pressure=out.pressure)
        return out

    def fail_save(self, job_id: int) -> bool:
        """The handler raised: the job fails where it is (DmaRead from queued, Put from running). Returns
        whether it failed the job (False: it had already an outcome)."""
        with self.lock:
            if self.ledger.job_state(job_id) not in ("queued", "running"):
                return False
            self.ledger.record_failed(job_id)
        self.stats.add("failed_jobs")
        return True

    def report_save(self, job_id: int) -> None:
        """Report: exactly once per job, on every exit path."""
        with self.lock:
            self.ledger.finish(job_id)

    def reject_save(self, job_id: int) -> None:
        """A received job that is never run (a full queue, or shut down): reported at once, its pins are
        released and the save becomes a future cache miss."""
        self.stats.add("rejected_jobs")
        self.report_save(job_id)

    def save_steps(self, io: StoreIO, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                   block_hashes: Sequence[Any], before_read: Callable[[], None] | None = None,
                   full_end_block: int | None = None) -> Stepped[SaveStep]:
        """One store job as an iterator of its model steps, its store calls made by ``io``
        (`Stepped`), already started: it stands at START (nothing done). Each ``next()`` does the next model
        action and returns its `SaveStep`:

            DMA_READ  the ledger's verdict (RUN, STALE, SKIP); a job that does not run goes to REPORT next
            PUT       the missing keys put from ``buffers`` (``before_read`` first) and the outcome recorded
            REPORT    WorkerLedger.finish, in a ``finally``; then the generator ends (StopIteration)

        ``gen.throw(exc)`` (an ``Exception``) is the handler raising in the action it stands before: the job
        fails where it is (thrown at START: ``DmaRead -> failed``; before PUT: ``Put -> failed``), is kept in
        ``errors``, and ``throw`` returns that action's step with ``error`` set; REPORT follows. One thrown
        after the outcome is recorded changes no outcome: ``throw`` returns REPORT. The same holds for an
        exception raised inside an action. ``gen.close()`` (or the generator's collection) before REPORT
        abandons the job: it fails where it is and is reported, inside ``close()``; a BaseException thrown in
        does the same and propagates. Every path reports exactly once (S5).

        It starts here so that a throw or close always finds the job's ``try``: those on an unstarted
        generator would run none of it, and the job would never be reported.
        ``full_end_block`` (default ``end_block``): where the saved offset moves on success — before a
        partial tail block, which is stored under its own key and saved whole later if decode fills it.
        ``block_ids``: an id per KV cache group of each block (`SaveSpec`); a block is saved only when every
        part's key of it is (a null id has nothing to put)."""
        gen = Stepped(self._save_job(req_id, job_id, end_block, block_ids, block_hashes, before_read,
                                     full_end_block), io)
        next(gen)  # START
        return gen

    def _save_job(self, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                  block_hashes: Sequence[Any], before_read: Callable[[], None] | None,
                  full_end_block: int | None) -> SaveCalls:
        nxt = JobAction.DMA_READ  # the action under way or next: the one a failure ends
        verdict: Verdict | None = None
        try:
            try:
                yield SaveStep(JobAction.START, job_id)
                plan = self.begin_save(job_id, end_block)
                verdict = plan.verdict
                nxt = JobAction.PUT if plan.run else JobAction.REPORT
                yield SaveStep(JobAction.DMA_READ, job_id, verdict, plan)
                if plan.run:  # this rank's share of the job's keys (all of them unless ranks share keys)
                    pos = put_positions(plan.start, plan.end, *self.stripe)
                    partial = full_end_block is not None and full_end_block < end_block  # the last is a tail
                    keys, ids, parts, at = self._entries(pos, block_ids, block_hashes)
                    # a partial tail is a key per part of its block, each staged
                    tails = [j for j, i in enumerate(at) if partial and i == end_block - 1]
                    res = yield from self.put(keys, ids, before_read, tails, parts)
                    saved_to = end_block if full_end_block is None else full_end_block
                    out = self.record_put(job_id, res, len(keys), saved_to * self.block_size)
                    nxt = JobAction.REPORT
                    yield SaveStep(JobAction.PUT, job_id, verdict, outcome=out)
            except Exception as e:  # the job fails; it is reported below all the same
                msg = f"{type(e).__name__}: {e}"
                self._fail(job_id, f"save job {job_id} ({req_id}): {msg}")
                if nxt is not JobAction.REPORT:
                    yield SaveStep(nxt, job_id, verdict, error=msg)
        except BaseException as e:  # GeneratorExit (closed, abandoned) or an interrupt: fail, report, re-raise
            self._fail(job_id, f"save job {job_id} ({req_id}) abandoned at {nxt.value}: {type(e).__name__}")
            raise
        finally:
            try:
                self.report_save(job_id)
            except LedgerError as e:
                self.note_error(f"report job {job_id}: {e}")
        yield SaveStep(JobAction.REPORT, job_id, verdict)

    def _fail(self, job_id: int, msg: str) -> None:
        self.note_error(msg)
        try:
            self.fail_save(job_id)
        except LedgerError as e:
            self.note_error(f"fail job {job_id}: {e}")

    def run_save(self, io: StoreIO, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                 block_hashes: Sequence[Any], before_read: Callable[[], None] | None = None,
                 full_end_block: int | None = None) -> None:
        """One store job, as the store thread runs it: `save_steps` drained."""
        for _ in self.save_steps(io, req_id, job_id, end_block, block_ids, block_hashes, before_read, full_end_block):
            pass

    def _entries(self, pos: Sequence[int], block_ids: Sequence[int], block_hashes: Sequence[Any]
                 ) -> tuple[list[str], list[int], list[int], list[int]]:
        """(keys, block ids, parts, positions) of blocks ``pos``, part by part, each key its part's builder's.
        A table that may hold vLLM's null block (`dense_table` false) has nothing to put there; in a dense
        one a null id is an error the buffers report."""
        shape = self.block_shape()
        stride, sparse = shape.num_groups, not shape.dense_table
        if len(block_ids) < len(block_hashes) * stride:
            raise LedgerInputError("block_ids", len(block_ids), f"an id per KV cache group ({stride}) of each of "
                                   f"{len(block_hashes)} blocks")
        keys: list[str] = []
        ids: list[int] = []
        parts: list[int] = []
        positions: list[int] = []
        for p, part in enumerate(shape.parts):
            at = [i for i in pos if not (sparse and block_ids[i * stride + part.group] == 0)]
            keys += part.builder.keys([block_hashes[i] for i in at])
            ids += [block_ids[i * stride + part.group] for i in at]
            parts += [p] * len(at)
            positions += at
        return keys, ids, parts, positions

    # ------------------------------------------------------------------ loads
    def admit_load(self, spec: LoadSpec) -> bool:
        """EmitLoad's input, checked whole before anything runs (`check_load_spec`, against this rank's KV
        cache). True: the load may run (`run_load`). Otherwise it is over here, nothing read: a malformed
        spec, or one the scheduler refused (`LoadSpec.refused`), has every block it names reported failed
        and is finished (its request never waits, vLLM's policy acts on the blocks); a spec without a req_id
        names no request to report and is only kept in ``errors``."""
        try:
            check_load_spec(spec, num_blocks=self.num_blocks, num_groups=self.num_groups)
        except LedgerInputError as e:
            self.stats.add("refused_specs")
            req_id: Any = getattr(spec, "req_id", None)
            try:
                check_req_id("LoadSpec", req_id)
            except LedgerInputError:
                self.note_error(f"refused, not reported (no request to report): {e}")
                return False
            self.note_error(f"refused: {e}")
            ids = reportable_blocks(getattr(spec, "block_ids", ()), self.num_blocks)
            self.reject_load(req_id, ids, f"malformed: {e}", sync=bool(getattr(spec, "sync", False)))
            return False
        if spec.refused:
            self.reject_load(spec.req_id, spec.block_ids, f"refused by the scheduler: {spec.refused}",
                             sync=bool(spec.sync))
            return False
        return True

    def begin_load(self, req_id: str, block_ids: Sequence[int]) -> int:
        with self.lock:  # a block is loaded once all its keys are (several in the TP-shared layout)
            load_id = self.loads.begin_load(req_id, block_ids, keys_per_block=self.keys_per_block)
        self.stats.add("loads")
        return load_id

    def load_batch(self, load_id: int, keys: Sequence[str], block_ids: Sequence[int],
                   parts: Sequence[int] | None = None) -> Generator[StoreCall, list[int] | None, list[tuple[int, int]]]:
        """Load: one batch get of ``keys`` into the blocks ``block_ids`` (one per key; ``parts``: each key's
        part of a block, default part 0), classified by :mod:`kvledger.codes`. Yields the get; returns (block
        id, code) of each block not loaded (already reported)."""
        if len(keys) != len(block_ids):
            raise LedgerInputError("block_ids", len(block_ids), f"one block per key ({len(keys)} keys)")
        parts = [0] * len(keys) if parts is None else list(parts)
        if len(parts) != len(keys):
            raise LedgerInputError("parts", len(parts), f"one part per key ({len(keys)} keys)")
        ptrs, sizes = self.buffers(list(block_ids), parts)
        if self.seal is None:
            res = yield StoreCall("batch_get", tuple(keys), tuple(ptrs), tuple(sizes))
        else:
            with self.seal.slot(len(keys)) as slot:
                tails = self.seal.trailer_ptrs(slot, len(keys))
                res = yield StoreCall("batch_get", tuple(keys), tuple(p + [t] for p, t in zip(ptrs, tails)),
                                      tuple(s + [self.seal.trailer_bytes] for s in sizes))
                res = self._verified(slot, keys, block_ids, res, parts)
        with self.lock:
            bad = self.loads.record_results(load_id, block_ids, res, self.key_bytes)
        for _, c in bad:
            self.stats.fail_code(c if c < 0 else int(StoreCode.INVALID_PARAMS))
        self.stats.add("get_bytes", self.key_bytes * (len(keys) - len(bad)))
        return bad

    def _verified(self, slot: int, keys: Sequence[str], block_ids: Sequence[int], res: list[int],
                  parts: Sequence[int] | None = None) -> list[int]:
        """The get's codes with every object read whole but failing its tag turned into INTEGRITY_MISMATCH
        (a load error: vLLM's policy acts, the bytes are never used). Such an object is removed from the
        store: it would fail every later load of its key, and while it exists no save replaces it."""
        if len(res) != len(keys):
            return res  # record_results names the broken store
        whole = [i for i, c in enumerate(res) if codes.is_loaded(c, self.key_bytes)]
        if not whole:
            return res
        ok = self.seal.verify(slot, [keys[i] for i in whole], [block_ids[i] for i in whole],
                              None if parts is None else [parts[i] for i in whole], rows=whole)
        out = list(res)
        for i, good in zip(whole, ok):
            if not good:
                out[i] = int(StoreCode.INTEGRITY_MISMATCH)
                self.stats.add("integrity_mismatches")
                logger.warning("kvledger worker r%d: %s does not match its integrity tag: not loaded, removed",
                               self.tp_rank, keys[i])
                self.queue_removal(keys[i])
        return out

    def queue_removal(self, key: str) -> None:
        """``key``'s object failed its tag: queued for `take_removals` (the store's own thread), each key
        once; past the bound it is left (counted): its next load fails the tag again and queues it then."""
        with self.lock:
            if key not in self.removals and len(self.removals) >= MAX_PENDING_REMOVALS:
                self.stats.add("integrity_removals_dropped")
                return
            self.removals[key] = None

    def take_removals(self) -> list[str]:
        """The keys of every queued object that failed its tag, each once, for removal by force (a reader's
        lease must not keep it: while it exists no save replaces it) on the store's own threads (the
        worker's store and load threads, `StoreIO.remove`), never the model runner's. Best effort: the load
        error stood already."""
        with self.lock:
            keys, self.removals = list(self.removals), {}
        return keys

    def pending(self, load_id: int) -> list[int]:
        with self.lock:
            return self.loads.pending(load_id)

    def finish_load(self, load_id: int, reason: str, sync: bool = False) -> LoadResult:
        """Errors first, then finished, under one lock: vLLM reads finished before errors in a step, so a
        request is never seen finished without its failed blocks (S8 LoadErrorsReported). A sync load is
        reported in the worker metadata (`take_finished_sync_loads`), an async one in finished_recving."""
        with self.lock:
            self.loads.fail_pending(load_id, reason)
            result = self.loads.finish_load(load_id)
            (self.finished_sync_loads if sync else self.finished_loads).append(result.req_id)
            if result.failed and not sync and not self.dense_table:  # taken each step with finished ones
                self.failed_loads.append(result.req_id)
        if result.failed:
            self.stats.add("load_errors_reported", len(result.failed))
        return result

    def reject_load(self, req_id: str, block_ids: Sequence[int], reason: str, sync: bool = False) -> LoadResult:
        """A load that is never tried (a full queue): every block reported failed, vLLM recomputes."""
        self.stats.add("rejected_loads")
        return self.finish_load(self.begin_load(req_id, block_ids), reason, sync)

    def load_steps(self, io: StoreIO, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any],
                   sync: bool = False, groups: Sequence[int] = ()) -> Stepped[LoadStep]:
        """One load as an iterator of its model steps, its store calls made by ``io`` (`Stepped`); not
        started: nothing is owed before the first ``next()``. Each ``next()`` does the next model action and
        returns its `LoadStep`:

            EMIT_LOAD  LoadLedger.begin_load; the keys in this rank's load order (`load_pairs`: rotated by
                       tp_rank, each block id travelling with its key); oversized keys reported. A load with
                       nothing to try (no keys, every key too long, a bad input) is finished here.
            LOAD       one sub-batch of at most ``load_sub_batch_keys`` keys; every sub-batch is tried. The
                       last one's step also finishes the load: every block still pending is reported
                       failed, then finish_load (``result`` set). Then the generator ends.

        An exception raised in a sub-batch, or thrown in before the load finished, stops it: every block not
        loaded is reported failed and the load finished (the step returned, or ``throw``'s, has ``result``).
        ``close()`` (or the generator's collection) before the load finished does the same inside
        ``close()`` (S8). ``sync``: the load is reported as a sync one (`finish_load`). ``groups``: each
        block's KV cache group (`LoadSpec.groups`)."""
        return Stepped(self._load_job(req_id, block_ids, block_hashes, sync, groups), io)

    def _load_job(self, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any], sync: bool,
                  groups: Sequence[int]) -> LoadCalls:
        load_id = self.begin_load(req_id, block_ids)
        reason = "not attempted"
        result: LoadResult | None = None
        try:
            subs: list[list[tuple[str, int, int]]] = []
            try:
                subs = self._sub_batches(load_id, req_id, block_ids, block_hashes, groups)
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                self.note_error(f"load {req_id}: {reason}")
            if not subs:  # nothing to load: still reported finished (upstream divides by zero here)
                result = self.finish_load(load_id, reason, sync)
            yield LoadStep(JobAction.EMIT_LOAD, load_id, result=result)
            for i, sub in enumerate(subs):
                bad: list[tuple[int, int]] = []
                try:
                    bad = yield from self.load_batch(load_id, [k for k, _, _ in sub], [b for _, b, _ in sub],
                                          [p for _, _, p in sub])
                except LedgerInputError as e:  # e.g. a block id outside the cache: this sub-batch fails
                    reason = str(e)  # its blocks stay pending: reported when the load finishes
                    self.note_error(f"load {req_id}: {e}")
                if i == len(subs) - 1:
                    result = self.finish_load(load_id, reason, sync)
                yield LoadStep(JobAction.LOAD, load_id, tuple(bad), result)
        except Exception as e:  # raised or thrown in: the rest is not tried, every block not loaded reported
            reason = f"{type(e).__name__}: {e}"
            self.note_error(f"load {req_id}: {reason}")
            if result is None:
                result = self.finish_load(load_id, reason, sync)
                yield LoadStep(JobAction.LOAD, load_id, (), result)
        finally:
            if result is None:  # closed (abandoned) or an interrupt: S8 all the same
                try:
                    self.finish_load(load_id, "load abandoned", sync)
                except LedgerError as e:
                    self.note_error(f"finish load {load_id} of {req_id!r}: {e}")

    def _sub_batches(self, load_id: int, req_id: str, block_ids: Sequence[int],
                     block_hashes: Sequence[Any], groups: Sequence[int] = ()) -> list[list[tuple[str, int, int]]]:
        """The (key, block id, part) sub-batches of a load in this rank's order: a key per part of each
        block's KV cache group (``groups``, default group 0), each its part's builder's, which also reports
        it if it is too long."""
        shape = self.block_shape()
        n = len(block_ids)
        if n != len(block_hashes):
            raise LedgerInputError("LoadSpec.block_hashes", len(block_hashes), f"{n} block ids for {req_id!r}")
        if groups and (len(set(block_ids)), len(groups)) != (n, n):
            raise LedgerInputError("LoadSpec.groups", len(groups), f"one per block id, ids unique ({n} ids)")
        if groups and not all(g.__class__ is int and 0 <= g < shape.num_groups for g in groups):
            raise LedgerInputError("LoadSpec.groups", sorted(set(groups)),
                                   f"KV cache groups of this rank are 0..{shape.num_groups - 1}")
        entries = [(shape.parts[p].builder.key(h), b, p) for b, h, g in zip(block_ids, block_hashes, groups or [0] * n)
                   for p in shape.parts_of(g)]
        # rotated by tp_rank: the ranks start on different keys of the store
        order = [(k, b, p) for k, (b, p) in load_pairs([k for k, _, _ in entries], [(b, p) for _, b, p in entries],
                                                       self.tp_rank)]
        too_long = [j for j, (k, _, p) in enumerate(order) if not shape.parts[p].builder.fits(k)]
        if too_long:
            cap = shape.parts[order[too_long[0]][2]].builder.max_key_bytes
            self.stats.fail_code(int(StoreCode.KEY_TOO_LONG), len(too_long))
            with self.lock:
                self.loads.record_failed(load_id, [order[j][1] for j in too_long],
                                         f"key longer than max_key_bytes={cap}")
            drop = set(too_long)
            order = [o for j, o in enumerate(order) if j not in drop]
        return [order[lo:lo + self.sub_batch] for lo in range(0, len(order), self.sub_batch)]

    def run_load(self, io: StoreIO, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any],
                 sync: bool = False, groups: Sequence[int] = ()) -> LoadResult:
        """One load, as a load thread (or, ``sync``, the model runner thread) runs it: `load_steps` drained."""
        result: LoadResult | None = None
        for step in self.load_steps(io, req_id, block_ids, block_hashes, sync, groups):
            result = step.result or result
        if result is None:  # load_steps ends only after its finishing step
            raise LedgerInvariantError.of("S8", f"rank {self.tp_rank}: load of {req_id!r} ended unfinished")
        return result

    def take_finished_loads(self) -> set[str]:
        """The req_ids whose load finished since the last call, each once: vLLM's finished_recving is a set,
        so a second finished load of the same req_id waits for the next step (one report per load: the
        scheduler releases one load pin per report, oldest first)."""
        with self.lock:
            done, self.finished_loads = self._once_each(self.finished_loads)
        return set(done)

    @staticmethod
    def _once_each(finished: list[str]) -> tuple[list[str], list[str]]:
        """(each req_id once, in order; the repeats, left for a later step)."""
        done: dict[str, None] = {}
        later: list[str] = []
        for req_id in finished:
            if req_id in done:
                later.append(req_id)
            else:
                done[req_id] = None
        return list(done), later

    def take_finished_sync_loads(self) -> dict[str, int]:
        """This rank's part of the step's ``completed_loads``: ``{req_id: 1}`` for each req_id whose sync load
        finished since the last call (the engine sums the ranks' parts). As in `take_finished_loads`, a
        second load of the same req_id waits for the next call: a count is per rank, per load."""
        with self.lock:
            done = self._once_each(self.finished_sync_loads)
            self.finished_sync_loads = done[1]
        return dict.fromkeys(done[0], 1)

    def take_load_errors(self) -> set[int]:
        with self.lock:
            return self.loads.take_errors()  # HandleLoadErrors

    def take_failed_loads(self, finished: set[str]) -> set[str]:
        """Of the req_ids just reported finished (`take_finished_loads`), those whose load failed a block,
        each once; the block-level errors are taken with them (HandleLoadErrors: vLLM is told per request)."""
        with self.lock:
            self.loads.take_errors()
            out: set[str] = set()
            keep: list[str] = []
            for req_id in self.failed_loads:
                (out.add if req_id in finished and req_id not in out else keep.append)(req_id)
            self.failed_loads = keep
        return out


def load_pairs(keys: Sequence[str], block_ids: Sequence[_T], tp_rank: int) -> list[tuple[str, _T]]:
    """(key, block id) in rank ``tp_rank``'s load order (kvledger.load.load_order): each block id (with its
    part, where a block is several keys) travels with its key, so a failure is reported on the block the key
    was loading into."""
    return [(keys[i], block_ids[i]) for i in load_order(len(keys), tp_rank)]


def no_lock() -> ContextManager[Any]:
    """For a single-threaded caller (the conformance driver)."""
    return contextlib.nullcontext()
