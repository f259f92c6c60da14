"""The worker side's per-job work as synchronous step functions: plan → store calls → outcome into the
ledgers. No threads. Each job's orchestration is ONE resumable function, a generator that stops at the
model's action boundaries: the connector's store and load threads drain it (``run_save``, ``run_load``),
the replay/fuzz driver (conformance/kvdriver.py) advances it one model action at a time. There is no
second copy of this orchestration.

    model action   step                                    ledger calls
    Receive        WorkerSteps.receive_save(spec) -> job   WorkerLedger.register; the job's blocks [0, end)
                                                           from `SentBlocks` (each id crosses once)
    Receive        WorkerSteps.receive(req_id, job, gen)   WorkerLedger.register (a driver's job, without a spec)
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

No store call is made here, no device is waited on and no lock is taken (I/O and threads at the edge):
where an action needs a call, the job's generator yields a `StoreCall` (a batch call) or a `DeviceCall` (the
forward's event; the integrity tags' kernels) and is sent the answer; `Stepped`
(kvledger_connector/worker/effects.py) makes each through the caller's `StoreIO`, or a `JobEdge` that also
holds the caller's lock, released for each call. A store call that raises counts as CLIENT_EXCEPTION for
each of its keys; a device call that raises is thrown in where it was asked for. Any other exception fails
the job, which is still reported (S5) / whose blocks are still reported failed (S8). So does abandoning a
generator (``close()``, or its collection): see ``save_steps``, ``load_steps``.

How they are driven: the worker side (kvledger_connector/worker/side.py) calls every step under its one lock
and drains the jobs through a `JobEdge` over that lock; a single-threaded driver (conformance/kvdriver.py,
the probes) calls them directly and passes its `StoreIO`. A driver may also call `receive` (Receive without a
spec) and read ``ledger`` and ``loads`` (the ledgers), ``stats`` and ``errors``. The steps are built whole
from the registered KV cache (`RegisteredCache`, kvledger_connector/worker/cache.py); a step's results go
back to vLLM as one `WorkerReport` (`take_report`). The save steps are kvledger_connector/worker/saves.py's,
the load steps kvledger_connector/worker/loads.py's.

Counting: every event is counted once, into ``stats`` (kvledger_connector/telemetry/stats.py), which feeds vLLM's
stats, Prometheus and the whole-run totals.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvledger_connector.metadata import KVLedgerWorkerMetadata
from kvledger_connector.worker.loads import LoadSteps
from kvledger_connector.worker.saves import SaveSteps


@dataclass(frozen=True)
class WorkerReport:
    """What one rank hands back to the scheduler, taken at once (`WorkerSteps.take_report`): vLLM reads it
    through get_transfer_results, get_block_ids_with_load_errors and build_connector_worker_meta. A load's
    failed blocks are in the same report as its finish, never a later one (S8)."""
    finished_sending: frozenset[str] = frozenset()  # held requests released: vLLM frees their blocks
    finished_recving: frozenset[str] = frozenset()  # async loads finished, each req_id once
    # of those, the ones whose load failed a block (several KV cache groups: vLLM is told per request)
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()  # blocks not loaded (one full-attention group)
    worker_meta: KVLedgerWorkerMetadata | None = None  # jobs reported, sync loads finished

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving
                    or self.invalid_block_ids or self.worker_meta)


class WorkerSteps(SaveSteps, LoadSteps):
    """One rank's step functions over its ledgers, built whole from the registered KV cache
    (`RegisteredCache`). They make no store call, wait on no device and take no lock: a job's generator
    yields each call and is sent its answer (kvledger_connector/worker/effects.py); ``io`` arguments are the
    caller's `StoreIO`, or a `JobEdge` over it and the caller's lock."""

    def has_pending_work(self) -> bool:
        """A job not yet reported, or a load not finished or not yet taken by a step."""
        return (self.ledger.has_pending_work() or bool(self.finished_loads)
                or bool(self.finished_sync_loads) or self.loads.num_inflight_loads > 0)

    def busy(self) -> bool:
        """A job not yet reported or a load not yet finished (results waiting to be taken do not count)."""
        return self.ledger.num_live_jobs > 0 or self.loads.num_inflight_loads > 0

    def take_report(self, released: Iterable[str] = ()) -> WorkerReport:
        """Collect and HandleLoadErrors of one step, as one value: the async loads finished (`take_finished_loads`)
        with their failures, by block where the kinds allow it (`GroupKinds.fails_by_block`: `take_load_errors`)
        else by request (`take_failed_loads`); the jobs reported (`take_reports`) and the sync loads finished
        (`take_finished_sync_loads`); ``released``: the held requests the side's notices released."""
        finished = self.take_finished_loads()
        errors: set[int] = set()
        failed: set[str] = set()
        if self.kinds.fails_by_block:
            errors = self.take_load_errors()
        else:
            failed = self.take_failed_loads(finished)
        done, loads = self.take_reports(), self.take_finished_sync_loads()
        return WorkerReport(frozenset(released), frozenset(finished), frozenset(failed), frozenset(errors),
                            KVLedgerWorkerMetadata(done, loads) if done or loads else None)
