"""conformance.engine.tlc: TLC's value syntax, -tool messages and exit codes, on tiny specs with real TLC."""
from pathlib import Path

import pytest

from conformance.engine import tlc
from conformance.engine.tlc import (Function, ModelValue, Record, TLCSetupError, TLCValueError, parse_state,
                             parse_value, run_tlc)

HERE = Path(__file__).parent / "tla"


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("text, want", [
    ("42", 42),
    ("-7", -7),
    ('"a b"', "a b"),
    ('"say \\"hi\\""', 'say "hi"'),
    ("TRUE", True),
    ("FALSE", False),
    ("r1", ModelValue("r1")),
    ("<<>>", ()),
    ("<<1, <<2, 3>>>>", (1, (2, 3))),
    ("{}", frozenset()),
    ("{1, 2, 2}", frozenset({1, 2})),
    ("[name |-> \"EmitStore\", r |-> r1, job |-> 3]",
     {"name": "EmitStore", "r": ModelValue("r1"), "job": 3}),
    ("(r1 :> 0 @@ r2 :> 1)", {ModelValue("r1"): 0, ModelValue("r2"): 1}),
    ("(1 :> {<<1, 2>>})", {1: frozenset({(1, 2)})}),
    ("((7))", 7),
])
def test_parse_value(text, want):
    assert parse_value(text) == want


def test_values_are_typed_and_hashable():
    v = parse_value("{[a |-> 1], [a |-> 2]}")
    assert all(isinstance(x, Record) for x in v) and len(v) == 2
    f = parse_value("(r1 :> [q |-> <<>>])")
    assert isinstance(f, Function) and isinstance(next(iter(f)), ModelValue)
    assert hash(f) == hash(parse_value("(r1 :> [q |-> <<>>])"))


@pytest.mark.parametrize("bad", ["[a 1]", "<<1,", "(1 :> 2 @@)", "1 2", "%"])
def test_parse_value_rejects_garbage(bad):
    with pytest.raises(TLCValueError):
        parse_value(bad)


def test_parse_state_wrapped_lines():
    text = '/\\ x = 1\n/\\ f = ( r1 :> [a |-> 1,\n       b |-> 2] @@\n  r2 :> [a |-> 3, b |-> 4] )\n/\\ s = {}\n'
    assert parse_state(text) == {"x": 1, "f": {ModelValue("r1"): {"a": 1, "b": 2},
                                              ModelValue("r2"): {"a": 3, "b": 4}}, "s": frozenset()}


def test_parse_messages_and_interpret_without_tlc():
    out = ("@!@!@STARTMSG 2110:1 @!@!@\nInvariant NoPollution is violated.\n@!@!@ENDMSG 2110 @!@!@\n"
           "@!@!@STARTMSG 2217:4 @!@!@\n1: <Initial predicate>\n/\\ x = 0\n\n@!@!@ENDMSG 2217 @!@!@\n"
           "@!@!@STARTMSG 2217:4 @!@!@\n2: <Inc line 1, col 1 to line 1, col 9 of module M>\n/\\ x = 1\n\n"
           "@!@!@ENDMSG 2217 @!@!@\n"
           "@!@!@STARTMSG 2199:0 @!@!@\n1,234 states generated, 567 distinct states found, 0 states left on queue.\n"
           "@!@!@ENDMSG 2199 @!@!@\n"
           "@!@!@STARTMSG 2194:0 @!@!@\nThe depth of the complete state graph search is 9.\n@!@!@ENDMSG 2194 @!@!@\n")
    r = tlc.interpret("M.tla", "M.cfg", 12, out, 0.5)
    assert (r.outcome, r.violated, r.distinct, r.generated, r.depth) == ("invariant", "NoPollution", 567, 1234, 9)
    assert [(s.index, s.action_name, s.state) for s in r.trace] == [(1, "Init", {"x": 0}), (2, "Inc", {"x": 1})]


@pytest.mark.parametrize("code, outcome", [(0, "ok"), (11, "deadlock"), (12, "invariant"), (13, "liveness"),
                                           (75, "eval_error"), (77, "eval_error"), (150, "parse_error"),
                                           (151, "config_error"), (255, "other_error"), (99, "other_error")])
def test_exit_code_table(code, outcome):
    assert tlc.interpret("s", "c", code, "", 0.0).outcome == outcome


# ---------------------------------------------------------------- real TLC on tiny specs
def _run(cfg, spec="Tiny", **kw):
    return run_tlc(HERE / f"{spec}.tla", HERE / f"{cfg}.cfg", xmx="256m", timeout=120, **kw)


def test_ok_counts_states_and_depth():
    r = _run("Ok", extra_args=["-deadlock"])
    assert (r.exit_code, r.outcome, r.distinct, r.depth, r.violated) == (0, "ok", 4, 4, None)


def test_invariant_violation_gives_named_shortest_trace():
    r = _run("Invariant")
    assert (r.exit_code, r.violated) == (12, "Small")
    assert [s.state["x"] for s in r.trace] == [0, 1, 2]
    assert r.trace[-1].state["lastAction"] == {"name": "Inc", "by": 1}


def test_deadlock_exit_code():
    r = _run("Deadlock")
    assert (r.exit_code, r.outcome, r.violated) == (11, "deadlock", "deadlock")


def test_liveness_needs_fairness():
    assert _run("LiveOk", extra_args=["-deadlock"]).exit_code == 0
    r = _run("Liveness", extra_args=["-deadlock"])
    assert (r.exit_code, r.outcome) == (13, "liveness") and r.stuttering and r.trace


def test_action_property_violation_is_named():
    r = _run("ActionProp", extra_args=["-deadlock"])
    assert (r.exit_code, r.violated) == (13, "StepsByTwo")


def test_eval_error_is_a_verdict():
    assert _run("EvalError").exit_code == 75


def test_parse_error_is_one_clear_line():
    with pytest.raises(TLCSetupError) as e:
        _run("Broken", spec="Broken")
    msg = str(e.value)
    assert e.value.exit_code == 150 and "\n" not in msg
    assert "parse error" in msg and "Broken.tla" in msg and "line 4" in msg


def test_unknown_config_name_is_one_clear_line():
    with pytest.raises(TLCSetupError) as e:
        _run("BadConfig")
    assert e.value.exit_code == 151 and "\n" not in str(e.value) and "Nxt" in str(e.value)


def test_missing_config_file():
    with pytest.raises(TLCSetupError, match="config not found: .*NoSuch.cfg"):
        _run("NoSuch")


def test_missing_java(monkeypatch):
    with pytest.raises(TLCSetupError, match="java not found"):
        _run("Ok", java="no-such-java-binary")


def test_jar_checksum_mismatch(tmp_path):
    fake = tmp_path / "tla2tools.jar"
    fake.write_bytes(b"not the TLC jar")
    with pytest.raises(TLCSetupError, match="sha256") as e:
        _run("Ok", jar=fake)
    assert "make setup" in str(e.value) and "\n" not in str(e.value)


def test_missing_jar(tmp_path):
    with pytest.raises(TLCSetupError, match="jar missing"):
        _run("Ok", jar=tmp_path / "absent.jar")


def test_tlc_leaves_no_files_behind():
    before = set(HERE.iterdir())
    _run("Invariant")
    assert set(HERE.iterdir()) == before
    assert not any(tlc.TLC_OUT.glob("Tiny-Invariant-*"))
