"""Worker side of the connector (one per tensor-parallel rank): the store thread and the load thread(s).

    model runner thread                          store thread                   load thread(s)
    ───────────────────                          ────────────                   ──────────────
    bind_connector_metadata (start_load_kv) / wait_for_save:
      DropGeneration (the step's drops, in order)
      EmitLoad  → load queue (bounded) ───────────────────────────────────────▶ Load: batch_get per
      (a sync load runs here instead, before the forward: vLLM scheduled its request in this step)
      Receive: register(job), blocks [0, end)                                  sub-batch; every block not
               from SentBlocks, then enqueue ──▶ store queue (bounded)         loaded is reported (S8)
                (CUDA: one event per step)     DmaRead: begin → RUN|STALE|SKIP
                                               Put: exist? → put missing keys
                                               Report: finish(job) in `finally`
    take_report             ◀── one `WorkerReport` (a step with no forward first waits, bounded, for a
                                thread's next result): released held requests, finished loads with their
                                failed blocks (or requests), WorkerLedger.take_completed(), finished sync
                                loads; vLLM reads it through get_transfer_results,
                                get_block_ids_with_load_errors, build_connector_worker_meta

Every spec (DropNotice, LoadSpec, SaveSpec) is checked whole before anything of it runs (`WorkerSteps`'
receive_drop, admit_load, receive_save): a malformed one fails as one unit (every block of a load reported
failed, a save's job reported at once), nothing is read, put or removed for it, and it raises nothing into
the model runner. An object a load finds failing its integrity tag is removed on the store's own threads
(the load thread that found it, or the store thread after a sync load), never on the model runner's.

One lock, this side's, guards the steps (the ledgers, the load results): every step is called under it, and
a job's generator runs under it (`JobEdge`), released for each store call and device wait it yields. A full
queue never blocks the forward: a store job that does not fit is reported at once (its pins are released, the save is
a future cache miss); a load that does not fit is reported failed for every block (vLLM recomputes).
Keys are rotated by `tp_rank` on the load path (ranks start on different keys); failures are recorded by
block id, carried along the rotation, so the mapping back is exact.

Three layers, one owner each: this module owns the threads, the queues, the lock and shutdown; the per-job
work (DmaRead, Put, Report; Load), its counting (`stats`) and the ledgers it drives are
kvledger_connector/worker/steps.py's `WorkerSteps` (`self.steps`, built whole once the KV cache is registered),
whose per-job generators the conformance driver advances one model action at a time; the ledgers are
kvledger/'s. Read them there: `steps.ledger`, `steps.loads`, `steps.stats`, `steps.errors`; the store,
through the one wrapper its calls go through: `io.store`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvledger_connector.shape.block_shape import BlockShape, PartBuffers
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.shape.integrity import BlockSeal, IntegrityKey
from kvledger_connector.worker.cache import RegisteredCache
from kvledger_connector.worker.effects import JobEdge
from kvledger_connector.worker.saves import SaveJob
from kvledger_connector.worker.steps import WorkerReport, WorkerSteps
from kvledger_connector.shape.keys import RESET_EPOCH_HEX, KeyBuilder, is_reset_epoch
from kvledger_connector.shape.kvlayout import BlockCopyPlan, KVLayoutError
from kvledger_connector.metadata import KVLedgerConnectorMetadata, LoadSpec
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger.load import load_batch_keys
from kvledger_connector.store.contract import KVStore
from kvledger_connector.store.io import StoreIO
from kvledger.errors import LedgerInputError
from kvledger.load import LoadLedger
from kvledger.trace import TraceSink
from kvledger.worker import WorkerLedger

logger = logging.getLogger(__name__)

_STOP = object()
_REMOVE = object()  # wakes the store thread for `_remove_mismatched` alone

# longest wait of a step with no forward for this rank's next load or save result (`take_report`): a
# request arriving meanwhile waits at most this long to be scheduled. The interpreter's switch interval: a
# model runner thread spinning through empty steps holds the GIL for that long each time a load or store
# thread hands it back (after a store call, a hash update), so a shorter wait would buy nothing
IDLE_WAIT_S = 0.005


class WorkerSide:
    def __init__(self, connector_config: ConnectorConfig, *, store: KVStore, shape: BlockShape, tp_rank: int,
                 max_requests: int, stats: StatsRecorder | None = None, trace: TraceSink | None = None,
                 integrity: IntegrityKey | None = None, weights_version: str = "",
                 rekey: Callable[[str, str], Sequence[KeyBuilder]] | None = None, readers: int = 1,
                 idle_wait_s: float = IDLE_WAIT_S) -> None:
        """``shape``: this rank's block (`EngineFacts.block_shape`): its parts in order, per KV cache group and,
        in the TP-shared layout, per head shard, each with its key builder. ``integrity``: how stored objects
        are tagged (kvledger_connector/shape/integrity.py); None: no trailer. ``weights_version``: the one
        ``shape``'s builders build under; ``rekey``: the parts' key builders under another version and reset
        epoch, for when a step's metadata names them (a reset_cache switched it, see kvledger_connector/scheduler/reset.py).
        ``readers``: the engine's ranks, which may read one store client's disk tier at once (`load_batch_keys`).
        ``idle_wait_s``: how long a step with no forward waits for a load or save result (`take_report`)."""
        if not isinstance(connector_config, ConnectorConfig):
            raise LedgerInputError("connector_config", type(connector_config).__name__, "must be a ConnectorConfig")
        config = connector_config.store
        if not isinstance(readers, int) or readers < 1:
            raise LedgerInputError("readers", readers, "must be an int >= 1")
        self._readers = readers
        if isinstance(idle_wait_s, bool) or not isinstance(idle_wait_s, (int, float)) or not 0 <= idle_wait_s <= 1:
            raise LedgerInputError("idle_wait_s", idle_wait_s, "must be a number of seconds in [0, 1]")
        self._idle_wait_s = float(idle_wait_s)
        self._idle = False  # this step has no forward (`KVLedgerConnectorMetadata.idle`), until its report
        # notified by a load or store thread when a load finishes or a job is reported; an idle step's report
        # waits on it. Never taken while holding ``_lock``
        self._results = threading.Condition()
        self._num_results = 0  # results the threads produced since the last report was taken
        num_load_threads = connector_config.load_threads
        self.tp_rank = tp_rank
        self.connector_config = connector_config
        self.weights_version = weights_version
        self.reset_epoch = ""  # no reset yet: the keys every engine of this model and version builds
        self._rekey = rekey
        self.integrity = integrity if integrity is not None and integrity.enabled else None
        self._lock = threading.Lock()
        self._store_q: queue.Queue[Any] = queue.Queue(maxsize=config.store_queue_size)
        self._load_q: queue.Queue[Any] = queue.Queue(maxsize=config.load_queue_size)
        self._num_load_threads = num_load_threads
        self._threads: list[threading.Thread] = []
        self._plans: list[BlockCopyPlan] = []  # one per part of a block
        self._last_meta_step = -1
        # held requests released by this step's notices (model-runner thread only): finished_sending
        self._released: set[str] = set()
        self._closed = False  # shutdown begun (guarded by _shutdown_lock)
        self._shutdown_lock = threading.Lock()
        self._shutdown_done = threading.Event()
        self._shutdown_clean = False  # every thread exited in the first shutdown
        self.num_threads_left_running = 0  # threads still alive when shutdown gave up on them
        self.stats = stats if stats is not None else StatsRecorder()  # one sink: the steps', the ledgers', the io's
        # the one wrapper every store call of this rank's threads goes through (kvledger_connector/store/io.py),
        # and the edge the jobs are drained through: their own code under the lock, every call outside it
        self.io = StoreIO(store, self.stats)
        self._edge = JobEdge(self.io, self._lock)
        # the ledgers the steps drive; loads in flight: queued + one per load thread (+1: a rejected load is
        # begun and finished at once)
        self._shape = shape
        self._ledger = WorkerLedger(tp_rank, max_live_jobs=connector_config.max_inflight_jobs,
                                    max_requests=max_requests, trace=trace)
        self._loads = LoadLedger(tp_rank, max_inflight_loads=config.load_queue_size + num_load_threads + 1,
                                 trace=trace, counts=self.stats)
        # the per-job work, its counting and the ledgers (kvledger_connector/worker/steps.py): built whole
        # once vLLM registers the KV cache
        self.steps: WorkerSteps | None = None

    def _registered(self) -> WorkerSteps:
        if self.steps is None:
            raise KVLayoutError("no KV cache registered on this worker yet (register_kv_caches comes first)")
        return self.steps

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, plan: BlockCopyPlan | Sequence[BlockCopyPlan],
                           kv_caches: Mapping[str, torch.Tensor] | None = None) -> None:
        """The copy plan of vLLM's KV cache views (kvledger_connector/shape/kvlayout.py), or one per part of
        a block (a hybrid model's KV cache groups, whose views share their allocations, a block id being owned
        by one group at a time; the TP-shared layout's head shards): a key's object is the plan's segments of
        one block, then its integrity trailer (read from ``kv_caches``, the views the plan was made of). Each
        backing allocation, and the trailer slots, is registered with the store once."""
        if self._plans:
            raise KVLayoutError("register_kv_caches called twice on one worker")
        plans = [plan] if isinstance(plan, BlockCopyPlan) else list(plan)
        num_parts = len(self._shape.parts)
        if len(plans) != num_parts:
            raise KVLayoutError(f"{len(plans)} copy plans for {num_parts} parts of a block")
        if len({(p.block_bytes, p.num_blocks) for p in plans}) != 1:
            raise KVLayoutError("parts of a block (KV cache groups, head shards) that differ in size ("
                                + ", ".join(f"{p.block_bytes} B x {p.num_blocks}" for p in plans)
                                + "): every group's block must have the same bytes (equal layer counts)")
        plan = plans[0]
        seal = None
        if self.integrity is not None:
            if kv_caches is None:
                raise KVLayoutError(f"integrity {self.integrity.mode!r} needs the KV cache views")
            # a put or a get at once per thread that stores: the store thread, the load threads, a sync load
            seal = BlockSeal(self.integrity, plans, kv_caches, slots=self._num_load_threads + 2,
                             max_keys=plan.num_blocks)
        for ptr, nbytes in sorted({s for p in plans for s in p.storages}):  # groups share allocations
            self.io.store.register_buffer(ptr, nbytes)
        if seal is not None:
            for ptr, nbytes in seal.regions:
                self.io.store.register_buffer(ptr, nbytes)
        self._plans = plans
        key_bytes = plan.block_bytes + (seal.trailer_bytes if seal is not None else 0)
        store_config = self.connector_config.store
        sub_batch = load_batch_keys(store_config.load_sub_batch_keys, key_bytes, self._readers,
                                    store_config.disk_offload_staging_size if store_config.disk_offload else None)
        if sub_batch < store_config.load_sub_batch_keys:
            logger.info("kvledger: %d keys per batch get (load_sub_batch_keys %d): %d ranks' reads of %d-byte "
                        "keys from the disk tier must fit disk_offload_staging_size %d", sub_batch,
                        store_config.load_sub_batch_keys, self._readers, key_bytes,
                        store_config.disk_offload_staging_size)
        cache = RegisteredCache(PartBuffers(plans), plan.num_blocks, key_bytes=key_bytes, seal=seal,
                                sub_batch=sub_batch, is_cuda=plan.is_cuda)
        self.steps = WorkerSteps(self.connector_config, cache, ledger=self._ledger, loads=self._loads,
                                 tp_rank=self.tp_rank, shape=self._shape, stats=self.stats)
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

    # ------------------------------------------------------------------ per step (model runner thread)
    def start_step(self, meta: KVLedgerConnectorMetadata) -> None:
        """Drops first (a req_id preempted and re-admitted in one step must not keep its old generation),
        then this step's loads: the async ones queued for the load threads, then the sync ones run here,
        before the forward reads them (the connector calls this when vLLM binds the step's metadata, before
        the forward; the store's batch get returns once the bytes landed). Once per step: a second call
        (start_load_kv, wait_for_save) returns at once."""
        if meta.step == self._last_meta_step:
            return
        steps = self._registered()
        self._last_meta_step = meta.step
        if meta.idle.__class__ is not bool:
            raise LedgerInputError("idle", meta.idle, "must be a bool")
        self._idle = meta.idle
        if meta.weights_version != self.weights_version or meta.reset_epoch != self.reset_epoch:
            self._switch_keys(meta.weights_version, meta.reset_epoch)
        with self._lock:
            for nt in meta.drops:  # each checked whole (`WorkerSteps.receive_drop`)
                if steps.receive_drop(nt):  # a held request: its save is stored, vLLM may free its blocks
                    self._released.add(nt.req_id)
        sync: list[LoadSpec] = []
        for spec in meta.loads:
            # checked whole first: a malformed or refused spec has every block reported failed, nothing read
            with self._lock:
                admitted = steps.admit_load(spec)
            if not admitted:
                continue
            if spec.sync:
                sync.append(spec)
            else:
                self._enqueue_load(spec)
        for spec in sync:
            self._run_sync_load(spec)
        if sync:
            with self._lock:
                tampered = bool(steps.removals)
            if tampered:  # objects a sync load found tampered: the store thread removes them
                self._offer(self._store_q, _REMOVE)  # a full queue: the store thread removes them before its next job

    def _switch_keys(self, version: str, reset_epoch: str) -> None:
        """This step's jobs and loads are keyed under `version` and `reset_epoch`. The scheduler switches only
        at a reset that found no store job or load in flight (every rank reported them all), so no thread of
        this rank holds a job keyed under the old ones: the switch is one reference swap the threads pick up
        per job."""
        if self._rekey is None:
            raise LedgerInputError("weights_version", version, f"this worker builds keys under "
                                   f"{self.weights_version!r} only (no rekey given)")
        if not is_reset_epoch(reset_epoch):
            raise LedgerInputError("reset_epoch", reset_epoch, f"must be '' or {RESET_EPOCH_HEX} lowercase hex "
                                   "characters")
        steps = self._registered()
        steps.shape = steps.block_shape().rekeyed(self._rekey(version, reset_epoch))
        if version != self.weights_version:
            steps.stats.add("weights_version_switches")
        self.weights_version, self.reset_epoch = version, reset_epoch

    def _run_sync_load(self, spec: LoadSpec) -> None:
        steps = self._registered()
        if self._closed:  # shut down: every block reported failed (vLLM recomputes), as a refused async one
            with self._lock:
                steps.reject_load(spec.req_id, spec.block_ids, "worker shut down", sync=True)
            return
        try:  # run_load reports every block not loaded; an error past that must not fail the step
            steps.run_load(self._edge, spec.req_id, spec.block_ids, spec.block_hashes, sync=True,
                           groups=spec.groups)
        except Exception as e:
            self._note_error(f"sync load {spec.req_id}: {type(e).__name__}: {e}")

    def end_step(self, meta: KVLedgerConnectorMetadata) -> None:
        """After the forward: register every store job (Receive), then enqueue it with this step's event."""
        self.start_step(meta)
        if not meta.saves:
            return
        steps = self._registered()
        event = None
        if steps.cache.is_cuda:
            event = torch.cuda.Event()
            event.record()  # the store thread waits on it: the forward's writes land before the read
        for spec in meta.saves:
            with self._lock:
                job = steps.receive_save(spec)  # None: refused, and already reported
            if job is not None and self._offer(self._store_q, (job, event)) is not None:  # bounded, or shut down
                with self._lock:
                    steps.reject_save(job.job_id)

    def _enqueue_load(self, spec: LoadSpec) -> None:
        why = self._offer(self._load_q, spec)
        if why is not None:  # bounded, or shut down: every block reported failed, vLLM recomputes them
            with self._lock:
                self._registered().reject_load(spec.req_id, spec.block_ids, why)

    def _offer(self, q: queue.Queue[Any], item: Any) -> str | None:
        """Queue `item` for a thread, or say why not. Under the shutdown lock: a job is either queued
        before the threads' _STOP (so it runs and is reported) or refused here (the caller reports it);
        none is left in a queue nobody drains."""
        with self._shutdown_lock:
            if self._closed:
                return "worker shut down"
            try:
                q.put_nowait(item)
            except queue.Full:
                return f"queue full ({q.maxsize})"
        return None

    def take_report(self) -> WorkerReport:
        """Everything this rank reports since the last call, as one value (`WorkerSteps.take_report`): the
        held requests this side's notices released (finished_sending), finished loads with their failures,
        the jobs reported and the sync loads finished."""
        if self._idle:
            self._idle = False
            self._wait_for_result()
        with self._results:
            self._num_results = 0
        released, self._released = self._released, set()
        with self._lock:
            return self._registered().take_report(released)

    def _wait_for_result(self) -> None:
        """A step with no forward: blocks, the GIL released, until a thread finishes a load or reports a job,
        at most ``idle_wait_s``; at once when one is waiting or none is in flight. Handed back at once, vLLM
        steps again straight away: its thread, spinning through empty steps, would hold the GIL each time the
        load threads hand it back, and every request waits on them."""
        if not self.busy():
            return
        with self._results:
            self._results.wait_for(lambda: self._num_results > 0, self._idle_wait_s)

    def _result(self) -> None:
        """A load finished or a job was reported: wakes an idle step's wait."""
        with self._results:
            self._num_results += 1
            self._results.notify_all()

    def _note_error(self, msg: str) -> None:
        with self._lock:
            self._registered().note_error(msg)

    # ------------------------------------------------------------------ store thread
    def _store_loop(self) -> None:
        while True:
            item = self._store_q.get()
            try:  # first: a save after a tampered object's load must find it gone, never skip it as stored
                self._remove_mismatched()
            except Exception as e:
                self._note_error(f"store thread: removals: {type(e).__name__}: {e}")
            if item is _STOP:
                return
            if item is _REMOVE:
                continue
            job, event = item
            try:  # the thread must outlive a handler bug: it still has to take _STOP at shutdown
                self._handle_save(job, event)
            except Exception as e:
                self._note_error(f"store thread: save job {job.job_id}: {type(e).__name__}: {e}")
            self._result()

    def _handle_save(self, job: SaveJob, event: Any) -> None:
        """DmaRead, Put, Report of one job (`WorkerSteps.save_steps`, drained); the put waits for the
        forward's CUDA event before it reads the blocks (a `DeviceCall`, made here outside the lock)."""
        self._registered().run_save(self._edge, job.req_id, job.job_id, job.end_block, job.block_ids,
                                    job.block_hashes, event, job.full_end_block)

    # ------------------------------------------------------------------ load thread(s)
    def _load_loop(self) -> None:
        while True:
            spec = self._load_q.get()
            if spec is _STOP:
                return
            try:  # the thread must outlive a handler bug: it still has to take _STOP at shutdown
                self._handle_load(spec)
                self._remove_mismatched()  # objects this load found tampered, on this store thread
            except Exception as e:
                self._note_error(f"load thread: load {spec.req_id}: {type(e).__name__}: {e}")
            self._result()

    def _handle_load(self, spec: LoadSpec) -> None:
        """Load: every sub-batch is tried; a block not loaded is reported (`WorkerSteps.load_steps`)."""
        self._registered().run_load(self._edge, spec.req_id, spec.block_ids, spec.block_hashes, groups=spec.groups)

    def _remove_mismatched(self) -> None:
        """Removes the objects loads found failing their tag (`WorkerSteps.take_removals`), on this store
        thread. Best effort: the load error stood already."""
        with self._lock:
            keys = self._registered().take_removals()
        for err in self.io.remove(keys):
            self._note_error(f"{err} (after an integrity mismatch)")

    # ------------------------------------------------------------------ shutdown
    def has_pending_work(self) -> bool:
        with self._lock:
            steps = self.steps is not None and self.steps.has_pending_work()
        return steps or not self._store_q.empty() or not self._load_q.empty()

    def busy(self) -> bool:
        """A thread has work queued or running (a save not yet reported, a load not yet finished). Unlike
        `has_pending_work` it ignores results waiting to be taken by the next step (benchmarks wait on it)."""
        with self._lock:
            steps = self.steps is not None and self.steps.busy()
        return steps or not self._store_q.empty() or not self._load_q.empty()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Let the threads finish what is queued (every job still gets reported), then stop them. Returns
        True when every thread exited.

        Idempotent and safe from several threads: the first caller does the work; a concurrent caller waits
        for it (up to its own `timeout`) and returns its result (False if it is not done by then). Bounded by
        `timeout`: a thread still inside a store call then (a hung master, a wedged transfer) is left running
        as a daemon, logged and counted in `num_threads_left_running`. The store is not closed here: its
        owner closes it afterwards, and `MooncakeStore.close` never closes the client under a call such a
        thread may still be making (that crashes the process)."""
        with self._shutdown_lock:
            first, self._closed = not self._closed, True
        self.io.stop()  # a put waiting for room gives up now: the queued jobs run and are reported
        if not first:
            return self._shutdown_done.wait(timeout) and self._shutdown_clean
        try:
            self._shutdown_clean = self._stop_threads(time.monotonic() + timeout)
        finally:
            self._shutdown_done.set()
        return self._shutdown_clean

    def _stop_threads(self, deadline: float) -> bool:
        # _STOP queues behind the jobs already queued (FIFO): they run and are reported first
        threads = [t for t in self._threads if t is not threading.current_thread()]
        if not threads:
            return True
        late: list[queue.Queue[Any]] = []  # a _STOP that did not fit in time (the queue was full)
        for q, n in ((self._store_q, 1), (self._load_q, self._num_load_threads)):
            for _ in range(n):
                try:
                    q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
                except queue.Full:
                    late.append(q)
        if late:  # delivered once the threads drain their queue, so they still end (a daemon, never joined)
            threading.Thread(target=lambda: [q.put(_STOP) for q in late], daemon=True,
                             name=f"kvledger-stop-r{self.tp_rank}").start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            self.num_threads_left_running = len(alive)
            self._note_error(f"threads still running at shutdown, left as daemons: {alive} (store calls "
                             f"inside the client: {self.io.store.calls_inside})")
        return not alive
