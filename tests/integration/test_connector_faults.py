"""Faults through vLLM's real Scheduler and load-failure recovery: keys evicted or removed between lookup and
load, failed gets (negative codes, exceptions), failed puts (store full, transfer failures), a real
master killed and restarted, and a real holder of the stored bytes frozen. Under `recompute` affected requests recompute and finish correctly; under `fail`
they finish with an error; never does a request compute on garbage (the harness checks the KV of every
position it did not compute itself before each forward).

Faults are injected with `testbed.faults.FaultyStore` (a test double around the real store, seeded).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from testbed.faults import FaultPlan, FaultRule, FaultyStore
from kvledger_connector.store.contract import StoreCode
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 24


def _pass(h: Harness, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        h.add_request(f"req-{i}", p, MAX_TOKENS)
    h.run()


def _wrap_workers(h: Harness, plan: FaultPlan) -> list[FaultyStore]:
    faulty = []
    for r, w in enumerate(h.workers):
        fs = FaultyStore(w.worker_side.io.store, FaultPlan(plan.rules, seed=plan.seed + r))
        w.worker_side.io.store = fs
        faulty.append(fs)
    return faulty


def _common_checks(h: Harness) -> None:
    assert h.garbage == []
    assert h.check_at_rest() == []
    _, polluted = h.check_store()
    assert polluted == 0


GET_FAULTS = FaultPlan([
    FaultRule("get", "evict", probability=0.15),  # removed between lookup and load: real -704
    FaultRule("get", "code", code=int(StoreCode.TRANSFER_FAIL), probability=0.15),
    FaultRule("get", "raise", calls=frozenset({1, 4})),
], seed=11)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_faults_under_recompute_recompute_and_finish_correctly(store_config: StoreConfig, tp_size: int):
    """Loads of 48 tokens, under the default ``sync_load_max_tokens``: async all the same (``recompute``)."""
    prompts = shared_prefix_prompts(14, num_prefixes=3, prefix_len=48, suffix_len=16, seed=20 + tp_size)
    with Harness(store_config, tp_size=tp_size, num_blocks=20, policy="recompute") as h:
        _pass(h, prompts)
        faulty = _wrap_workers(h, GET_FAULTS)
        h.stats.outputs.clear()
        _pass(h, prompts)
        assert sum(len(f.injected) for f in faulty) > 0
        assert h.scheduler_connector.scheduler_side.steps.stats.total("sync_loads") == 0
        assert h.stats.load_error_blocks > 0  # failures were reported to vLLM ...
        for i, p in enumerate(prompts):  # ... which recomputed: every request finished correctly
            assert h.stats.finished[f"req-{i}"] == "length"
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        _common_checks(h)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_faults_under_fail_finish_with_error(store_config: StoreConfig, tp_size: int):
    """Under ``fail`` (vLLM's default) the 48-token loads run inside the step that schedules them."""
    prompts = shared_prefix_prompts(14, num_prefixes=3, prefix_len=48, suffix_len=16, seed=31)
    with Harness(store_config, tp_size=tp_size, num_blocks=20, policy="fail") as h:
        _pass(h, prompts)
        _wrap_workers(h, GET_FAULTS)
        h.stats.outputs.clear()
        _pass(h, prompts)
        reasons = {h.stats.finished[f"req-{i}"] for i in range(len(prompts))}
        assert "error" in reasons
        assert h.scheduler_connector.scheduler_side.steps.stats.total("sync_loads") > 0
        for i, p in enumerate(prompts):
            if h.stats.finished[f"req-{i}"] == "length":  # unaffected requests are still correct
                assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        _common_checks(h)


def test_put_failures_and_store_pressure_lose_nothing(store_config: StoreConfig):
    prompts = shared_prefix_prompts(12, num_prefixes=2, prefix_len=48, suffix_len=16, seed=41)
    plan = FaultPlan([
        FaultRule("put", "code", code=int(StoreCode.NO_AVAILABLE_HANDLE), probability=0.4),
        FaultRule("put", "code", code=int(StoreCode.TRANSFER_FAIL), probability=0.2),
        FaultRule("put", "raise", calls=frozenset({2})),
    ], seed=3)
    with Harness(store_config, num_blocks=20) as h:
        faulty = _wrap_workers(h, plan)
        _pass(h, prompts)
        assert sum(len(f.injected) for f in faulty) > 0
        ws = h.workers[0].worker_side
        assert ws.steps.stats.total("failed_jobs") > 0
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        _common_checks(h)  # every job was reported: no pin outlived its job


@pytest.fixture
def own_master() -> Iterator[EmbeddedMooncake]:
    mc = EmbeddedMooncake(rpc_timeout_ms=1000)
    try:
        yield mc
    finally:
        mc.stop()


def test_master_killed_then_restarted(own_master: EmbeddedMooncake):
    """A dead master: lookups miss, saves fail and are reported, nothing hangs; after a restart (every key
    lost) the connector stores again."""
    cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=1000,
                      unhealthy_backoff_ms=30_000).with_addresses(own_master.master_address,
                                                                  own_master.metadata_server)
    prompts = shared_prefix_prompts(8, num_prefixes=2, prefix_len=48, suffix_len=16, seed=51)
    with Harness(cfg, num_blocks=20) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _pass(h, prompts)
        own_master.kill_master()
        h.stats.outputs.clear()
        loads_before = ss.stats.total("loads_emitted")
        _pass(h, prompts)  # master down: no hit can be trusted, no save can land
        assert ss.stats.total("loads_emitted") == loads_before
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        assert h.garbage == [] and h.check_at_rest() == []
        own_master.start_master()
        import time
        time.sleep(3.0)  # clients re-mount their segments (~2 s, see reference/mooncake-store.md)
        for conn in [h.scheduler_connector, *h.workers]:  # the breakers the failures opened: probe now
            store = conn.store  # (their own probers would wait out the 30 s backoff)
            assert store.probe(force=True), store.last_exception
        h.stats.outputs.clear()
        _pass(h, prompts)
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        _common_checks(h)


def test_a_frozen_holder_costs_load_errors_never_a_stall(own_master: EmbeddedMooncake):
    """The ranks are pure consumers (segment 0) and every stored block lives in one holder process. Between
    passes the holder is frozen (SIGSTOP): pass 2's lookups hit (the master answers), its loads and puts make
    no progress and fail after `transfer_timeout_s` (-800); the loads' blocks are reported and recomputed,
    the saves reported and their pins released. Every output is the model's, nothing reads wrong KV, nothing
    stays pinned, and the engine never waits longer than that bound on any one transfer."""
    holder = own_master.start_holder(64 << 20)
    cfg = StoreConfig(global_segment_size=0, local_buffer_size=4 << 20, rpc_timeout_ms=1000,
                      transfer_timeout_s=1).with_addresses(own_master.master_address, own_master.metadata_server)
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=16, seed=53)
    with Harness(cfg, tp_size=2, num_blocks=24, policy="recompute") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _pass(h, prompts)
        assert h.scheduler.reset_prefix_cache()
        h.stats.outputs.clear()
        os.kill(holder, signal.SIGSTOP)
        try:
            _pass(h, prompts)
        finally:
            os.kill(holder, signal.SIGCONT)
        assert ss.stats.total("loads_emitted") > 0 and h.stats.load_error_blocks > 0  # loaded from the holder: failed, reported
        assert all(w.stats.total(f"fail_code.{int(StoreCode.TRANSFER_FAIL)}") > 0 for w in h.workers)
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, MAX_TOKENS)
        _common_checks(h)
