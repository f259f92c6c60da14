"""No scheduler hook raises into vLLM's step: vLLM 0.32.0's real Scheduler (testbed.harness, 2 ranks, a real
Mooncake master) drives the connector while each hook meets an input it cannot serve. The faults are TEST
DOUBLES that make one step function raise (what a table, a request or a report vLLM never hands over would
do), or reports no rank sent (an unknown job, a duplicate, a load never emitted). Each becomes a cache miss, a
load reported failed, a save given up or a report set aside, counted in ``hook_errors``; the harness checks
every request's output (S7: no forward on a block never loaded) and that nothing is pinned at rest."""
from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

from kvledger_connector.config import StoreConfig
from kvledger_connector.metadata import KVLedgerWorkerMetadata
from testbed.harness import Harness, shared_prefix_prompts

PROMPTS = shared_prefix_prompts(4, num_prefixes=1, prefix_len=64, suffix_len=12, seed=3)


def _raise_once(obj: Any, name: str, only: set[str] | None = None) -> list[str]:
    """TEST DOUBLE: `obj.name` raises at its first call (for a req_id in `only`, if given); the req_ids hit."""
    real = getattr(obj, name)
    hit: list[str] = []

    def faulty(request_or_saves: Any, *a: Any, **kw: Any) -> Any:
        req_id = getattr(request_or_saves, "request_id", a[0] if a and isinstance(a[0], str) else None)
        if not hit and (only is None or req_id in only):
            hit.append(str(req_id))
            raise ValueError(f"{name}: an input this step cannot serve")
        return real(request_or_saves, *a, **kw)
    setattr(obj, name, faulty)
    return hit


def _warm(h: Harness) -> Any:
    h.run_pass(PROMPTS[:1], 4, tag="warm")  # the shared prefix is saved by both ranks
    h.scheduler.reset_prefix_cache()  # later hits come from the store
    return h.scheduler_connector.scheduler_side.steps


def test_a_load_the_steps_cannot_plan_is_reported_failed_and_recomputed(store_config: StoreConfig):
    with Harness(store_config, tp_size=2, num_blocks=48, extra={"sync_load_max_tokens": 0}) as h:
        ss = _warm(h)
        hit = _raise_once(ss, "emit_load")
        h.run_pass(PROMPTS[1:3], 4, tag="b")  # outputs checked: the refused load's blocks were recomputed
        assert hit and ss.stats.total("refused_loads") == 1 and h.scheduler_connector.stats.total("hook_errors") == 1
        assert sum(w.stats.total("rejected_loads") for w in h.workers) == 2  # every rank reported it failed
        assert h.garbage == [] and h.check_at_rest() == []


def test_a_sync_load_the_steps_cannot_plan_fails_its_request_under_fail(store_config: StoreConfig):
    """Sync loads run only under ``kv_load_failure_policy`` "fail": the refused load's blocks are reported
    failed, so vLLM fails the request (and any other that read those blocks through its prefix cache in
    that step, as for any failed sync load); none computes on them."""
    with Harness(store_config, tp_size=2, num_blocks=48, policy="fail", extra={"sync_load_max_tokens": 1024}) as h:
        ss = _warm(h)
        hit = _raise_once(ss, "emit_load")
        h.add_request("b-0", PROMPTS[1], 4)
        h.run()
        assert hit == ["b-0"] and ss.stats.total("refused_loads") == 1
        assert h.stats.finished["b-0"] == "error"
        assert h.garbage == [] and h.check_at_rest() == []
        h.run_pass(PROMPTS[2:3], 4, tag="c")  # the engine goes on, its hit loaded from the store
        assert ss.stats.total("loads_emitted") == 1  # (async: the one load outcome so far was a failure, `loads_mostly_fail`)


def test_a_save_the_steps_cannot_plan_is_given_up_and_the_steps_other_saves_go_out(store_config: StoreConfig):
    with Harness(store_config, tp_size=2, num_blocks=48) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        hit = _raise_once(ss, "emit_store", only={"a-0"})
        h.run_pass(PROMPTS[:3], 4, tag="a")
        assert hit == ["a-0"] and h.scheduler_connector.stats.total("save_errors") == 1
        assert ss.stats.total("saves_dropped") == 1 and h.scheduler_connector.stats.total("store_jobs") >= 2
        assert h.garbage == [] and h.check_at_rest() == []


def test_a_lookup_that_raises_is_a_miss_and_requests_vllm_never_sends_are_set_aside(store_config: StoreConfig):
    with Harness(store_config, tp_size=2, num_blocks=48) as h:
        ss = _warm(h)
        conn = h.scheduler_connector
        _raise_once(ss, "ask")
        h.run_pass(PROMPTS[1:2], 4, tag="b")  # its lookup missed: computed, output checked
        assert conn.stats.total("hook_errors") == 1 and ss.stats.total("loads_emitted") == 0
        # TEST DOUBLE: an object that is no vLLM Request, at every hook that takes one
        alien = object()
        conn.on_new_request(alien)  # type: ignore[arg-type]
        assert conn.get_num_new_matched_tokens(alien, 0) == (0, False)  # type: ignore[arg-type]
        conn.update_state_after_alloc(alien, alien, 16)  # type: ignore[arg-type]
        assert conn.request_finished(alien, []) == (False, None)  # type: ignore[arg-type]
        assert conn.stats.total("hook_errors") == 1 + 5  # the refused load could not name its request either
        assert ss.stats.total("refused_loads") == 0 and not ss.has_pending_loads()
        h.reset_prefix_cache_when_idle()  # pass b computed the prompt: the hit comes from the store again
        h.run_pass(PROMPTS[2:3], 4, tag="c")  # the engine goes on: its hit loaded from the store
        assert ss.stats.total("loads_emitted") == 1
        assert h.garbage == [] and h.check_at_rest() == []


@pytest.mark.runlog_unchecked("it feeds the ledger reports no rank sent: the model has no step for them")
def test_reports_no_rank_sent_are_set_aside_and_pins_are_kept(store_config: StoreConfig):
    with Harness(store_config, tp_size=2, num_blocks=48) as h:
        ss = _warm(h)
        conn = h.scheduler_connector
        before = conn.stats.total("hook_errors")
        bad = [
            KVConnectorOutput(kv_connector_worker_meta=KVLedgerWorkerMetadata(completed_saves={10 ** 6: 1})),
            KVConnectorOutput(finished_recving={"never-loaded"}),
            KVConnectorOutput(invalid_block_ids={10 ** 6}, failed_recving={"never-loaded"}),
            KVConnectorOutput(kv_connector_worker_meta=KVLedgerWorkerMetadata(completed_loads={"never": 1})),
            KVConnectorOutput(kv_connector_worker_meta=object()),  # type: ignore[arg-type]
        ]
        unknown = ss.ledger.counts.total("unknown_reports")
        for out in bad:
            conn.update_connector_output(out)  # never raises into vLLM's update_from_output
        # a load never emitted (twice) and a metadata of another kind; an unknown job's report is counted by
        # the ledger (a job of before a restart), and unknown blocks or failed loads are another connector's
        assert conn.stats.total("hook_errors") - before == 3
        assert ss.ledger.counts.total("unknown_reports") == unknown + 1
        h.add_request("x", PROMPTS[1], 4)
        h.step()  # a job is in flight: its report, twice, releases it once and never below 0 (S5)
        jobs = ss.ledger.inflight_jobs()
        if jobs:
            dup = KVConnectorOutput(kv_connector_worker_meta=KVLedgerWorkerMetadata(
                completed_saves={jobs[0]: 3}))
            conn.update_connector_output(dup)  # more ranks than the world: refused, the pin kept
            assert jobs[0] in ss.ledger.inflight_jobs()
        h.run()
        assert h.garbage == [] and h.check_at_rest() == []
