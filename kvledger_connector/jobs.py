"""The worker side's per-job work as synchronous step functions: plan → store calls → outcome into the
ledgers. No threads: the connector's store and load threads call them (kvledger_connector/worker.py), and
so does the replay/fuzz driver (conformance/kvdriver.py), one model action at a time; the driver brings
only its store and the schedule the model chooses. There is no second copy of this orchestration.

    model action   step                                   ledger calls (under ``lock``)
    Receive        WorkerSteps.receive(req_id, job, gen)  WorkerLedger.register
    DropGeneration WorkerSteps.drop_generation(req_id, ..) WorkerLedger.drop_generation
    Collect        WorkerSteps.take_reports()             WorkerLedger.take_completed (this rank's part)
    DmaRead        WorkerSteps.begin_save(job, end)       WorkerLedger.begin, saved_offset -> SavePlan
                   WorkerSteps.fail_save(job)             WorkerLedger.record_failed (handler raised)
    Put            WorkerSteps.put(keys, ids)             store: batch_is_exist, batch_put of the missing
                   WorkerSteps.record_put(job, codes, n)  kvledger.codes.classify_put -> record_saved|failed
    Report         WorkerSteps.report_save(job)           WorkerLedger.finish (exactly once)
    EmitLoad       WorkerSteps.begin_load(req_id, ids)    LoadLedger.begin_load
    Load           WorkerSteps.load_batch(load, keys, ids)  store: batch_get; LoadLedger.record_results
                   WorkerSteps.finish_load(load, reason)  LoadLedger.fail_pending, finish_load
    HandleLoadErrors  WorkerSteps.take_load_errors()      LoadLedger.take_errors

``run_save`` and ``run_load`` are one whole job each, as a connector thread runs it. Store I/O runs outside
the lock; a store call that raises counts as CLIENT_EXCEPTION for each of its keys; any other exception
fails the job, which is still reported (S5) / whose blocks are still reported failed (S8).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

from kvledger import codes
from kvledger.errors import LedgerError, LedgerInputError
from kvledger.load import LoadLedger, LoadResult, load_order
from kvledger.worker import Verdict, WorkerLedger
from kvledger_connector.keys import KeyBuilder
from kvledger_connector.stats import StatsRecorder
from kvledger_connector.store import StoreCode

logger = logging.getLogger(__name__)

MAX_ERRORS_KEPT = 64  # handler errors remembered for inspection (bounded)

# (ptrs, sizes) per id, as the store's batch calls take them: the connector's KV cache plan, or a driver's
Buffers = Callable[[list[int]], tuple[list[list[int]], list[list[int]]]]


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


@dataclass
class Counters:
    """Whole-run counters of one rank's steps."""
    saves_run: int = 0
    saves_stale: int = 0
    saves_skipped: int = 0
    saves_failed: int = 0
    load_blocks_failed: int = 0
    store_exceptions: int = 0


class WorkerSteps:
    """One rank's step functions over its ledgers and store. ``lock`` guards the ledgers (the connector
    shares it with the model runner thread); store calls run outside it."""

    def __init__(self, *, store: Any, ledger: WorkerLedger, loads: LoadLedger, buffers: Buffers,
                 tp_rank: int, block_size: int, key_bytes: int = 0, keys: KeyBuilder | None = None,
                 load_sub_batch_keys: int = 1 << 30, stats: StatsRecorder | None = None,
                 lock: ContextManager[Any] | None = None) -> None:
        if block_size.__class__ is not int or block_size <= 0:
            raise LedgerInputError("block_size", block_size, "must be an int > 0")
        if load_sub_batch_keys.__class__ is not int or load_sub_batch_keys <= 0:
            raise LedgerInputError("load_sub_batch_keys", load_sub_batch_keys, "must be an int > 0")
        self.store = store
        self.ledger = ledger
        self.loads = loads
        self.buffers = buffers
        self.tp_rank = tp_rank
        self.block_size = block_size
        self.key_bytes = key_bytes  # set once the KV cache is registered
        self.keys = keys
        self.sub_batch = load_sub_batch_keys
        self.stats = stats or StatsRecorder()
        self.lock: ContextManager[Any] = lock if lock is not None else threading.Lock()
        # loads finished and not yet reported, in order (bounded by loads in flight); a list, not a set: two
        # loads of one reused req_id may finish before a step takes them, and each must be reported
        self.finished_loads: list[str] = []
        self.counters = Counters()
        self.errors: list[str] = []  # handler errors (bounded); tests assert it stays empty

    def note_error(self, msg: str) -> None:
        logger.error("kvledger worker r%d: %s", self.tp_rank, msg)
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(msg)

    def store_call(self, fn: str, n: int, *args: Any) -> list[int]:
        """A store batch call whose exception becomes CLIENT_EXCEPTION for each of its ``n`` keys (the
        Mooncake wrapper already does this; a wrapped or test store may raise)."""
        try:
            return list(getattr(self.store, fn)(*args))
        except Exception:
            self.counters.store_exceptions += 1
            return [int(StoreCode.CLIENT_EXCEPTION)] * n

    # ------------------------------------------------------------------ saves
    def receive(self, req_id: str, job_id: int, generation: int | None) -> None:
        """Receive: the job joins its generation's live set (before it is queued, so a drop sees it)."""
        with self.lock:
            self.ledger.register(req_id, job_id, generation)

    def drop_generation(self, req_id: str, *, finished: bool, generation: int | None) -> None:
        """DropGeneration: the scheduler preempted or finished ``req_id`` (its generation's jobs go stale,
        or it closes when its last job reports)."""
        with self.lock:
            self.ledger.drop_generation(req_id, finished=finished, generation=generation)

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
        if verdict is Verdict.STALE:
            self.counters.saves_stale += 1
            self.stats.add("stale_jobs")
        elif verdict is Verdict.SKIP:
            self.counters.saves_skipped += 1
            self.stats.add("skipped_jobs")
        else:
            self.counters.saves_run += 1
        return SavePlan(job_id, verdict, min(offset // self.block_size, end_block), end_block)

    def put(self, keys: Sequence[str], ids: Sequence[int], before_read: Callable[[], None] | None = None
            ) -> list[int]:
        """Put: the keys not in the store yet are put from ``buffers(ids)`` (``before_read``: wait for the
        forward's writes first). Returns one code per key (0 for a key already present)."""
        keys = list(keys)
        if len(ids) != len(keys):
            raise LedgerInputError("ids", len(ids), f"one buffer id per key ({len(keys)} keys)")
        if not keys:
            return []
        todo = codes.missing(self.store_call("batch_is_exist", len(keys), keys), len(keys))
        out = [int(codes.STORED)] * len(keys)
        if not todo:
            return out
        if before_read is not None:
            before_read()
        ptrs, sizes = self.buffers([ids[j] for j in todo])
        t0 = time.perf_counter()
        res = self.store_call("batch_put", len(todo), [keys[j] for j in todo], ptrs, sizes)
        self.stats.add("put_s", time.perf_counter() - t0)
        self.stats.add("puts")
        self.stats.add("put_keys", len(todo))
        codes.check_count("batch_put codes", res, len(todo))
        for j, c in zip(todo, res):
            out[j] = c
        self.stats.add("put_bytes", self.key_bytes * sum(1 for c in res if c == codes.STORED))
        return out

    def record_put(self, job_id: int, put_codes: Sequence[int], num_keys: int, saved_tokens: int
                   ) -> codes.PutOutcome:
        """The put's outcome into the ledger: stored (the offset moves to ``saved_tokens``) only if every
        key is stored; otherwise failed, under pressure if the store had no space."""
        out = codes.classify_put(put_codes, num_keys)
        if not out.stored:
            self.counters.saves_failed += 1
            self.stats.add("put_failed_keys", len(out.failed_codes))
            for c in out.failed_codes:
                self.stats.fail_code(c)
        with self.lock:
            if out.stored:
                self.ledger.record_saved(job_id, saved_tokens)
            else:
                self.ledger.record_failed(job_id, pressure=out.pressure)
        return out

    def fail_save(self, job_id: int) -> None:
        """The handler raised: the job fails where it is (DmaRead from queued, Put from running)."""
        with self.lock:
            if self.ledger.job_state(job_id) in ("queued", "running"):
                self.ledger.record_failed(job_id)

    def report_save(self, job_id: int) -> None:
        """Report: exactly once per job, on every exit path."""
        with self.lock:
            self.ledger.finish(job_id)

    def run_save(self, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                 block_hashes: Sequence[Any], before_read: Callable[[], None] | None = None,
                 full_end_block: int | None = None) -> None:
        """One store job, as the store thread runs it: DmaRead, Put, Report (in a ``finally``).
        ``full_end_block`` (default ``end_block``): where the saved offset moves on success — before a
        partial tail block, which is stored under its own key and saved whole later if decode fills it."""
        try:
            plan = self.begin_save(job_id, end_block)
            if plan.run:
                pos = list(plan.positions)
                keys = self._key_list([block_hashes[i] for i in pos])
                res = self.put(keys, [block_ids[i] for i in pos], before_read)
                saved_to = end_block if full_end_block is None else full_end_block
                self.record_put(job_id, res, len(keys), saved_to * self.block_size)
        except Exception as e:  # reported below all the same; kept for inspection
            self.counters.saves_failed += 1
            self.note_error(f"save job {job_id} ({req_id}): {type(e).__name__}: {e}")
            try:
                self.fail_save(job_id)
            except LedgerError as e2:
                self.note_error(f"fail job {job_id}: {e2}")
        finally:
            try:
                self.report_save(job_id)
            except LedgerError as e:
                self.note_error(f"report job {job_id}: {e}")

    def _key_list(self, hashes: Sequence[Any]) -> list[str]:
        if self.keys is None:
            raise LedgerInputError("keys", None, "a KeyBuilder is needed to turn block hashes into keys")
        return self.keys.keys(hashes)

    # ------------------------------------------------------------------ loads
    def begin_load(self, req_id: str, block_ids: Sequence[int]) -> int:
        with self.lock:
            return self.loads.begin_load(req_id, block_ids)

    def load_batch(self, load_id: int, keys: Sequence[str], block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Load: one batch get of ``keys`` into the blocks ``block_ids`` (one per key), classified by
        :mod:`kvledger.codes`. Returns (block id, code) of each block not loaded (already reported)."""
        if len(keys) != len(block_ids):
            raise LedgerInputError("block_ids", len(block_ids), f"one block per key ({len(keys)} keys)")
        ptrs, sizes = self.buffers(list(block_ids))
        t0 = time.perf_counter()
        res = self.store_call("batch_get", len(keys), list(keys), ptrs, sizes)
        self.stats.add("get_s", time.perf_counter() - t0)
        self.stats.add("gets")
        self.stats.add("get_keys", len(keys))
        with self.lock:
            bad = self.loads.record_results(load_id, block_ids, res, self.key_bytes)
        for _, c in bad:
            self.stats.fail_code(c if c < 0 else int(StoreCode.INVALID_PARAMS))
        self.stats.add("get_bytes", self.key_bytes * (len(keys) - len(bad)))
        return bad

    def pending(self, load_id: int) -> list[int]:
        with self.lock:
            return self.loads.pending(load_id)

    def finish_load(self, load_id: int, reason: str) -> LoadResult:
        """Errors first, then finished, under one lock: vLLM reads finished before errors in a step, so a
        request is never seen finished without its failed blocks (S8 LoadErrorsReported)."""
        with self.lock:
            self.loads.fail_pending(load_id, reason)
            result = self.loads.finish_load(load_id)
            self.finished_loads.append(result.req_id)
        if result.failed:
            self.counters.load_blocks_failed += len(result.failed)
            self.stats.add("get_failed_keys", len(result.failed))
            self.stats.add("load_errors_reported", len(result.failed))
        return result

    def reject_load(self, req_id: str, block_ids: Sequence[int], reason: str) -> LoadResult:
        """A load that is never tried (a full queue): every block reported failed, vLLM recomputes."""
        return self.finish_load(self.begin_load(req_id, block_ids), reason)

    def run_load(self, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any]) -> LoadResult:
        """One load, as a load thread runs it: the keys in this rank's rotated order (each block id
        travels with its key), oversized keys reported, every sub-batch tried, then finished."""
        load_id = self.begin_load(req_id, block_ids)
        reason = "not attempted"
        try:
            n = len(block_ids)
            if n != len(block_hashes):
                raise LedgerInputError("LoadSpec.block_hashes", len(block_hashes),
                                       f"{n} block ids for {req_id!r}")
            if n:  # nothing to load: still reported finished (upstream divides by zero here)
                # rotated by tp_rank: the ranks start on different keys of the store
                pairs = load_pairs(self._key_list(block_hashes), block_ids, self.tp_rank)
                kb: KeyBuilder = self.keys  # type: ignore[assignment]  (_key_list checked it)
                fits, too_long = kb.split_by_length([k for k, _ in pairs])
                if too_long:
                    self.stats.fail_code(int(StoreCode.KEY_TOO_LONG), len(too_long))
                    with self.lock:
                        self.loads.record_failed(load_id, [pairs[j][1] for j in too_long],
                                                 f"key longer than max_key_bytes={kb.max_key_bytes}")
                pairs = [pairs[j] for j in fits]
                for lo in range(0, len(pairs), self.sub_batch):  # every sub-batch is tried and accounted
                    sub = pairs[lo:lo + self.sub_batch]
                    try:
                        self.load_batch(load_id, [k for k, _ in sub], [b for _, b in sub])
                    except LedgerInputError as e:  # e.g. a block id outside the cache: this sub-batch fails
                        self.note_error(f"load {req_id}: {e}")
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            self.note_error(f"load {req_id}: {reason}")
        return self.finish_load(load_id, reason)

    def take_finished_loads(self) -> set[str]:
        """The req_ids whose load finished since the last call, each once: vLLM's finished_recving is a set,
        so a second finished load of the same req_id waits for the next step (one report per load: the
        scheduler releases one load pin per report, oldest first)."""
        with self.lock:
            done: set[str] = set()
            later: list[str] = []
            for req_id in self.finished_loads:
                if req_id in done:
                    later.append(req_id)
                else:
                    done.add(req_id)
            self.finished_loads = later
        return done

    def take_load_errors(self) -> set[int]:
        with self.lock:
            return self.loads.take_errors()  # HandleLoadErrors


def load_pairs(keys: Sequence[str], block_ids: Sequence[int], tp_rank: int) -> list[tuple[str, int]]:
    """(key, block id) in rank ``tp_rank``'s load order (kvledger.load.load_order): each block id travels
    with its key, so a failure is reported on the block the key was loading into."""
    return [(keys[i], block_ids[i]) for i in load_order(len(keys), tp_rank)]


def no_lock() -> ContextManager[Any]:
    """For a single-threaded caller (the conformance driver)."""
    return contextlib.nullcontext()
