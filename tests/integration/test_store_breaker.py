"""The store's circuit breaker and the scheduler's call deadline, on a real Mooncake master that is frozen
(SIGSTOP) or killed: a call past its deadline answers a miss and opens the breaker; while it is open no
caller reaches the client; only the breaker's own prober closes it, once the master answers.

These tests own a private EmbeddedMooncake (they freeze or kill its master). The waits are hang guards
(`wait_until`: a condition must come true at all), never timed assertions.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import MASTER_DOWN_CODES, StoreCode
from kvledger_connector.store.client import MooncakeStore
from testbed.emu_model import expected_output, shared_prefix_prompts
from testbed.harness import Harness
from testbed.procs import wait_until
from testbed.store_double import StoreDouble

RPC_TIMEOUT_MS = 3000  # a frozen master holds a call this long: far past the deadlines below
BACKOFF_MS = 300



def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def private() -> Iterator[tuple[EmbeddedMooncake, MooncakeStore]]:
    mc = EmbeddedMooncake(rpc_timeout_ms=RPC_TIMEOUT_MS)
    store = None
    try:
        cfg = StoreConfig(global_segment_size=16 << 20, rpc_timeout_ms=RPC_TIMEOUT_MS,
                          unhealthy_backoff_ms=BACKOFF_MS, max_unhealthy_backoff_ms=4 * BACKOFF_MS)
        store = MooncakeStore.connect(cfg, embedded=mc)
        yield mc, store
    finally:
        if mc.master_pid is not None:
            os.kill(mc.master_pid, signal.SIGCONT)
        elif store is not None:
            mc.start_master()  # let close() unmount quickly instead of retrying a dead master
        if store is not None:
            store.close()
        mc.stop()


def test_a_lookup_past_its_deadline_misses_and_trips_the_breaker(
        private: tuple[EmbeddedMooncake, MooncakeStore]) -> None:
    mc, store = private
    stats = store.stats = StatsRecorder()  # what the connector does: its counters, Prometheus' metrics
    bounded = DeadlineStore(store, 0.5, stats)  # far below the frozen master's 3 s, far above a live call
    assert bounded.batch_is_exist(["k"]) == [0]  # a live master answers through the helper thread
    pid = mc.master_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        assert wait_until(lambda: stopped(pid), 10.0)
        assert bounded.batch_is_exist(["k", "l"]) == [StoreCode.RPC_TIMEOUT] * 2  # a miss for the lookup
        assert store.breaker_open
        assert stats.total("lookups_past_deadline") == 1 and stats.total("breaker_trips") == 1
        inside = store.calls_inside  # the abandoned call (it returns at Mooncake's RPC timeout)
        assert bounded.batch_is_exist(["k"]) == [StoreCode.UNHEALTHY_SKIPPED]  # open: not sent
        assert store.calls_inside == inside and stats.total("lookups_past_deadline") == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    # nobody calls: the breaker's own prober sees the master answer and closes it
    assert wait_until(lambda: not store.breaker_open, 30.0), (stats.total("breaker_probes"), store.last_exception)
    assert stats.total("breaker_probes") >= 1
    assert wait_until(lambda: bounded.batch_is_exist(["k"]) == [0], 30.0)
    bounded.stop()
    assert bounded.batch_is_exist(["k"]) == [0]  # stopped: calls go direct


class _Hang(StoreDouble):
    """THIS IS A TEST DOUBLE: a store whose existence check blocks until released (a call stuck inside a
    client with no breaker, to show the deadline store never queues behind it)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.calls += 1
        self.release.wait(30.0)
        return [1] * len(keys)


def test_a_call_still_inside_is_never_queued_behind() -> None:
    hang = _Hang()
    bounded = DeadlineStore(hang, 0.02)
    assert bounded.batch_is_exist(["a"]) == [StoreCode.RPC_TIMEOUT]
    assert bounded.batch_is_exist(["a", "b"]) == [StoreCode.UNHEALTHY_SKIPPED] * 2  # busy: answered at once
    assert hang.calls == 1 and bounded.counts.total("lookups_skipped_busy") == 1
    hang.release.set()
    assert wait_until(lambda: bounded.batch_is_exist(["a"]) == [1], 10.0)
    assert hang.calls == 2
    bounded.stop()
    with pytest.raises(ValueError, match="timeout_s"):
        DeadlineStore(hang, 0)


def test_the_prober_closes_the_breaker_after_a_restart_and_no_caller_pays(
        private: tuple[EmbeddedMooncake, MooncakeStore]) -> None:
    mc, store = private
    mc.kill_master()
    first = store.batch_is_exist(["a"])
    # the call fails with the master, or is skipped before it: the store's authenticity check (its first call
    # makes one) found the master's listener gone
    assert all(c in MASTER_DOWN_CODES for c in first) or (first == [StoreCode.UNHEALTHY_SKIPPED]
                                                           and store.stats.total("master_unauthentic") == 1), first
    assert store.breaker_open
    # while it is open every call answers at once, however long the master stays away
    assert wait_until(lambda: store.stats.total("breaker_probes") >= 2, 30.0)  # probes failed: the waits doubled
    assert store.batch_is_exist(["a"]) == [StoreCode.UNHEALTHY_SKIPPED] and store.breaker_open
    mc.start_master()
    assert wait_until(lambda: not store.breaker_open, 30.0), store.last_exception
    assert store.batch_is_exist(["a"]) == [0] and store.stats.total("breaker_trips") == 1


def test_a_frozen_master_mid_run_costs_misses_never_wrong_kv_or_pins() -> None:
    """vLLM's real Scheduler (the harness, two ranks), pass 2 asking for pass 1's prefixes, the master frozen
    (SIGSTOP) for a few RPC timeouts mid-pass and then continued: every request finishes with the model's
    output, nothing computes on wrong KV, no block stays pinned, the breakers opened and closed again."""
    prompts = shared_prefix_prompts(24, num_prefixes=4, prefix_len=48, suffix_len=16, seed=7)
    with EmbeddedMooncake(rpc_timeout_ms=1000) as mc:
        cfg = StoreConfig(global_segment_size=32 << 20, rpc_timeout_ms=1000, unhealthy_backoff_ms=BACKOFF_MS,
                          max_unhealthy_backoff_ms=4 * BACKOFF_MS).with_addresses(mc.master_address,
                                                                                  mc.metadata_server)
        with Harness(cfg, tp_size=2, num_blocks=40, policy="recompute", extra={"lookup_timeout_ms": 50}) as h:
            for i, p in enumerate(prompts):
                h.add_request(f"p1-{i}", p, 8)
            h.run(max_steps=5_000, timeout_s=120)
            h.reset_prefix_cache_when_idle()
            for i, p in enumerate(prompts):
                h.add_request(f"p2-{i}", p, 8)
            for _ in range(3):
                h.step()
            pid = mc.master_pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3.0 and h.step():  # the engine keeps stepping while frozen
                    pass
            finally:
                os.kill(pid, signal.SIGCONT)
            h.run(max_steps=5_000, timeout_s=120)
            stores = [h.scheduler_connector.store, *(w.store for w in h.workers)]
            assert sum(s.stats.total("breaker_trips") for s in stores) >= 1
            assert wait_until(lambda: not any(s.breaker_open for s in stores), 30.0)
            conns = [h.scheduler_connector, *h.workers]  # every trip and probe counted in the connectors' stats
            assert all(s.stats is c.stats for s, c in zip(stores, conns))
            assert sum(c.stats.total("breaker_probes") for c in conns) >= 1
            for p, ids in ((1, range(len(prompts))), (2, range(len(prompts)))):
                for i in ids:
                    assert h.stats.outputs[f"p{p}-{i}"] == expected_output(prompts[i], 8), (p, i)
            assert h.garbage == [] and h.check_at_rest() == []


def _pass(h: Harness, tag: str, prompts: Sequence[list[int]]) -> None:
    h.reset_prefix_cache_when_idle()
    for i, p in enumerate(prompts):
        h.add_request(f"{tag}-{i}", p, 8)
    h.run(max_steps=5_000, timeout_s=120)
    for i, p in enumerate(prompts):
        assert h.stats.outputs[f"{tag}-{i}"] == expected_output(p, 8), (tag, i)


def test_the_embedded_master_is_restarted_and_every_client_reattaches() -> None:
    """The connector's embedded default (no master address): its owner supervises the master. Killed
    (SIGKILL) between passes, it is started again on the same port with no keys; the scheduler's and both
    ranks' clients re-attach (their breakers close, their segments are mounted again), a later pass saves
    again and the one after it loads from the store. Every output is the model's, nothing read wrong KV,
    nothing stays pinned."""
    prompts = shared_prefix_prompts(12, num_prefixes=3, prefix_len=48, suffix_len=16, seed=11)
    cfg = StoreConfig(global_segment_size=32 << 20, rpc_timeout_ms=1000, unhealthy_backoff_ms=BACKOFF_MS,
                      max_unhealthy_backoff_ms=4 * BACKOFF_MS)
    assert cfg.embedded
    with Harness(cfg, tp_size=2, num_blocks=40, policy="recompute") as h:
        owner = next(c._embedded for c in (h.scheduler_connector, *h.workers)
                     if isinstance(c._embedded, EmbeddedMooncake))
        assert owner.supervise
        ss = h.scheduler_connector.scheduler_side.steps
        _pass(h, "p1", prompts)
        loads_before, port, pid = ss.stats.total("loads_emitted"), owner.rpc_port, owner.master_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert owner.wait_restarts(1, 60.0), "the supervisor did not restart the master"
        assert owner.master_pid not in (None, pid) and owner.rpc_port == port
        _pass(h, "p2", prompts)  # the keys went with the old master: misses, then saves again
        stores = [h.scheduler_connector.store, *(w.store for w in h.workers)]
        assert wait_until(lambda: not any(s.breaker_open for s in stores), 30.0)
        # the clients re-mount their segments on the new master in the background (puts answer "no space"
        # until they have): passes until one loads what an earlier one saved there, a bounded number
        for n in range(3, 40):
            _pass(h, f"p{n}", prompts)
            if ss.stats.total("loads_emitted") > loads_before:
                break
        assert ss.stats.total("loads_emitted") > loads_before, "no load from the restarted master"
        assert h.garbage == [] and h.check_at_rest() == []
