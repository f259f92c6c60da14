"""Faults injected BELOW the store wrapper: `testbed.faults.FaultyMooncakeClient` (a test double) is the raw
client of a real `MooncakeStore`, over a real Mooncake client on the loopback master, so the wrapper's own
code handling, pre-send checks and master-down backoff run on every injected answer. `ManualClock` drives
the backoff, so nothing here depends on how long a call takes. The last tests run the connector's save and
load generators (kvledger_connector/worker/steps.py) over it, on a KV cache from vLLM's allocator."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig

from kvledger.load import LoadLedger
from kvledger.worker import WorkerLedger
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from conformance.kvprobes import io_of, with_edge, worker_config
from kvledger_connector.worker.base import JobAction
from kvledger_connector.worker.cache import RegisteredCache
from kvledger_connector.worker.steps import WorkerSteps
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.shape.kvlayout import plan_block_copies
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import PROBE_KEY, MooncakeStore
from testbed.faults import (BATCH_OPS, FaultyMooncakeClient, InjectedFault, ManualClock, RawFault,
                            faulty_mooncake_store)
from testbed.kvcache import allocate, attention_specs, build_kv_cache_config

BACKOFF_MS = 5000
NBLOCKS = 8
LAYOUT = "LBNHC"

Rig = tuple[MooncakeStore, FaultyMooncakeClient, ManualClock]
_KV_CACHES: list[torch.Tensor] = []  # registered with the module's client: alive until it closes


@pytest.fixture(scope="module")
def rig(mooncake: EmbeddedMooncake) -> Iterator[Rig]:
    clock = ManualClock(100.0)
    cfg = StoreConfig(global_segment_size=32 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000,
                      unhealthy_backoff_ms=BACKOFF_MS, max_key_bytes=96)
    store, client = faulty_mooncake_store(cfg, embedded=mooncake, clock=clock)
    try:
        yield store, client, clock
    finally:
        client.clear()
        store.close()


@pytest.fixture
def fresh(rig: Rig) -> Rig:
    """No fault standing and no backoff left from an earlier test: past the skip, one call the master
    answers (which resets the failures in a row)."""
    store, client, clock = rig
    client.clear()
    clock.advance(store.skip_remaining_s + 1)
    assert store.probe() and store.batch_is_exist(["fresh-rig-probe"]) == [0]
    return rig


def rows(n: int, fill: bool = True) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """n rows (row i holds i + 1, or zeros) and their (ptrs, sizes), one key's object per row."""
    t = torch.stack([torch.full((256,), float(i + 1) if fill else 0.0) for i in range(n)])
    return t, [[r.data_ptr()] for r in t], [[r.nbytes] for r in t]


def test_unfaulted_calls_are_the_real_client(fresh: Rig, key_prefix: str) -> None:
    store, client, _ = fresh
    keys = [f"{key_prefix}{i}" for i in range(3)]
    (src, sp, ss), (dst, dp, ds) = rows(3), rows(3, fill=False)
    assert store.batch_put(keys, sp, ss) == [0, 0, 0]
    assert store.batch_get(keys, dp, ds) == [src[0].nbytes] * 3 and torch.equal(src, dst)
    assert [c.fault for c in client.calls][-2:] == [None, None]


@pytest.mark.parametrize("code", [StoreCode.TRANSFER_FAIL, StoreCode.NO_AVAILABLE_HANDLE])
def test_a_code_for_every_key_stores_nothing(fresh: Rig, key_prefix: str, code: int) -> None:
    store, client, _ = fresh
    keys = [f"{key_prefix}{i}" for i in range(2)]
    _, sp, ss = rows(2)
    client.next_call("put", RawFault(code=code))
    assert store.batch_put(keys, sp, ss) == [code, code]
    assert store.batch_is_exist(keys) == [0, 0]  # the next call is forwarded: nothing reached the store
    assert store.batch_put(keys, sp, ss) == [0, 0]


def test_master_down_opens_the_breaker_and_only_a_probe_closes_it(fresh: Rig, key_prefix: str) -> None:
    store, client, clock = fresh
    keys = [f"{key_prefix}a"]
    _, sp, ss = rows(1)
    client.always(BATCH_OPS, RawFault(code=StoreCode.RPC_FAIL))
    assert store.batch_is_exist(keys) == [StoreCode.RPC_FAIL] and store.breaker_open
    client.always(BATCH_OPS, None)  # the master is back, but the wrapper does not ask yet
    before = dict(client.num_calls)
    clock.advance(BACKOFF_MS / 1000.0 - 0.001)
    assert not store.probe()  # not due yet: nothing sent
    assert store.batch_put(keys, sp, ss) == [StoreCode.UNHEALTHY_SKIPPED]
    assert not store.healthy()
    assert client.num_calls == before  # skipped inside the wrapper: no call reached the client
    clock.advance(0.002)
    # past the wait a caller is still skipped: only the probe asks the master (no caller pays for it)
    assert store.batch_put(keys, sp, ss) == [StoreCode.UNHEALTHY_SKIPPED] and client.num_calls == before
    assert store.probe() and not store.breaker_open
    assert client.num_calls["exist"] == before["exist"] + 1 and client.calls[-1].keys == (PROBE_KEY,)
    assert store.batch_put(keys, sp, ss) == [0]
    assert client.num_calls["put"] == before["put"] + 1


def test_a_timeout_code_backs_off_too_and_health_faults_answer_health(fresh: Rig) -> None:
    store, client, clock = fresh
    assert store.healthy()
    client.next_call("health", RawFault(code=-1))
    assert not store.healthy() and store.healthy()
    client.next_call("exist", RawFault(code=StoreCode.RPC_TIMEOUT))
    assert store.batch_is_exist(["k"]) == [StoreCode.RPC_TIMEOUT]
    assert store.batch_is_exist(["k"]) == [StoreCode.UNHEALTHY_SKIPPED]


def test_chosen_keys_of_a_get_fail_and_the_others_load(fresh: Rig, key_prefix: str) -> None:
    store, client, _ = fresh
    keys = [f"{key_prefix}{i}" for i in range(3)]
    (src, sp, ss), (dst, dp, ds) = rows(3), rows(3, fill=False)
    assert store.batch_put(keys, sp, ss) == [0] * 3
    with client.during("get", RawFault(keys={keys[1]: StoreCode.TRANSFER_FAIL})):
        res = store.batch_get(keys, dp, ds)
    assert res == [src[0].nbytes, StoreCode.TRANSFER_FAIL, src[0].nbytes]
    assert torch.count_nonzero(dst[1]) == 0 and torch.equal(dst[[0, 2]], src[[0, 2]])
    assert client.calls[-1].keys == tuple(keys) and client.calls[-1].fault is not None  # the call as sent


def test_a_raising_client_is_a_client_exception_per_key(fresh: Rig, key_prefix: str) -> None:
    store, client, _ = fresh
    client.next_call("exist", RawFault(raises=True))
    assert store.batch_is_exist([f"{key_prefix}x", f"{key_prefix}y"]) == [StoreCode.CLIENT_EXCEPTION] * 2
    assert isinstance(store.last_exception, InjectedFault)


def test_the_wrappers_checks_run_before_the_client(fresh: Rig, key_prefix: str) -> None:
    store, client, _ = fresh
    long_key = key_prefix + "x" * 200  # above max_key_bytes=96: never sent
    before = client.num_calls["exist"]
    assert store.batch_is_exist([long_key]) == [StoreCode.KEY_TOO_LONG]
    assert client.num_calls["exist"] == before


def test_bad_faults_and_ops_are_refused(fresh: Rig) -> None:
    _, client, clock = fresh
    with pytest.raises(ValueError, match="exactly one"):
        RawFault()
    with pytest.raises(ValueError, match="exactly one"):
        RawFault(code=-800, raises=True)
    with pytest.raises(ValueError, match="raw op 'delete'"):
        client.next_call("delete", RawFault(code=-800))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="never goes back"):
        clock.advance(-1)


# ---------------------------------------------------------------- the connector's generators over it
def _steps(store: MooncakeStore, salt: str) -> tuple[WorkerSteps, torch.Tensor]:
    vc = VllmConfig(cache_config=CacheConfig(block_size=1), device_config=DeviceConfig("cpu"))
    kv_cfg = build_kv_cache_config(vc, attention_specs(1, block_size=1, num_kv_heads=1, head_size=64),
                                   NBLOCKS, LAYOUT)
    caches = allocate(kv_cfg, LAYOUT)
    plan = plan_block_copies(caches, layout=LAYOUT, block_size=1, num_blocks=NBLOCKS)
    for ptr, n in plan.storages:
        store.register_buffer(ptr, n)
    keys = KeyBuilder(KeyLayout(model=f"raw-faults-{salt}", tp_rank=0, tp_size=1, block_size=1,
                                dtype="torch.float32", kv_layout=LAYOUT, num_layers=1, num_kv_heads=1,
                                head_size=64))
    cache = RegisteredCache(lambda ids, parts: plan.batch_buffers(ids), None, key_bytes=plan.block_bytes)
    steps = with_edge(WorkerSteps(worker_config(1, 1), cache, ledger=WorkerLedger(0, max_live_jobs=8),
                                  loads=LoadLedger(0, max_inflight_loads=4), tp_rank=0,
                                  shape=BlockShape.of_keys([keys])), store)
    (view,) = caches.values()
    _KV_CACHES.append(view)
    return steps, view


def test_a_save_under_a_down_master_fails_then_the_backoff_skips_then_it_saves(fresh: Rig, key_prefix: str) -> None:
    store, client, clock = fresh
    w, kv = _steps(store, key_prefix.strip("/").replace("/", "-"))
    kv[1:3].fill_(7.0)
    hashes = [b"\x01" * 8, b"\x02" * 8]
    for job in (1, 2, 3):
        w.receive("r", job, 0)
    gen = w.save_steps(io_of(w), "r", 1, 2, [1, 2], hashes)
    assert next(gen).action is JobAction.DMA_READ
    with client.during(BATCH_OPS, RawFault(code=StoreCode.RPC_FAIL)):
        put = next(gen)
    assert put.outcome is not None and not put.outcome.stored and w.ledger.job_state(1) == "failed"
    assert next(gen).action is JobAction.REPORT
    before = dict(client.num_calls)
    w.run_save(io_of(w), "r", 2, 2, [1, 2], hashes)  # inside the backoff: skipped by the wrapper, failed, reported
    assert client.num_calls == before and w.ledger.job_state(2) == "reported"
    assert w.stats.total("failed_jobs") == 2 and w.ledger.request("r").saved_offset == 0
    clock.advance(BACKOFF_MS / 1000.0)
    assert store.probe()
    w.run_save(io_of(w), "r", 3, 2, [1, 2], hashes)
    assert w.ledger.request("r").saved_offset == 2 and w.take_reports() == {1: 1, 2: 1, 3: 1}
    # a load of the two keys with the second key's transfer failing: block 4 loaded, block 5 reported
    lg = w.load_steps(io_of(w), "r2", [4, 5], hashes)
    assert next(lg).action is JobAction.EMIT_LOAD and next(lg).failed == ()
    with client.during("get", RawFault(keys={w.block_shape().builders[0].key(hashes[1]): StoreCode.TRANSFER_FAIL})):
        last = next(lg)
    assert last.failed == ((5, StoreCode.TRANSFER_FAIL),) and last.result is not None
    assert torch.all(kv[4] == 7.0) and torch.count_nonzero(kv[5]) == 0 and w.take_load_errors() == {5}


def test_master_failures_in_a_row_double_the_backoff_and_an_answer_resets_it(fresh: Rig, key_prefix: str) -> None:
    """A master dead for good costs one probe per wait: 5 s, 10 s, 20 s, then the 30 s cap; inside each wait
    nothing is sent, and no caller is ever sent through. The first probe the master answers closes the
    breaker; the next failure waits 5 s again."""
    store, client, clock = fresh
    keys = [f"{key_prefix}k"]
    skips = []
    with client.during(BATCH_OPS, RawFault(code=StoreCode.RPC_FAIL)):
        assert store.batch_is_exist(keys) == [StoreCode.RPC_FAIL]
        for _ in range(6):
            skips.append(store.skip_remaining_s)
            sent = sum(client.num_calls.values())
            assert store.batch_is_exist(keys) == [StoreCode.UNHEALTHY_SKIPPED]
            clock.advance(skips[-1] - 0.001)
            assert not store.probe() and sum(client.num_calls.values()) == sent  # not due: nothing sent
            clock.advance(0.001)
            assert store.batch_is_exist(keys) == [StoreCode.UNHEALTHY_SKIPPED] and sum(client.num_calls.values()) == sent
            assert not store.probe() and sum(client.num_calls.values()) == sent + 1  # the probe: the master is down
    assert skips == pytest.approx([5.0, 10.0, 20.0, 30.0, 30.0, 30.0])
    clock.advance(store.skip_remaining_s)
    assert store.probe() and store.batch_is_exist(keys) == [0]  # the master answers
    with client.during(BATCH_OPS, RawFault(code=StoreCode.RPC_FAIL)):
        assert store.batch_is_exist(keys) == [StoreCode.RPC_FAIL]
    assert store.skip_remaining_s == pytest.approx(5.0)
    assert store.stats.total("breaker_trips") >= 2
