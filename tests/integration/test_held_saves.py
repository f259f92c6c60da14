"""A save the caps deferred survives its request's finish: `request_finished` asks vLLM to keep the request's
blocks (delay the free) until the save is stored, then every rank answers the request's finish notice in
finished_sending and vLLM frees them (`SchedulerSteps.request_finished`, `held_release_due`, `release_held`).
The number held is bounded by `max_held_requests`; past it the finishing request's deferred save is given up.

Real vLLM Scheduler and BlockPool, 2 ranks, a real Mooncake master; every put slowed by a test double
(`testbed.faults.RawClientFaults`) so that requests finish while the pin caps defer their saves."""
from __future__ import annotations

from typing import Any

from kvledger_connector.config import StoreConfig
from testbed.faults import stored_keys_of_requests, wrap_raw_clients
from testbed.harness import Harness, shared_prefix_prompts

PROMPTS = shared_prefix_prompts(12, num_prefixes=3, prefix_len=48, suffix_len=24, seed=11)
SLOW_PUT_S = 0.02
CAPS = {"max_inflight_jobs": 1, "max_pinned_blocks": 8}


def _stored(h: Harness) -> tuple[int, int]:
    """(keys of the requests seen that the store holds, keys it may hold)."""
    keys = stored_keys_of_requests(h)
    return sum(1 for c in h.checker().batch_is_exist(keys) if c == 1), len(keys)


def _harness(store_config: StoreConfig, **extra: Any) -> Harness:
    return Harness(store_config, tp_size=2, num_blocks=32, max_model_len=128, extra={**CAPS, **extra})


def _run(h: Harness) -> Any:
    wrap_raw_clients(h, put_delay_s=SLOW_PUT_S)
    h.run_pass(PROMPTS, 2, tag="a")  # two decode steps: most requests finish before their save is admitted
    return h.scheduler_connector.scheduler_side.steps


def test_a_save_deferred_past_its_finish_is_stored_and_hits(store_config: StoreConfig):
    with _harness(store_config) as h:
        ss = _run(h)
        # requests finished while the caps deferred their saves: held, not dropped
        assert ss.stats.total("held_requests") > 0 and ss.stats.total("saves_dropped") == 0
        assert ss.num_held_requests == 0 and not ss.has_pending_push_work()
        stored, total = _stored(h)
        assert stored == total, f"{total - stored} of {total} keys never stored"
        h.scheduler.reset_prefix_cache()  # pass b's hits come from the store
        hit0 = h.scheduler_connector.stats.total("lookup_hit_tokens")
        h.run_pass(PROMPTS, 2, tag="b")
        full = sum(len(p) // h.block_size * h.block_size for p in PROMPTS)
        store = h.scheduler_connector.stats.total("lookup_hit_tokens") - hit0
        local = sum(h.stats.local_hit_tokens.get(f"b-{i}", 0) for i in range(len(PROMPTS)))
        # every prompt's full blocks hit (vLLM recomputes a prompt's last token: a whole-prompt hit is one short),
        # from the store or from vLLM's cache, which a prompt of the same prefix filled from the store when it
        # was scheduled in an earlier step (the steps depend on when the slowed puts release their pins)
        assert store + local >= full - len(PROMPTS) * h.block_size, (store, local)
        # and at least each prefix's whole prompt blocks came from the store (3 prefixes of 48 tokens)
        assert store >= 3 * 48, store


def test_held_requests_are_bounded(store_config: StoreConfig):
    with _harness(store_config, max_held_requests=1) as h:
        ss = _run(h)
        assert ss.peak_held_requests == 1 and ss.stats.total("held_requests") > 0
        assert ss.stats.total("saves_dropped") > 0  # past the bound: given up, counted, everything drains
        stored, total = _stored(h)
        assert stored < total
        assert ss.num_held_requests == 0 and h.check_at_rest() == []


def test_zero_held_requests_gives_every_deferred_save_up(store_config: StoreConfig):
    """``max_held_requests: 0``: the free is never delayed; a save deferred at its request's finish is lost
    (the behaviour before holding, kept for operators who prefer free blocks to stored keys)."""
    with _harness(store_config, max_held_requests=0) as h:
        ss = _run(h)
        assert ss.stats.total("held_requests") == 0 and ss.stats.total("saves_dropped") > 0
        assert _stored(h)[0] < _stored(h)[1]
