"""Worker side of the connector (one per tensor-parallel rank): the store thread and the load thread(s).

    model runner thread                          store thread                   load thread(s)
    ───────────────────                          ────────────                   ──────────────
    start_load_kv / wait_for_save:
      DropGeneration(preempted, finished)
      EmitLoad  → load queue (bounded) ───────────────────────────────────────▶ Load: batch_get per
      Receive: register(job) then enqueue ──▶ store queue (bounded)             sub-batch; every block not
                (CUDA: one event per step)     DmaRead: begin → RUN|STALE|SKIP   loaded is reported (S8)
                                               Put: exist? → put missing keys
                                               Report: finish(job) in `finally`
    get_finished            ◀── finished loads
    get_block_ids_with_load_errors ◀── failed blocks (get-and-clear, under the lock)
    build_connector_worker_meta ◀── WorkerLedger.take_completed()

One lock guards the WorkerLedger and the load results; store I/O runs outside it. A full queue never
blocks the forward: a store job that does not fit is reported at once (its pins are released, the save is
a future cache miss); a load that does not fit is reported failed for every block (vLLM recomputes).
Keys are rotated by `tp_rank` on the load path (ranks start on different keys); failures are recorded by
block id, carried along the rotation, so the mapping back is exact.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.keys import KeyBuilder
from kvledger_connector.kvlayout import BlockCopyPlan, KVLayoutError
from kvledger_connector.metadata import KVLedgerConnectorMetadata, KVLedgerWorkerMetadata, LoadSpec, SaveSpec
from kvledger_connector.stats import StatsRecorder
from kvledger_connector.store import KVStore, StoreCode
from kvledger.errors import LedgerError, LedgerInputError
from kvledger.load import LoadLedger, rotation
from kvledger.trace import TraceSink
from kvledger.worker import Verdict, WorkerLedger

logger = logging.getLogger(__name__)

_STOP = object()
MAX_ERRORS_KEPT = 64  # handler errors remembered for inspection (bounded)


class WorkerSide:
    def __init__(self, *, store: KVStore, keys: KeyBuilder, tp_rank: int, block_size: int,
                 config: StoreConfig, max_requests: int, num_load_threads: int = 1,
                 stats: StatsRecorder | None = None, trace: TraceSink | None = None) -> None:
        if num_load_threads < 1:
            raise LedgerInputError("load_threads", num_load_threads, "must be >= 1")
        self.store = store
        self.keys = keys
        self.tp_rank = tp_rank
        self.block_size = block_size
        self.config = config
        self.stats = stats or StatsRecorder()
        self.ledger = WorkerLedger(tp_rank, max_live_jobs=config.max_inflight_jobs,
                                   max_requests=max_requests, trace=trace)
        self._lock = threading.Lock()
        self._store_q: queue.Queue[Any] = queue.Queue(maxsize=config.store_queue_size)
        self._load_q: queue.Queue[Any] = queue.Queue(maxsize=config.load_queue_size)
        self._finished_loads: set[str] = set()
        # loads in flight: queued + one per load thread (+1: a rejected load is begun and finished at once)
        self.loads = LoadLedger(tp_rank, max_inflight_loads=config.load_queue_size + num_load_threads + 1,
                                trace=trace)
        self._num_load_threads = num_load_threads
        self._threads: list[threading.Thread] = []
        self._plan: BlockCopyPlan | None = None
        self._key_bytes = 0
        self._num_blocks = 0
        self._cuda = False
        self._last_meta_step = -1
        self._closed = False
        self.errors: list[str] = []  # handler errors (bounded); tests assert it stays empty
        # whole-run counters
        self.num_saves_run = 0
        self.num_saves_stale = 0
        self.num_saves_skipped = 0
        self.num_saves_failed = 0
        self.num_saves_rejected = 0
        self.num_loads = 0
        self.num_load_blocks_failed = 0
        self.num_store_exceptions = 0

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, plan: BlockCopyPlan) -> None:
        """The copy plan of vLLM's KV cache views (kvledger_connector/kvlayout.py): a key's object is the plan's
        segments of one block. Each backing allocation is registered with the store once."""
        if self._plan is not None:
            raise KVLayoutError("register_kv_caches called twice on one worker")
        for ptr, nbytes in plan.storages:
            self.store.register_buffer(ptr, nbytes)
        self._plan = plan
        self._key_bytes = plan.block_bytes
        self._num_blocks = plan.num_blocks
        self._cuda = plan.is_cuda
        self._start_threads()

    def _start_threads(self) -> None:
        if self._threads:
            return
        t = threading.Thread(target=self._store_loop, name=f"kvledger-store-r{self.tp_rank}", daemon=True)
        self._threads.append(t)
        for i in range(self._num_load_threads):
            self._threads.append(threading.Thread(target=self._load_loop, daemon=True,
                                                  name=f"kvledger-load{i}-r{self.tp_rank}"))
        for t in self._threads:
            t.start()

    def _block_buffers(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(ptrs, sizes) per block, for one store batch call; block 0 is vLLM's null block."""
        for b in block_ids:
            if self._plan is None or not 0 < b < self._num_blocks:
                raise LedgerInputError("block_id", b, f"not in 1..{self._num_blocks - 1} (or no KV cache "
                                       f"registered)")
        return self._plan.batch_buffers(block_ids)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ per step (model runner thread)
    def start_step(self, meta: KVLedgerConnectorMetadata) -> None:
        """Drops first (a req_id preempted and re-admitted in one step must not keep its old generation),
        then this step's loads."""
        if meta.step == self._last_meta_step:
            return
        self._last_meta_step = meta.step
        with self._lock:
            gens = meta.drop_generations
            for req_id in meta.preempted_req_ids:
                self.ledger.drop_generation(req_id, finished=False, generation=gens.get(req_id))
            for req_id in meta.finished_req_ids:
                self.ledger.drop_generation(req_id, finished=True, generation=gens.get(req_id))
        for spec in meta.loads:
            self._enqueue_load(spec)

    def end_step(self, meta: KVLedgerConnectorMetadata) -> None:
        """After the forward: register every store job (Receive), then enqueue it with this step's event."""
        self.start_step(meta)
        if not meta.saves:
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()  # the store thread waits on it: the forward's writes land before the read
        for spec in meta.saves:
            with self._lock:
                self.ledger.register(spec.req_id, spec.store_job_id, spec.generation)
            try:
                self._store_q.put_nowait((spec, event))
            except queue.Full:  # bounded: report now, the save becomes a future cache miss
                self.num_saves_rejected += 1
                self.stats.add("rejected_jobs")
                with self._lock:
                    self.ledger.finish(spec.store_job_id)

    def _enqueue_load(self, spec: LoadSpec) -> None:
        self.num_loads += 1
        try:
            self._load_q.put_nowait(spec)
        except queue.Full:  # bounded: every block reported failed, vLLM recomputes them
            self.stats.add("rejected_jobs")
            with self._lock:
                load_id = self.loads.begin_load(spec.req_id, spec.block_ids)
            self._finish_load(load_id, spec.req_id, f"load queue full ({self.config.load_queue_size})")

    def take_finished_loads(self) -> set[str]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return done

    def take_load_errors(self) -> set[int]:
        with self._lock:
            return self.loads.take_errors()  # HandleLoadErrors

    def build_worker_meta(self) -> KVLedgerWorkerMetadata | None:
        with self._lock:
            done = self.ledger.take_completed()
        return KVLedgerWorkerMetadata(done) if done else None

    # ------------------------------------------------------------------ store thread
    def _store_loop(self) -> None:
        while True:
            item = self._store_q.get()
            if item is _STOP:
                return
            spec, event = item
            self._handle_save(spec, event)

    def _handle_save(self, spec: SaveSpec, event: Any) -> None:
        job = spec.store_job_id
        try:
            with self._lock:
                verdict = self.ledger.begin(job)
                offset = self.ledger.saved_offset(job)
            if verdict is Verdict.STALE:
                self.num_saves_stale += 1
                self.stats.add("stale_jobs")
                return
            if verdict is Verdict.SKIP:
                self.num_saves_skipped += 1
                self.stats.add("skipped_jobs")
                return
            self.num_saves_run += 1
            start = min(offset // self.block_size, spec.end_block)
            idx = range(start, spec.end_block)
            keys = self.keys.keys([spec.block_hashes[i] for i in idx])
            if not keys:
                with self._lock:
                    self.ledger.record_saved(job, spec.end_block * self.block_size)
                return
            exist = self._store_call("batch_is_exist", len(keys), keys)
            todo = [j for j, e in enumerate(exist) if e != 1]
            codes: list[int] = []
            if todo:
                if event is not None:
                    event.synchronize()
                ptrs, sizes = self._block_buffers([spec.block_ids[idx[j]] for j in todo])
                t0 = time.perf_counter()
                codes = self._store_call("batch_put", len(todo), [keys[j] for j in todo], ptrs, sizes)
                self.stats.add("put_s", time.perf_counter() - t0)
                self.stats.add("puts")
                self.stats.add("put_keys", len(todo))
                self.stats.add("put_bytes", self._key_bytes * sum(1 for c in codes if c == 0))
            bad = [c for c in codes if c < 0]
            if bad:
                self.num_saves_failed += 1
                self.stats.add("put_failed_keys", len(bad))
                for c in bad:
                    self.stats.fail_code(c)
                with self._lock:
                    self.ledger.record_failed(job, pressure=StoreCode.NO_AVAILABLE_HANDLE in bad)
            else:
                with self._lock:
                    self.ledger.record_saved(job, spec.end_block * self.block_size)
        except Exception as e:  # reported below all the same; kept for inspection
            self.num_saves_failed += 1
            self._note_error(f"save job {job} ({spec.req_id}): {type(e).__name__}: {e}")
        finally:
            try:
                with self._lock:
                    self.ledger.finish(job)  # Report: exactly once, on every exit path
            except LedgerError as e:
                self._note_error(f"report job {job}: {e}")

    def _store_call(self, fn: str, n: int, *args: Any) -> list[int]:
        """A store batch call whose exception becomes CLIENT_EXCEPTION for each of its `n` keys (the store
        wrapper already does this; a wrapped or test store may raise)."""
        try:
            return list(getattr(self.store, fn)(*args))
        except Exception:
            self.num_store_exceptions += 1
            return [int(StoreCode.CLIENT_EXCEPTION)] * n

    def _note_error(self, msg: str) -> None:
        logger.error("kvledger worker r%d: %s", self.tp_rank, msg)
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(msg)

    # ------------------------------------------------------------------ load thread(s)
    def _load_loop(self) -> None:
        while True:
            spec = self._load_q.get()
            if spec is _STOP:
                return
            self._handle_load(spec)

    def _handle_load(self, spec: LoadSpec) -> None:
        """Load: every sub-batch is tried; a block not loaded is reported (LoadLedger: S8 on finish)."""
        with self._lock:
            load_id = self.loads.begin_load(spec.req_id, spec.block_ids)
        reason = "not attempted"
        try:
            n = len(spec.block_ids)
            if n != len(spec.block_hashes):
                raise LedgerInputError("LoadSpec.block_hashes", len(spec.block_hashes),
                                       f"{n} block ids for {spec.req_id!r}")
            if n == 0:
                return  # nothing to load: still reported finished (upstream divides by zero here)
            keys = self.keys.keys(spec.block_hashes)
            rot = rotation(n, self.tp_rank)  # spread ranks over the store; block ids travel with their keys
            order = [(i + rot) % n for i in range(n)]
            fits, too_long = self.keys.split_by_length([keys[i] for i in order])
            if too_long:
                self.stats.fail_code(int(StoreCode.KEY_TOO_LONG), len(too_long))
                with self._lock:
                    self.loads.record_failed(load_id, [spec.block_ids[order[j]] for j in too_long],
                                             f"key longer than max_key_bytes={self.keys.max_key_bytes}")
            order = [order[j] for j in fits]
            step = self.config.load_sub_batch_keys
            for lo in range(0, len(order), step):  # every sub-batch is tried and accounted
                sub = order[lo:lo + step]
                try:
                    ptrs, sizes = self._block_buffers([spec.block_ids[i] for i in sub])
                except LedgerInputError as e:  # a block id outside the cache: this sub-batch fails
                    self._note_error(f"load {spec.req_id}: {e}")
                    continue
                t0 = time.perf_counter()
                res = self._store_call("batch_get", len(sub), [keys[i] for i in sub], ptrs, sizes)
                self.stats.add("get_s", time.perf_counter() - t0)
                self.stats.add("gets")
                self.stats.add("get_keys", len(sub))
                ok = [spec.block_ids[i] for i, r in zip(sub, res) if r == self._key_bytes]
                bad = [(spec.block_ids[i], r) for i, r in zip(sub, res) if r != self._key_bytes]
                for _, r in bad:
                    self.stats.fail_code(r if r < 0 else int(StoreCode.INVALID_PARAMS))
                self.stats.add("get_bytes", self._key_bytes * len(ok))
                with self._lock:
                    self.loads.record_ok(load_id, ok)
                    if bad:
                        self.loads.record_failed(load_id, [b for b, _ in bad],
                                                 f"store codes {sorted({r for _, r in bad})}")
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            self._note_error(f"load {spec.req_id}: {reason}")
        finally:
            self._finish_load(load_id, spec.req_id, reason)

    def _finish_load(self, load_id: int, req_id: str, reason: str) -> None:
        """Errors first, then finished, under one lock: vLLM reads finished before errors in a step, so a
        request is never seen finished without its failed blocks (S8 LoadErrorsReported)."""
        with self._lock:
            failed = self.loads.fail_pending(load_id, reason)
            result = self.loads.finish_load(load_id)
            self._finished_loads.add(req_id)
        if result.failed:
            self.num_load_blocks_failed += len(result.failed)
            self.stats.add("get_failed_keys", len(result.failed))
            self.stats.add("load_errors_reported", len(result.failed))
        del failed

    # ------------------------------------------------------------------ shutdown
    def has_pending_work(self) -> bool:
        with self._lock:
            return (self.ledger.has_pending_work() or bool(self._finished_loads)
                    or self.loads.num_inflight_loads > 0
                    or not self._store_q.empty() or not self._load_q.empty())

    def busy(self) -> bool:
        """A thread has work queued or running (a save not yet reported, a load not yet finished). Unlike
        `has_pending_work` it ignores results waiting to be taken by the next step (benchmarks wait on it)."""
        with self._lock:
            return (self.ledger.num_live_jobs > 0 or self.loads.num_inflight_loads > 0
                    or not self._store_q.empty() or not self._load_q.empty())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let the threads finish what is queued (every job still gets reported), then stop them."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for q, n in ((self._store_q, 1), (self._load_q, self._num_load_threads)):
            for _ in range(n):
                try:
                    q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
                except queue.Full:
                    pass
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            self._note_error(f"threads still running at shutdown: {alive}")
