"""Sync loads through vLLM 0.32.0's real Scheduler, BlockPool and KVOutputAggregator (testbed.harness, a
real Mooncake master): a load of at most ``sync_load_max_tokens`` tokens is answered ``load_kv_async=False``,
so vLLM schedules its request in the step that admits it (never WAITING_FOR_REMOTE_KVS) and every rank
loads before that step's forward; its pins are released by the ranks' ``completed_loads``; the request's
save waits for that report; a failed block is still reported and fails the request. Loads are sync only
under vLLM's ``kv_load_failure_policy`` "fail" (its default; the harness's is "recompute", so these tests
name it): under "recompute" every load is async (kvledger_connector.scheduler.steps' notes say why)."""
from __future__ import annotations

from typing import Any

import pytest

from kvledger_connector.config import BY_NAME, CPU_SYNC_LOAD_MAX_TOKENS, StoreConfig
from kvledger_connector.store.contract import StoreCode
from testbed.faults import FaultPlan, FaultRule, FaultyStore
from testbed.harness import Harness, shared_prefix_prompts

BS = 16  # the harness's block size


def _prompt(seed: int, full_blocks: int = 4, extra_tokens: int = 5) -> list[int]:
    return shared_prefix_prompts(1, num_prefixes=1, prefix_len=full_blocks * BS, suffix_len=extra_tokens,
                                 seed=seed)[0]


def _warm(h: Harness, prompt: list[int]) -> None:
    """Save ``prompt`` through the store, then drop vLLM's own prefix cache: the next hit is a store hit."""
    h.add_request("warm", prompt, 2)
    h.run()
    assert h.scheduler.reset_prefix_cache()


def _statuses(h: Harness, req_id: str) -> list[str]:
    """Step until ``req_id`` finished, recording its status after each schedule()."""
    seen: list[str] = []
    sched = h.scheduler
    real = sched.schedule

    def schedule() -> Any:  # a spy: vLLM's schedule() unchanged, the status read after it
        out = real()
        if req_id in sched.requests:
            seen.append(sched.requests[req_id].status.name)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    try:
        while req_id not in h.stats.finished:
            assert h.step()
    finally:
        del sched.schedule
    return seen


@pytest.mark.parametrize("tp_size", [1, 2])
def test_short_load_runs_in_the_step_that_schedules_it(store_config: StoreConfig, tp_size: int):
    prompt = _prompt(61)
    with Harness(store_config, tp_size=tp_size, num_blocks=24, policy="fail") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        h.add_request("b", prompt, 3)
        seen = _statuses(h, "b")
        assert "WAITING_FOR_REMOTE_KVS" not in seen and seen[0] == "RUNNING", seen
        assert ss.stats.total("loads_emitted") == ss.stats.total("sync_loads") == 1
        assert ss.ledger.counts.total("loads_released") == ss.ledger.counts.total("loads_pinned") == 1
        assert h.garbage == []  # the forward read the loaded blocks after the load (S7)
        assert h.stats.outputs["b"] == h.expected_output(prompt, 3)
        assert h.stats.load_error_blocks == 0
        h.run()
        assert h.check_at_rest() == []
        assert h.check_store()[1] == 0


def test_on_a_cpu_engine_a_load_past_the_keys_default_runs_in_the_step(store_config: StoreConfig):
    """vLLM's KV cache on the CPU (the harness's DeviceConfig "cpu"), `sync_load_max_tokens` not set: a load
    of 320 tokens, past the key's accelerator default, still runs inside the step that schedules it."""
    prompt = _prompt(66, full_blocks=20)  # 320 tokens to load
    assert 20 * BS > BY_NAME["sync_load_max_tokens"].default
    with Harness(store_config, num_blocks=64, policy="fail") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        assert ss.sync_load_max_tokens == CPU_SYNC_LOAD_MAX_TOKENS
        _warm(h, prompt)
        h.add_request("b", prompt, 3)
        seen = _statuses(h, "b")
        assert "WAITING_FOR_REMOTE_KVS" not in seen and seen[0] == "RUNNING", seen
        assert ss.stats.total("loads_emitted") == ss.stats.total("sync_loads") == 1
        assert h.stats.outputs["b"] == h.expected_output(prompt, 3) and h.garbage == []
        h.run()
        assert h.check_at_rest() == []


def test_sync_load_max_tokens_zero_keeps_every_load_async(store_config: StoreConfig):
    prompt = _prompt(62)
    with Harness(store_config, num_blocks=24, policy="fail", extra={"sync_load_max_tokens": 0}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        h.add_request("b", prompt, 3)
        assert "WAITING_FOR_REMOTE_KVS" in _statuses(h, "b")
        assert ss.stats.total("loads_emitted") == 1 and ss.stats.total("sync_loads") == 0
        assert h.stats.outputs["b"] == h.expected_output(prompt, 3) and h.garbage == []
        h.run()
        assert h.check_at_rest() == []


def test_a_load_longer_than_the_limit_stays_async(store_config: StoreConfig):
    prompt = _prompt(63)  # 64 tokens to load
    with Harness(store_config, num_blocks=24, policy="fail", extra={"sync_load_max_tokens": 63}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        h.add_request("b", prompt, 3)
        assert "WAITING_FOR_REMOTE_KVS" in _statuses(h, "b")
        assert ss.stats.total("loads_emitted") == 1 and ss.stats.total("sync_loads") == 0
        h.run()
        assert h.check_at_rest() == []


def test_the_save_of_a_sync_loaded_request_waits_for_its_report(store_config: StoreConfig):
    """A request that loads 4 stored blocks and computes 3 more: no store job of it opens in the step of
    its load (its outcome is not known yet: a failed block would make the new blocks wrong); the next
    step's job covers the new blocks, and they reach the store."""
    stored = _prompt(64, full_blocks=4, extra_tokens=0)
    longer = stored + _prompt(65, full_blocks=3, extra_tokens=2)
    with Harness(store_config, tp_size=2, num_blocks=32, max_num_batched_tokens=256, policy="fail") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, stored + [7])
        opened: list[tuple[int, list[str]]] = []
        sent = h.workers[0].bind_connector_metadata

        def bind(meta: Any) -> None:  # a spy on the metadata vLLM hands the worker: unchanged
            opened.append((len(meta.loads), [s.req_id for s in meta.saves]))
            sent(meta)

        h.workers[0].bind_connector_metadata = bind  # type: ignore[method-assign]
        h.add_request("b", longer, 2)
        h.run()
        load_step = next(i for i, (n, _) in enumerate(opened) if n)
        assert "b" not in opened[load_step][1], opened
        assert "b" in opened[load_step + 1][1], opened
        assert ss.stats.total("sync_loads") == 1 and h.garbage == []
        assert h.stats.outputs["b"] == h.expected_output(longer, 2)
        checked, polluted = h.check_store()
        assert polluted == 0 and checked == 2 * 7  # both ranks hold all 7 full blocks of `longer`
        assert h.check_at_rest() == []


def test_a_failed_sync_load_is_reported_in_its_own_step(store_config: StoreConfig):
    """Every get fails on rank 1 (a test double injects the store's own TRANSFER_FAIL): the failed blocks
    reach vLLM in the output of the very step that scheduled the request, and under ``fail`` the request
    ends with an error; no read of wrong KV, nothing stays pinned, nothing wrong is stored."""
    prompt = _prompt(66)
    with Harness(store_config, tp_size=2, num_blocks=24, policy="fail") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        w1 = h.workers[1].worker_side
        w1.io.store = FaultyStore(w1.io.store, FaultPlan([FaultRule("get", "code",
                                                                          code=int(StoreCode.TRANSFER_FAIL))]))
        h.add_request("b", prompt, 3)
        seen = _statuses(h, "b")
        assert "WAITING_FOR_REMOTE_KVS" not in seen and ss.stats.total("sync_loads") == 1
        assert h.stats.load_error_blocks == 4
        assert h.stats.finished["b"] == "error"
        assert h.garbage == []
        h.run()
        assert h.check_at_rest() == []
        assert h.check_store()[1] == 0


def test_recompute_policy_keeps_every_load_async(store_config: StoreConfig):
    """Under ``recompute`` a short load waits in WAITING_FOR_REMOTE_KVS like a long one (vLLM would keep a
    failed sync load's blocks in its prefix cache): right output, no wrong KV."""
    prompt = _prompt(67)
    with Harness(store_config, tp_size=2, num_blocks=24, policy="recompute") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        h.add_request("b", prompt, 3)
        assert "WAITING_FOR_REMOTE_KVS" in _statuses(h, "b")
        assert ss.stats.total("loads_emitted") == 1 and ss.stats.total("sync_loads") == 0 and h.stats.load_error_blocks == 0
        assert h.stats.finished["b"] == "length" and h.stats.outputs["b"] == h.expected_output(prompt, 3)
        assert h.garbage == []
        h.run()
        assert h.check_at_rest() == []
        assert h.check_store()[1] == 0


def test_a_save_reading_a_block_of_a_failing_sync_load_never_stores_it(store_config: StoreConfig):
    """Two requests of one stored prompt admitted in one step: the first sync-loads it, the second hits the
    first's blocks in vLLM's prefix cache (cached when allocated, before they are loaded). Every get fails
    on rank 0 (a test double evicts the key first): both requests fail (``fail`` evicts the blocks), and
    the second's save, which would read those blocks, waits for the load's report and is then dropped:
    the keys stay absent instead of holding what the failed load left."""
    prompt = _prompt(68)
    with Harness(store_config, tp_size=2, num_blocks=32, max_num_batched_tokens=256, policy="fail") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        w0 = h.workers[0].worker_side
        w0.io.store = FaultyStore(w0.io.store, FaultPlan([FaultRule("get", "evict")]))
        h.add_request("a", prompt, 3)
        h.add_request("b", prompt, 3)
        h.run()
        assert ss.stats.total("loads_emitted") == ss.stats.total("sync_loads") == 1  # b's whole prefix was a prefix-cache hit on a's blocks
        assert h.stats.finished == {"warm": "length", "a": "error", "b": "error"}, h.stats.finished
        assert h.garbage == []
        assert h.check_at_rest() == []
        checked, polluted = h.check_store()
        assert polluted == 0 and checked == 4  # rank 1's four keys; rank 0's were evicted and not put again


def test_a_get_that_keeps_failing_is_loaded_once_then_recomputed(store_config: StoreConfig):
    """Every get fails on rank 1 (a test double injects the store's TRANSFER_FAIL on each call) while the
    keys stay in the store. Under ``recompute`` vLLM sends the request back to its queue and asks again; the
    lookup stops at the block that failed, so the request computes it instead of loading it without end."""
    prompt = _prompt(69)
    with Harness(store_config, tp_size=2, num_blocks=24, policy="recompute") as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _warm(h, prompt)
        w1 = h.workers[1].worker_side
        w1.io.store = FaultyStore(w1.io.store, FaultPlan([FaultRule(
            "get", "code", code=int(StoreCode.TRANSFER_FAIL))]))
        h.add_request("b", prompt, 3)
        h.run()
        assert ss.stats.total("loads_emitted") == 1 and h.stats.load_error_blocks == 4
        assert h.stats.finished["b"] == "length" and h.stats.outputs["b"] == h.expected_output(prompt, 3)
        assert h.garbage == [] and h.check_at_rest() == []
