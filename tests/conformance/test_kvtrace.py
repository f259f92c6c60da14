"""Trace validation of real runtime logs with TLC: kvledger's ledgers (on vLLM's BlockPool, torch KV
rows, a real Mooncake master) log NDJSON through kvledger.trace while TLC's simulated behaviours of
tla/MC_conformance_sim.cfg (2 requests, 2 ranks, preemption, store faults) are replayed; the driver
logs what the scheduler and store did. TLC accepts the logs against tla/KVLedger.tla, and a log
corrupted at one event is rejected at exactly that event (its runtime seq)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.engine import export as ex
from conformance import kvtrace
from conformance.engine import tracecheck as tc
from kvledger.trace import ListTrace
from kvledger.worker import WorkerLedger

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "tla" / "MC_conformance_sim.cfg"


@pytest.fixture(scope="module")
def logs(tmp_path_factory, mooncake_backend) -> list[Path]:
    exp = ex.simulated_export(CFG.parent, "KVLedger", CFG.name, num=40, depth=60, seed=3, log=print)
    return kvtrace.record_logs(exp, mooncake_backend, tmp_path_factory.mktemp("traces"),
                               kvtrace.interesting(exp, 2))


def _events(path: Path) -> list[dict]:
    return tc.read_log(path)


def test_runtime_logs_accepted(logs: list[Path]) -> None:
    for log in logs:
        evs = _events(log)
        acts = {e["action"] for e in evs}
        assert {"EmitStore", "Receive", "DmaRead", "Put", "Report", "Collect", "DropGeneration"} <= acts
        v = kvtrace.check_log(log, CFG)
        assert v.accepted, v.line(log.name)
        assert v.matched == v.events > 20


def _first(evs: list[dict], pred) -> int:
    return next(k for k, e in enumerate(evs) if pred(e))


CORRUPTIONS = {
    # a put that stored is logged as failed
    "put_outcome": (lambda e: e["action"] == "Put" and e["dest"] == "stored",
                    lambda e: {**e, "dest": "failed"}),
    # EmitStore claims one rank fewer must report (a pin released one report early)
    "ranks_left": (lambda e: e["action"] == "EmitStore",
                   lambda e: {**e, "ranks_left": e["ranks_left"] - 1}),
    # a Receive that registered the job live logs an empty live set
    "receive_live": (lambda e: e["action"] == "Receive" and e["live"],
                     lambda e: {**e, "live": []}),
    # a job that pinned the prompt's partial tail logs none (PartialTail = TRUE in the config)
    "emit_tail": (lambda e: e["action"] == "EmitStore" and e.get("tail"),
                  lambda e: {**e, "tail": []}),
    # Collect released nothing although a job's last report came in
    "collect_released": (lambda e: e["action"] == "Collect" and e["released"],
                         lambda e: {**e, "released": []}),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_log_rejected_at_the_event(logs: list[Path], kind: str) -> None:
    pred, corrupt = CORRUPTIONS[kind]
    evs = _events(logs[0])
    k = _first(evs, pred)
    bad = list(evs)
    bad[k] = corrupt(evs[k])
    v = kvtrace.check_events(bad, CFG)
    assert not v.accepted
    assert v.first_unmatched_seq == evs[k]["seq"], v.line(kind)
    assert f"seq {evs[k]['seq']} of the log" in v.line(kind)


def test_log_without_tail_field_still_checked(logs: list[Path]) -> None:
    evs = _events(logs[0])
    assert any(e["action"] == "EmitStore" and e["tail"] for e in evs)  # the config's jobs carry tails
    older = [{k: v for k, v in e.items() if k != "tail"} for e in evs]  # as a log before the field
    assert kvtrace.check_events(older, CFG).accepted


def test_duplicate_report_rejected(logs: list[Path]) -> None:
    evs = _events(logs[0])
    k = _first(evs, lambda e: e["action"] == "Report")
    dup = {**evs[k], "seq": 10_000}
    v = kvtrace.check_events(evs[:k + 1] + [dup] + evs[k + 1:], CFG)
    assert not v.accepted and v.first_unmatched_seq == 10_000, v.line()


def test_log_file_round_trip_and_cli(logs: list[Path], capsys) -> None:
    assert kvtrace.main([str(logs[0]), "--cfg", str(CFG)]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED" in out and "[trace] 1/1 logs accepted" in out
    assert kvtrace.main([str(logs[0])]) == 0  # the default --cfg is the config the logs ran under


def test_unknown_action_and_missing_field_named(logs: list[Path]) -> None:
    evs = _events(logs[0])
    with pytest.raises(tc.TraceCheckError, match="'Frobnicate' is not in the shared vocabulary"):
        kvtrace.check_events(evs + [{"seq": 99, "actor": "sched", "action": "Frobnicate"}], CFG)
    k = _first(evs, lambda e: e["action"] == "Put")
    broken = {x: y for x, y in evs[k].items() if x != "offset"}
    with pytest.raises(tc.TraceCheckError, match="lacks the field 'offset'"):
        kvtrace.check_events(evs[:k] + [broken], CFG)


def test_every_consumed_notice_is_logged() -> None:
    """A notice with nothing to drop (never saved on this rank, or a late one) is logged as
    DropGeneration dest 'none': the model takes a DropGeneration step for it too."""
    tr = ListTrace()
    led = WorkerLedger(0, max_live_jobs=4, trace=tr)
    assert led.drop_generation("r", finished=True, generation=1) is None
    led.register("r", 1, generation=2)
    assert led.drop_generation("r", finished=False, generation=1) is None  # late: older generation
    evs = [e for e in tr.events if e["action"] == "DropGeneration"]
    assert [(e["dest"], e["notice_generation"]) for e in evs] == [("none", 1), ("none", 1)]
    json.dumps(tr.events)
