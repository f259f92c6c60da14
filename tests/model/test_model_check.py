"""conformance.model_check: the fixed design passes, the legacy design and the mutants fail as expected
(real TLC on tla/KVLedger.tla), and counterexamples print as one-line-per-step stories."""
from pathlib import Path

import pytest

from conformance import model_check as mc
from conformance.engine.tlc import ModelValue, Record, TraceStep, run_tlc

HERE = Path(__file__).parent / "tla"
FAILING = [c for c in mc.CI if c.design != "fixed"]


def test_ci_set_has_legacy_bugs_and_three_mutants():
    legacy = {c.expect_violation for c in mc.CI if c.design == "legacy"}
    assert {"NoPollution", "NoStaleEffect", "LoadErrorsReported"} <= legacy
    assert len([c for c in mc.CI if c.design == "mutant"]) >= 3
    assert all(c.path.is_file() for c in mc.CI + mc.DEEP)


@pytest.mark.parametrize("check", FAILING, ids=[c.cfg for c in FAILING])
def test_legacy_and_mutants_fail_exactly_as_expected(check):
    row = mc.run_check(check, xmx="512m", timeout=300)
    assert row.error is None, row.error
    assert (row.result.exit_code, row.result.violated) == (check.expect_code, check.expect_violation)
    assert row.as_expected
    # a counterexample that starts in Init and whose steps carry lastAction
    assert row.result.trace[0].state["lastAction"]["name"] == "Init"
    assert all("name" in s.state["lastAction"] for s in row.result.trace)


def test_fixed_design_passes_where_legacy_pollutes():
    r = run_tlc(mc.SPEC, HERE / "MC_fixed_small.cfg", xmx="512m", timeout=300)
    assert (r.exit_code, r.violated) == (0, None)
    assert r.distinct and r.distinct > 100


def test_row_verdict_compares_code_and_name():
    c = mc.Check("X", "legacy", 12, "NoPollution", "test")
    from conformance.engine.tlc import TLCResult
    good = mc.Row(c, TLCResult("s", "c", 12, "invariant", 1.0, violated="NoPollution"))
    wrong_name = mc.Row(c, TLCResult("s", "c", 12, "invariant", 1.0, violated="RefCountExact"))
    passed = mc.Row(c, TLCResult("s", "c", 0, "ok", 1.0))
    assert good.as_expected and not wrong_name.as_expected and not passed.as_expected
    assert "FAIL" in mc.row_line(wrong_name) and "OK" in mc.row_line(good)


def test_story_lists_action_and_changes():
    r1, w1 = ModelValue("r1"), ModelValue("w1")
    s1 = {"x": {r1: 0}, "jp": {w1: ("queued", "none")}, "lastAction": Record(name="Init")}
    s2 = {"x": {r1: 1}, "jp": {w1: ("running", "none")},
          "lastAction": Record(name="DmaRead", w=w1, job=1)}
    lines = mc.story([TraceStep(1, "Initial predicate", s1), TraceStep(2, "DmaRead", s2)], back_to=1)
    assert lines[0].strip() == "1. Init()"
    assert "DmaRead(w=w1, job=1)" in lines[1]
    assert "x[r1]: 0->1" in lines[1] and "jp[w1][1]: queued->running" in lines[1]
    assert "back to state 1" in lines[2]


def test_unknown_config_is_one_clear_line(capsys):
    assert mc.main(["--only", "MC_nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown config 'MC_nope'" in err and err.count("\n") == 1
