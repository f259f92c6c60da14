"""A dead, hung or restarted master: every call answers with codes, nothing hangs or raises, and the
client recovers after a restart (with every key lost, as Mooncake keeps its index in memory only).

These tests own a private EmbeddedMooncake (they kill its master); the session's shared one is untouched.
The time bounds below are hang guards (a call must return at all), not performance assertions.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.store.contract import MASTER_DOWN_CODES, StoreCode
from kvledger_connector.store.client import MooncakeStore
from testbed.procs import wait_until

RPC_TIMEOUT_MS = 1000
BACKOFF_MS = 5000  # long enough that the calls right after a failure fall inside it
HANG_GUARD_S = 30.0  # a dead master costs ~4.3 s per call in Mooncake; a hang would be forever


@pytest.fixture
def private() -> Iterator[tuple[EmbeddedMooncake, MooncakeStore]]:
    mc = EmbeddedMooncake(rpc_timeout_ms=RPC_TIMEOUT_MS)
    store = None
    try:
        cfg = StoreConfig(global_segment_size=32 << 20, rpc_timeout_ms=RPC_TIMEOUT_MS, unhealthy_backoff_ms=BACKOFF_MS)
        store = MooncakeStore.connect(cfg, embedded=mc)
        yield mc, store
    finally:
        if store is not None and mc.master_pid is None:
            mc.start_master()  # let close() unmount quickly instead of retrying a dead master
        if store is not None:
            store.close()
        mc.stop()
    assert mc.master_pid is None and mc.metadata_pid is None


def put_one(store: MooncakeStore, key: str, t: torch.Tensor) -> int:
    return store.batch_put([key], [[t.data_ptr()]], [[t.nbytes]])[0]


def get_one(store: MooncakeStore, key: str, t: torch.Tensor) -> int:
    return store.batch_get([key], [[t.data_ptr()]], [[t.nbytes]])[0]


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_killed_master_gives_codes_then_fast_skips_then_recovers_without_old_keys(
        private: tuple[EmbeddedMooncake, MooncakeStore]) -> None:
    mc, store = private
    src = torch.arange(2048, dtype=torch.float32)
    assert put_one(store, "before", src) == 0
    old_pid = mc.master_pid
    mc.kill_master()
    assert mc.master_pid is None

    t0 = time.monotonic()
    first = store.batch_is_exist(["before", "other"])
    assert time.monotonic() - t0 < HANG_GUARD_S
    assert all(code in MASTER_DOWN_CODES for code in first), first
    # after one master failure the store is skipped at once instead of paying ~4 s per call
    dst = torch.zeros_like(src)
    assert store.batch_put(["x"], [[src.data_ptr()]], [[src.nbytes]]) == [StoreCode.UNHEALTHY_SKIPPED]
    assert get_one(store, "before", dst) == StoreCode.UNHEALTHY_SKIPPED
    assert not store.healthy()
    assert torch.count_nonzero(dst) == 0  # a failed load wrote nothing

    mc.start_master()  # same ports, empty index
    assert mc.master_pid not in (None, old_pid)
    assert wait_until(lambda: put_one(store, "after", src) == 0, 30.0), "client never re-mounted"
    assert store.batch_is_exist(["before", "after"]) == [0, 1]  # the restart lost every old key
    assert get_one(store, "before", dst) == StoreCode.OBJECT_NOT_FOUND
    assert get_one(store, "after", dst) == src.nbytes and torch.equal(dst, src)
    assert wait_until(store.healthy, 30.0)


def test_restart_master_helper_loses_keys_and_keeps_ports(private: tuple[EmbeddedMooncake, MooncakeStore]) -> None:
    mc, store = private
    src = torch.ones(1024)
    assert put_one(store, "k", src) == 0
    addr = mc.master_address
    mc.restart_master()
    assert mc.master_address == addr and mc.master_pid is not None
    # exist() right after a restart may fail once (-900) and open the backoff; poll past it
    assert wait_until(lambda: store.batch_is_exist(["k"]) == [0], 30.0)


def test_hung_master_times_out_with_901_within_rpc_timeout(
        private: tuple[EmbeddedMooncake, MooncakeStore]) -> None:
    mc, store = private
    pid = mc.master_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        assert wait_until(lambda: stopped(pid), 10.0)  # SIGSTOP lands asynchronously
        t0 = time.monotonic()
        res = store.batch_is_exist(["a"])
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert elapsed < HANG_GUARD_S
    assert res == [StoreCode.RPC_TIMEOUT], res
    assert store.batch_is_exist(["a"]) == [StoreCode.UNHEALTHY_SKIPPED]
    assert wait_until(lambda: store.batch_is_exist(["a"]) == [0], 30.0)  # the same client works again


def test_a_frozen_holder_fails_a_get_within_transfer_timeout() -> None:
    """The process holding a key's bytes is frozen (SIGSTOP: its socket accepts, it never answers). Without a
    bound the get would wait for it; with `transfer_timeout_s` the transfer fails (-800) once it made no
    progress that long, and the caller's thread is free. Continued, the holder serves again."""
    with EmbeddedMooncake(rpc_timeout_ms=RPC_TIMEOUT_MS) as mc:
        holder = mc.start_holder(32 << 20)
        store = MooncakeStore.connect(StoreConfig(global_segment_size=0, rpc_timeout_ms=RPC_TIMEOUT_MS,
                                                  transfer_timeout_s=1), embedded=mc)
        try:
            src, dst = torch.arange(4096, dtype=torch.float32), torch.zeros(4096)
            assert put_one(store, "held", src) == 0  # the only segment is the holder's
            os.kill(holder, signal.SIGSTOP)
            try:
                out: list[int] = []
                t = threading.Thread(target=lambda: out.append(get_one(store, "held", dst)), daemon=True)
                t.start()
                t.join(HANG_GUARD_S)
                assert out == [StoreCode.TRANSFER_FAIL], f"a get from a frozen holder: {out or 'still inside'}"
            finally:
                os.kill(holder, signal.SIGCONT)
            assert store.healthy()  # the master never failed: no breaker, the next get is sent
            assert wait_until(lambda: get_one(store, "held", dst) == src.nbytes, HANG_GUARD_S)
            assert torch.equal(dst, src)
        finally:
            store.close()


def test_segment_owner_dies_readers_see_800_then_704_and_puts_200() -> None:
    """Workers as pure consumers (segment 0) storing into a separate holder process over real TCP; the
    holder dies: its keys fail (-800), then vanish (-704) once the master drops it; puts find no space."""
    with EmbeddedMooncake(rpc_timeout_ms=RPC_TIMEOUT_MS, client_ttl_s=2) as mc:
        holder = mc.start_holder(32 << 20)
        assert mc.holder_pids == [holder]
        store = MooncakeStore.connect(StoreConfig(global_segment_size=0, rpc_timeout_ms=RPC_TIMEOUT_MS), embedded=mc)
        try:
            src, dst = torch.arange(4096, dtype=torch.float32), torch.zeros(4096)
            assert put_one(store, "held", src) == 0  # the only segment is the holder's
            assert get_one(store, "held", dst) == src.nbytes and torch.equal(dst, src)
            mc.kill_holder(holder)
            assert mc.holder_pids == []
            dst.zero_()
            first = get_one(store, "held", dst)
            assert first in (StoreCode.TRANSFER_FAIL, StoreCode.OBJECT_NOT_FOUND)
            assert torch.count_nonzero(dst) == 0
            assert wait_until(lambda: store.batch_is_exist(["held"]) == [0], 30.0)  # after client_ttl
            assert get_one(store, "held", dst) == StoreCode.OBJECT_NOT_FOUND
            assert put_one(store, "new", src) == StoreCode.NO_AVAILABLE_HANDLE  # no segment left
            assert store.healthy()  # the master is fine; only the data holder is gone
            mc.kill_holder(holder)  # already dead: a no-op
            with pytest.raises(ValueError, match="not a holder"):
                mc.kill_holder(os.getpid())
        finally:
            store.close()
