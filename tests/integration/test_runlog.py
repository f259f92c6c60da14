"""Trace validation of a real run's log (conformance.runlog + tla/TraceRuntime.tla): the log of vLLM's real
Scheduler with 2 ranks, preemptions, req_id reuse and store hits is accepted by TLC, and each corrupted copy
is rejected at exactly the corrupted event (or, for a missing event at the end, as "not at rest")."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from conformance import runlog
from conformance.engine import tracecheck
from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts


@pytest.fixture(scope="module")
def real_log(tmp_path_factory: pytest.TempPathFactory, mooncake: Any) -> tuple[list[dict[str, Any]], int]:
    cfg = StoreConfig(global_segment_size=128 << 20, local_buffer_size=4 << 20,
                      rpc_timeout_ms=2000).with_addresses(mooncake.master_address, mooncake.metadata_server)
    path = tmp_path_factory.mktemp("runlog") / "run.ndjson"
    prompts = shared_prefix_prompts(16, num_prefixes=3, prefix_len=48, suffix_len=20, seed=2)
    with Harness(cfg, tp_size=2, num_blocks=18, max_num_seqs=8, extra={"trace_path": str(path)}) as h:
        for _ in range(2):  # the same ids twice: req_id reuse after finish; the second pass hits the store
            for i, p in enumerate(prompts):
                h.add_request(f"req-{i}", p, 32)
            h.run()
        assert h.stats.preemptions > 0
        assert h.check_at_rest() == []
        cap = h.max_inflight_jobs
    return tracecheck.read_log(Path(path)), cap


def _check(events: list[dict[str, Any]], cap: int) -> tracecheck.TraceVerdict:
    return runlog.check_events(events, pin_cap=cap, expect_rest=True)


def _first(events: list[dict[str, Any]], action: str, **where: Any) -> int:
    return next(k for k, e in enumerate(events) if e["action"] == action
                and all(e.get(f) == v for f, v in where.items()))


def test_real_log_is_accepted(real_log):
    events, cap = real_log
    actions = {e["action"] for e in events}
    assert {"EmitStore", "Preempt", "Finish", "Receive", "DropGeneration", "DmaRead", "Put", "Report",
            "Collect", "Load"} <= actions
    assert {e["actor"] for e in events} == {"sched", "w0", "w1"}
    v = _check(events, cap)
    assert v.accepted, v.line("run.ndjson")
    assert v.events == len(events)


def _rejected_at(events: list[dict[str, Any]], cap: int, k: int) -> None:
    v = _check(events, cap)
    assert not v.accepted
    assert v.first_unmatched == k + 1, v.line("corrupted")  # k is 0-based


def test_duplicated_report_is_rejected_there(real_log):
    events, cap = real_log
    k = _first(events, "Report")
    _rejected_at(events[:k + 1] + [copy.deepcopy(events[k])] + events[k + 1:], cap, k + 1)


def test_collect_that_releases_a_pin_early_is_rejected_there(real_log):
    """ranks_left 2: one rank's report must not release the job (S2/S3: its pin outlives every read)."""
    events, cap = real_log
    k = next(k for k, e in enumerate(events) if e["action"] == "Collect" and e["ranks_left"])
    bad = copy.deepcopy(events)
    job = next(iter(bad[k]["ranks_left"]))
    bad[k]["released"].append(int(job))
    del bad[k]["ranks_left"][job]
    bad[k]["pinned_jobs"] -= 1
    _rejected_at(bad, cap, k)


def test_store_thread_reading_an_unreceived_job_is_rejected_there(real_log):
    events, cap = real_log
    k = _first(events, "DmaRead")
    rk = _first(events, "Receive", job=events[k]["job"], actor=events[k]["actor"])
    moved = events[:rk] + [events[k]] + [e for n, e in enumerate(events[rk:], rk) if n != k]
    _rejected_at(moved, cap, rk)


def test_wrong_store_verdict_is_rejected_there(real_log):
    """The verdict of a job follows its generation (S4): a live job skipped as stale (a lost save) is no
    model behaviour; nor is a stale job that runs, when the run had one."""
    events, cap = real_log
    k = _first(events, "DmaRead", dest="running")
    bad = copy.deepcopy(events)
    bad[k]["dest"] = "stale"
    _rejected_at(bad, cap, k)
    stale = [n for n, e in enumerate(events) if e["action"] == "DmaRead" and e["dest"] == "stale"]
    if stale:
        bad = copy.deepcopy(events)
        bad[stale[0]]["dest"] = "running"
        _rejected_at(bad, cap, stale[0])


def test_missing_drop_generation_is_not_at_rest(real_log):
    events, cap = real_log
    k = max(n for n, e in enumerate(events) if e["action"] == "DropGeneration")
    v = _check(events[:k] + events[k + 1:], cap)
    assert not v.accepted and v.matched == len(events) - 1
    assert "did not end at rest" in v.line("x")


def test_over_the_cap_is_rejected(real_log):
    """BoundedPins (S6): the same log under a cap below its peak of pinned jobs."""
    events, cap = real_log
    peak = max(e["pinned_jobs"] for e in events if e["action"] == "EmitStore")
    assert peak >= 2
    v = _check(events, peak - 1)
    assert not v.accepted
    k = _first(events, "EmitStore", pinned_jobs=peak)
    assert v.first_unmatched == k + 1, v.line("capped")


def test_connectors_of_one_process_share_one_sink_per_path(tmp_path):
    """kvledger_connector.telemetry.tracefile: one lock, one seq and the file order = the order of the emits."""
    import json

    from kvledger_connector.telemetry.tracefile import close_trace, open_trace
    path = str(tmp_path / "t.ndjson")
    sched, rank = open_trace(path), open_trace(path)
    assert sched is rank and sched.users == 2
    sched.emit("sched", "EmitStore", {"job": 0})
    rank.emit("w0", "Receive", {"job": 0})
    close_trace(sched)
    rank.emit("w0", "Report", {"job": 0})  # still open for the last user
    close_trace(rank)
    lines = [json.loads(x) for x in open(path).read().splitlines()]
    assert [(e["seq"], e["actor"], e["action"]) for e in lines] == [
        (0, "sched", "EmitStore"), (1, "w0", "Receive"), (2, "w0", "Report")]
    again = open_trace(path)
    assert again is not rank  # closed with its last user: a new sink
    close_trace(again)


def test_log_of_the_conformance_driver_is_refused_by_name():
    with pytest.raises(tracecheck.TraceCheckError, match="conformance driver"):
        runlog.normalize([{"seq": 0, "actor": "sched", "action": "Admit", "req_id": "r1", "generation": 1}])


def test_event_of_a_job_never_emitted_is_refused_by_name():
    emit = {"seq": 0, "actor": "sched", "action": "EmitStore", "job": 5, "req_id": "a", "generation": 0,
            "blocks": [1], "ranks_left": 1, "pinned_jobs": 1, "pinned_blocks": 1}
    recv = {"seq": 1, "actor": "w0", "action": "Receive", "job": 9, "req_id": "a", "generation": 0,
            "live": [9], "stale_on_arrival": False, "superseded": []}
    with pytest.raises(tracecheck.TraceCheckError, match="job 9 was never emitted"):
        runlog.normalize([emit, recv])


def test_emit_store_tail_becomes_the_model_jobs_tail():
    emit = {"seq": 0, "actor": "sched", "action": "EmitStore", "job": 0, "req_id": "a", "generation": 0,
            "blocks": [3, 1], "tail": [1], "ranks_left": 1, "pinned_jobs": 1, "pinned_blocks": 2}
    (rec,) = runlog.normalize([emit]).events
    assert rec["blocks"] == [3] and rec["tail"] == 1
    older = {k: v for k, v in emit.items() if k != "tail"}  # a log before the field: no tail
    (rec,) = runlog.normalize([older]).events
    assert rec["blocks"] == [3, 1] and rec["tail"] == 0
    with pytest.raises(tracecheck.TraceCheckError, match="is not pinned last"):
        runlog.normalize([{**emit, "tail": [3]}])
    # a block stored as several keys: a tail block per KV cache group, pinned last; the last is the model's
    hybrid = {**emit, "blocks": [3, 5, 1, 7], "tail": [1, 7], "pinned_blocks": 4}
    (rec,) = runlog.normalize([hybrid]).events
    assert rec["blocks"] == [3, 5, 1] and rec["tail"] == 7


def _tail_job_log(pool: Any) -> list[dict[str, Any]]:
    """The ledgers' log of one job that pins a partial tail, saved after its request finished."""
    from kvledger.scheduler import SchedulerLedger
    from kvledger.trace import ListTrace
    from kvledger.worker import WorkerLedger

    tr = ListTrace(check=True)
    s = SchedulerLedger(pool, world_size=1, max_inflight_jobs=4, max_pinned_blocks=16, trace=tr)
    w = WorkerLedger(0, max_live_jobs=4, trace=tr)
    t = [b.block_id for b in pool.get_new_blocks(3)]
    j = s.open_job("a", t[:2], tail_block_ids=t[2:], generation=0)
    w.register("a", j, generation=0)
    tr.emit("sched", "Finish", {"req_id": "a", "generation": 0})  # as the connector's scheduler side
    pool.free_blocks(reversed([pool.blocks[b] for b in t]))  # the table goes: the pins keep the blocks
    w.drop_generation("a", finished=True, generation=0)
    w.begin(j)
    w.record_saved(j, 48)
    w.finish(j)
    s.collect(w.take_completed())
    return tr.events


def test_job_with_a_partial_tail_is_accepted_with_and_without_the_field():
    from vllm.v1.core.block_pool import BlockPool

    events = _tail_job_log(BlockPool(num_gpu_blocks=6, enable_caching=False, hash_block_size=16))
    assert events[0]["tail"] == events[0]["blocks"][2:]
    assert _check(events, 4).accepted
    assert _check([{k: v for k, v in e.items() if k != "tail"} for e in events], 4).accepted


def _load_collect(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(k of a CollectLoad that releases exactly one load, k of that request's last Load event before it)."""
    for kc, e in enumerate(events):
        if e["action"] == "CollectLoad" and len(e["completed"]) == 1 and e["released"]:
            req = e["released"][0]
            kl = max((k for k in range(kc) if events[k]["action"] == "Load" and events[k]["req_id"] == req),
                     default=None)
            if kl is not None:
                return kc, kl
    raise AssertionError("the real run released no load pin")


def test_real_log_has_load_pins(real_log):
    events, _ = real_log
    pins = [e for e in events if e["action"] == "EmitLoad"]
    released = [r for e in events if e["action"] == "CollectLoad" for r in e["released"]]
    assert pins and sorted(e["req_id"] for e in pins) == sorted(released)  # every load pin released once


def test_load_after_its_pin_was_released_is_rejected_there(real_log):
    """S9 LoadsPinned: a rank's Load event (it wrote the load's blocks) after the CollectLoad that dropped
    the load's pins is a write into blocks the pool may have reused."""
    events, cap = real_log
    kc, kl = _load_collect(events)
    bad = events[:kl] + [events[kc]] + events[kl:kc] + events[kc + 1:]
    _rejected_at(bad, cap, kl + 1)


def test_collect_load_releasing_before_every_rank_is_rejected_there(real_log):
    """vLLM reports a load in finished_recving once every rank finished it; a release on one rank's count
    (ranks_left 2 -> 1) would drop the pins under the other rank's writes."""
    events, cap = real_log
    kc, _ = _load_collect(events)
    bad = copy.deepcopy(events)
    (req,) = bad[kc]["completed"]
    bad[kc]["completed"][req] = 1
    _rejected_at(bad, cap, kc)
