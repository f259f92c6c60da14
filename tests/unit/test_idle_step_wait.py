"""A step with no forward (`KVLedgerConnectorMetadata.idle`, set where vLLM scheduled no token) waits, bounded,
for the rank's next load or save result before it reports: an engine whose every request waits for its load
otherwise spins through empty steps, and its thread holds the GIL each time the load thread hands it back.
A step with a forward never waits, nor an idle one with nothing in flight; the wait is bounded."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from conformance.kvprobes import HASHES
from conformance.probes_specs import worker_side
from kvledger.errors import LedgerInputError
from kvledger_connector.metadata import KVLedgerConnectorMetadata, LoadSpec
from kvledger_connector.worker.side import WorkerSide


class _HeldStore:
    """THIS IS A TEST DOUBLE, only to hold a load in flight on a deterministic schedule: its gets wait until
    released, then find nothing (every block a load error, which still finishes the load)."""

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
    releaser = threading.Timer(0.2, store.release.set)  # the get answers while the step waits
    releaser.start()
    report = ws.take_report()
    releaser.join()
    assert report.finished_recving == {"a"}
    assert report.invalid_block_ids == {1, 2}  # its blocks still reported failed, with it


def test_a_step_with_a_forward_does_not_wait(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, store = held
    _load(ws, 1, idle=False)
    assert store.entered.wait(20.0)
    assert not ws.take_report()  # the get is still held: nothing to report yet, and no wait (60 s bound)
    ws.start_step(KVLedgerConnectorMetadata(step=2, idle=True))
    store.release.set()
    assert ws.take_report().finished_recving == {"a"}


def test_an_idle_step_with_nothing_in_flight_answers_at_once(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, _store = held
    ws.start_step(KVLedgerConnectorMetadata(step=1, idle=True))
    assert not ws.take_report()  # with a 60 s bound, a wait here would hang the test


def test_the_wait_is_bounded(held: tuple[WorkerSide, _HeldStore]) -> None:
    ws, store = held
    ws._idle_wait_s = 0.05
    _load(ws, 1, idle=True)
    assert store.entered.wait(20.0)
    t = time.monotonic()
    assert not ws.take_report()  # the get is still held: the step gives up after its bound
    assert time.monotonic() - t < 20.0
    store.release.set()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_an_idle_flag_that_is_not_a_bool_is_refused_by_name(held: tuple[WorkerSide, _HeldStore], bad: Any) -> None:
    ws, _store = held
    with pytest.raises(LedgerInputError, match="idle"):
        ws.start_step(KVLedgerConnectorMetadata(step=1, idle=bad))


@pytest.mark.parametrize("bad", [-1, 2.0, True, "0.1"])
def test_a_bad_idle_wait_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(LedgerInputError, match="idle_wait_s"):
        worker_side(_HeldStore(), idle_wait_s=bad)
