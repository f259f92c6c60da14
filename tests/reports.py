"""A test's reading of a `WorkerSide`'s reports: vLLM takes one `WorkerReport` a step; a test polls for one
outcome across several, so it reads their union."""
from __future__ import annotations

import time
from typing import Any, Callable

from kvledger_connector.metadata import KVLedgerWorkerMetadata
from kvledger_connector.worker.steps import WorkerReport


def merged(a: WorkerReport, b: WorkerReport) -> WorkerReport:
    meta = a.worker_meta
    if b.worker_meta is not None:
        meta = (KVLedgerWorkerMetadata(dict(meta.completed_saves), dict(meta.completed_loads)) if meta is not None
                else KVLedgerWorkerMetadata({}, {})).aggregate(b.worker_meta)
    return WorkerReport(a.finished_sending | b.finished_sending, a.finished_recving | b.finished_recving,
                        a.failed_recving | b.failed_recving, a.invalid_block_ids | b.invalid_block_ids, meta)


def report_until(ws: Any, done: Callable[[WorkerReport], bool], timeout: float = 20.0) -> WorkerReport:
    """``ws``'s reports, merged, taken until ``done`` holds of them (TimeoutError past ``timeout``)."""
    got = WorkerReport()
    deadline = time.monotonic() + timeout
    while True:
        got = merged(got, ws.take_report())
        if done(got):
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reported within {timeout} s: {got}")
        time.sleep(0.005)
