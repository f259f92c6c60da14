"""conformance.verify: a thin orchestrator.  The stages here are fakes (plain functions returning a
StageResult or raising) so the summary and exit-code logic can be checked without running TLC for minutes;
the real stages are exercised by test_model_check.py, test_witness.py and the conformance suite."""
import json
import subprocess
from pathlib import Path

import pytest

from conformance import verify
from conformance.verify import Stage, StageResult, StageResultError
from testbed.demo import DemoResult


def _stages(monkeypatch, *stages):
    monkeypatch.setattr(verify, "STAGES", list(stages))


def _fake(key, ok=True, detail="", code=None):
    return Stage(key, key, lambda done: StageResult(key, ok, {"n": 1}, detail, exit_code=code))


def test_all_pass_exits_zero(monkeypatch, capsys):
    _stages(monkeypatch, _fake("a"), _fake("b"))
    assert verify.main([]) == 0
    out = capsys.readouterr().out
    assert "PASS  a" in out and "PASS  b" in out and "-> PASS" in out


def test_failing_stage_fails_the_run_with_its_exit_code(monkeypatch, capsys):
    _stages(monkeypatch, _fake("a"), _fake("b", ok=False, code=3))
    assert verify.main([]) == 3
    out = capsys.readouterr().out
    assert "FAIL  b" in out and "exit 3" in out and "-> FAIL" in out


def test_crashing_stage_is_one_line_and_fails(monkeypatch, capsys):
    def boom(done):
        raise RuntimeError("no store")
    _stages(monkeypatch, Stage("a", "a", boom), _fake("b"))
    assert verify.main([]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == "verify: stage 'a' crashed: RuntimeError: no store"
    assert "PASS  b" in cap.out   # later stages still run


def test_summary_joins_the_stage_details_in_order(monkeypatch, capsys):
    _stages(monkeypatch, _fake("m"), _fake("x", detail="5/5 behaviours"), _fake("y", detail="2/2 logs"))
    verify.main([])
    lines = capsys.readouterr().out.splitlines()
    assert "  conformance: 5/5 behaviours; 2/2 logs" in lines
    assert lines[-1].startswith("  total ") and lines[-1].endswith("-> PASS")


def test_a_stage_gets_the_earlier_results(monkeypatch):
    seen = {}

    def second(done):
        seen.update(done)
        return StageResult("b", True)
    first = Stage("a", "a", lambda done: StageResult("a", True, logs=(Path("x.ndjson"),)))
    _stages(monkeypatch, first, Stage("b", "b", second))
    assert verify.main([]) == 0
    assert seen["a"].logs == (Path("x.ndjson"),)


def test_trace_stage_without_replay_logs_fails():
    res = verify.trace_stage({})
    assert not res.ok and res.figures["logs"] == 0


def test_inconsistent_result_is_refused():
    with pytest.raises(StageResultError, match="ok=True with exit_code=1"):
        StageResult("s", True, exit_code=1)
    assert StageResult("s", False).code == 1 and StageResult("s", True).code == 0


def test_model_stages_first_and_skipped_with_the_model_check(monkeypatch, capsys):
    assert [st.run for st in verify.STAGES[:2]] == [verify.model_check_stage, verify.witness_stage]
    assert all(st.model for st in verify.STAGES[:2]) and not any(st.model for st in verify.STAGES[2:])
    ran = []
    monkeypatch.setattr(verify, "STAGES", [Stage(st.key, st.name, (lambda done, k=st.key: ran.append(k)
                                                                    or StageResult(k, True)), st.model)
                                           for st in verify.STAGES])
    assert verify.main(["--skip-model-check"]) == 0
    assert ran == [st.key for st in verify.STAGES[2:]]
    ran.clear()
    assert verify.main(["--only", "mutants", "--only", "replay"]) == 0
    assert ran == ["replay", "mutants"]   # in stage order


def _demo_result(**kw):
    base = dict(ok=True, requests=7, tp=3, cap_jobs=2, figures={"requests": 14, "loads": 4},
                rows=(("requests", "14"), ("trace validation", "TLC: ACCEPTED x: all 9 events match")),
                trace_path="x.ndjson", trace_accepted=True, trace_verdict="ACCEPTED x: all 9 events match")
    base.update(kw)
    return DemoResult(**base)


def test_demo_result_round_trips_and_names_a_missing_field():
    r = _demo_result()
    assert DemoResult.from_json(r.to_json()) == r
    d = json.loads(r.to_json())
    del d["cap_jobs"]
    with pytest.raises(ValueError, match="'cap_jobs' is missing"):
        DemoResult.from_json(json.dumps(d))


def test_real_run_stage_takes_its_figures_from_the_demo_result(monkeypatch, tmp_path, capsys):
    """A fake demo (no vLLM, no TLC: it only writes a DemoResult) and no log: the figures come from the
    result file, and a log that cannot be corrupted fails the stage."""
    monkeypatch.setattr(verify, "ROOT", tmp_path)

    def fake_run(cmd, **kw):
        out = Path(cmd[cmd.index("--result-json") + 1])
        out.write_text(_demo_result().to_json())
        return subprocess.CompletedProcess(cmd, 0, stdout="progress bars\n")
    monkeypatch.setattr(verify.subprocess, "run", fake_run)
    res = verify.real_run_stage({})
    assert res.detail.startswith("demo log (7 requests x 2, tp=3) ACCEPTED x: all 9 events match;")
    assert res.figures["loads"] == 4 and res.figures["corrupted_line"] == -1
    assert not res.ok and "NOT rejected" in res.detail
    assert "  trace validation     TLC: ACCEPTED" in capsys.readouterr().out


def test_real_run_stage_fails_when_the_demo_writes_no_result(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(verify, "ROOT", tmp_path)
    monkeypatch.setattr(verify.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, -6, stdout="Fatal Python error\n"))
    res = verify.real_run_stage({})
    assert not res.ok and res.figures["demo_exit"] == -6
    assert "the demo wrote no result (exit -6)" in capsys.readouterr().out
