"""Graph-oracle fuzzing on the tiny spec (real kvledger on vLLM's BlockPool): every move is an edge
of TLC's graph from the current state, or is refused by the system where the graph has none.
Derandomized under the ci profile. A mutant that accepts a second report from the same rank is
found: the model has no such edge, and the system did not refuse."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from conformance.engine import export as ex
from conformance.engine.fuzz import OracleError, oracle_machine
from kvledger.worker import WorkerLedger
from tiny_driver import TinyPinDriver

TINY = Path(__file__).parent / "tiny"
_EXPORT: ex.Export | None = None


def tiny_export() -> ex.Export:
    global _EXPORT
    if _EXPORT is None:
        graph, _ = ex.dump_graph(TINY, "TinyPin", "MC_tiny.cfg")
        _EXPORT = ex.Export("TinyPin", "MC_tiny.cfg", graph, [])
    return _EXPORT


def test_fuzz_tiny_oracle() -> None:
    machine = oracle_machine(tiny_export(), TinyPinDriver)
    assert len(machine.universe) == 1 + 2 * 3 + 3  # EmitStore, Report(w, j), Collect(j)
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
    machine.TestCase().runTest()


def test_fuzz_tiny_finds_double_report_mutant(monkeypatch) -> None:
    orig = WorkerLedger.begin

    def lenient(self, job_id):  # MUTANT: a reported job may run (and report) again
        if job_id not in self._jobs and job_id in self._reported:
            from kvledger.worker import _Job
            req = next(iter(self._requests.values()), None) or __import__(
                "kvledger.worker", fromlist=["StoreRequestState"]).StoreRequestState("r1", 99)
            job = _Job(job_id, req)
            job.state = "queued"
            self._jobs[job_id] = job
            del self._reported[job_id]
        return orig(self, job_id)

    monkeypatch.setattr(WorkerLedger, "begin", lenient)
    machine = oracle_machine(tiny_export(), TinyPinDriver)
    machine.TestCase.settings = settings(max_examples=200, stateful_step_count=30)
    with pytest.raises(OracleError, match="no edge in TLC.s graph|refusing Report"):
        machine.TestCase().runTest()
