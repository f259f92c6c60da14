"""kvledger: the job-lifecycle ledger for asynchronous KV-cache saves and loads (pure core).

Theory of operation
===================

No threads, no I/O, no vLLM import. The connector (``kvledger_connector/``) does the I/O and calls these ledgers
under its own locks; every state change is checked against the lifecycle machines of
``spec/machines.json`` (StoreJob, StoreRequest: :mod:`kvledger.machines`) and against the invariants of
spec/README.md, which raise :class:`LedgerInvariantError` (never ``assert``: the checks survive ``python -O``).

Who calls what, per engine step (one scheduler, ranks w = 0..world_size-1)::

  scheduler process                                  worker rank w (one WorkerLedger, one LoadLedger)
  -----------------                                  ------------------------------------------------
  schedule() / build_connector_meta                  start_load_kv (WorkerSide.start_step), drops first:
    DropNotice(req_id, generation) ──────────────────►  WorkerLedger.drop_generation(req_id) DropGeneration
    update_state_after_alloc: SchedulerLedger.pin_load(req_id, block_ids)     EmitLoad: pool.touch(dest)
    SchedulerLedger.open_job(req_id, block_ids)  ──► SaveSpec(store_job_id) ──► wait_for_save (end_step):
      EmitStore: job id, pool.touch(blocks)              WorkerLedger.register(req_id, job)    Receive
      None = DEFER (cap reached): retry next step      store thread:
                                                          WorkerLedger.begin(job) RUN|STALE|SKIP  DmaRead
                                                          ... put ... record_saved / record_failed  Put
                                                          WorkerLedger.finish(job)  (finally)   Report
                                                       load thread(s):
                                                          LoadLedger.begin_load / record_results /
                                                          fail_pending / finish_load            Load
                                                       get_block_ids_with_load_errors:
                                                          LoadLedger.take_errors()      HandleLoadErrors
                                                       build_connector_worker_meta:
                                                          WorkerLedger.take_completed() {job: 1}
  engine: metadata.aggregate over ranks  ◄─────────────────────┘
  update_connector_output
    SchedulerLedger.collect({job: count})   Collect: ranks_left -= count; at 0 free_blocks(reversed)
    SchedulerLedger.collect_loads({req_id: world_size})   CollectLoad (finished_recving: every rank)
  has_pending_push_work(): SchedulerLedger.has_pending_work()

Safety in one sentence per rule: a job's pin owns its blocks until every rank reported it (S2, S3); a
job outside its request's live set is stale and changes nothing (S4) but is reported exactly once (S5);
the scheduler never holds more than the cap (S6); a load never finishes with an attempted block neither
loaded nor reported (S8); a load's pin owns its destination blocks until every rank finished it (S9).

Hot path: the ledgers drive the compiled transition tables (a dict lookup) built from the same data as
the ``transitions`` machines, which are kept as the definition (diagrams, equivalence test); a
``transitions`` trigger costs ~21 µs, more than the scheduler's whole per-job budget.

Tracing: pass ``trace=`` a :class:`~kvledger.trace.TraceSink` (e.g. :class:`~kvledger.trace.NdjsonTrace`)
to get one event per action; the schema is data, ``kvledger.trace.EVENTS`` (``check_event`` validates one).

Counting: pass ``counts=`` a :class:`~kvledger.counts.Counter` (the connector's recorder) to count the
ledgers' events there; without one each ledger counts into its own :class:`~kvledger.counts.Counts`.
"""
from .counts import Counter, Counts
from .errors import INVARIANTS, LedgerError, LedgerInputError, LedgerInvariantError
from .load import LoadLedger, LoadResult, load_batch_keys, load_order, rotation
from .metadata import aggregate, aggregate_all, aggregate_into, check_completed
from .scheduler import NULL_BLOCK_ID, BlockPoolLike, SchedulerLedger
from .trace import ListTrace, NdjsonTrace, TraceSink
from .worker import StoreRequestState, Verdict, WorkerLedger, put_positions

__all__ = [
    "Counter", "Counts",
    "INVARIANTS", "LedgerError", "LedgerInputError", "LedgerInvariantError",
    "LoadLedger", "LoadResult", "load_batch_keys", "load_order", "rotation",
    "aggregate", "aggregate_all", "aggregate_into", "check_completed",
    "NULL_BLOCK_ID", "BlockPoolLike", "SchedulerLedger",
    "ListTrace", "NdjsonTrace", "TraceSink",
    "StoreRequestState", "Verdict", "WorkerLedger", "put_positions",
]
