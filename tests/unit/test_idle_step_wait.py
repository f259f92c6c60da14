"""A step with no forward (`KVLedgerConnectorMetadata.idle`, set where vLLM scheduled no token) waits, bounded,
for the rank's next load or save result before it answers vLLM: an engine with every request waiting for
its load otherwise spins through empty steps whose thread holds the GIL the load thread needs. A step with a
forward never waits, nor an idle one with nothing in flight."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from conformance.kvprobes import HASHES
from conformance.probes_specs import worker_side
from kvledger_connector.metadata import KVLedgerConnectorMetadata, LoadSpec
from kvledger_connector.worker.side import WorkerSide


class _HeldStore:
    """THIS IS A TEST DOUBLE: a store whose gets wait until released, then find nothing (every block a load
    error, which still finishes the load)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        return None

    def batch_get(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> list[int]:
        self.entered.set()
        self.release.wait(30.0)
        return [-704] * len(keys)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [0] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        return 0


@pytest.fixture
def held() -> Iterator[tuple[WorkerSide, _HeldStore]]:
    store = _HeldStore()
    ws, _kv = worker_side(store)
    ws._idle_wait_s = 60.0  # far longer than the load: the wait must end with the load, not its bound
    try:
        yield ws, store
    finally:
        store.release.set()
        ws.shutdown()


def _load(ws: WorkerSide, step: int, *, idle: bool) -> None:
    ws.start_step(KVLedgerConnectorMetadata(step=step, loads=[LoadSpec("a", (1, 2), tuple(HASHES[:2]))],
                                            idle=idle))


def test_an_idle_step_reports_the_load_that_finishes_while_it_waits(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, store = held
    _load(ws, 1, idle=True)
    assert store.entered.wait(20.0)
    releaser = threading.Thread(target=store.release.set)  # the get answers while the step waits
    releaser.start()
    assert ws.take_finished_loads() == {"a"}
    releaser.join()
    assert ws.take_load_errors() == {1, 2}  # its blocks still reported failed, with it


def test_a_step_with_a_forward_does_not_wait(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, store = held
    _load(ws, 1, idle=False)
    assert store.entered.wait(20.0)
    assert ws.take_finished_loads() == set()  # the get is still held: nothing to report yet, no wait
    ws.start_step(KVLedgerConnectorMetadata(step=2, idle=True))
    store.release.set()
    assert ws.take_finished_loads() == {"a"}


def test_an_idle_step_with_nothing_in_flight_answers_at_once(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, _store = held
    ws.start_step(KVLedgerConnectorMetadata(step=1, idle=True))
    assert ws.take_finished_loads() == set()  # with a 60 s bound, a wait here would hang the test
