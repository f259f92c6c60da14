"""conformance.verify: a thin orchestrator.  The stages here are fakes (plain functions returning an exit
code or raising) so the summary and exit-code logic can be checked without running TLC for minutes;
the real stage (model_check) is exercised by test_model_check.py."""
from conformance import verify


def _stages(monkeypatch, *stages):
    monkeypatch.setattr(verify, "STAGES", list(stages))


def test_all_pass_exits_zero(monkeypatch, capsys):
    _stages(monkeypatch, ("a", lambda argv: 0), ("b", lambda argv: 0))
    assert verify.main([]) == 0
    out = capsys.readouterr().out
    assert "PASS  a" in out and "PASS  b" in out and "-> PASS" in out


def test_failing_stage_fails_the_run(monkeypatch, capsys):
    _stages(monkeypatch, ("a", lambda argv: 0), ("b", lambda argv: 1))
    assert verify.main([]) == 1
    assert "FAIL  b" in capsys.readouterr().out


def test_crashing_stage_is_one_line_and_fails(monkeypatch, capsys):
    def boom(argv):
        raise RuntimeError("no store")
    _stages(monkeypatch, ("a", boom), ("b", lambda argv: 0))
    assert verify.main([]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == "verify: stage 'a' crashed: RuntimeError: no store"
    assert "PASS  b" in cap.out   # later stages still run


def test_model_check_is_the_first_stage():
    from conformance import model_check
    assert verify.STAGES[0][1] is model_check.main


def test_witnesses_are_the_second_stage_and_skipped_with_the_model_check(monkeypatch, capsys):
    from conformance import witness
    assert verify.STAGES[1][1] is witness.main
    ran = []
    monkeypatch.setattr(verify, "STAGES", [(n, (lambda argv, n=n: ran.append(n) or 0)) for n, _ in verify.STAGES])
    assert verify.main(["--skip-model-check"]) == 0
    assert ran == [n for n, _ in verify.STAGES[2:]]
