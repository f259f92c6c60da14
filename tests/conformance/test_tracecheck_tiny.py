"""Trace validation machinery on the tiny spec, with real TLC: a log the model can produce is
accepted; a corrupted log is rejected at the first event the model cannot match."""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.engine import tracecheck as tc

TINY = Path(__file__).parent / "tiny"


def check(events):
    return tc.check_events(events, "TraceTinyPin", "TraceTinyPin.cfg", spec_dirs=[TINY])


GOOD = [
    {"action": "EmitStore", "job": 1},
    {"action": "EmitStore", "job": 2},
    {"action": "Report", "w": "w1", "job": 2},
    {"action": "Report", "w": "w0", "job": 2},
    {"action": "Report", "w": "w0", "job": 1},
    {"action": "Collect", "job": 2},
    {"action": "Report", "w": "w1", "job": 1},
    {"action": "Collect", "job": 1},
]


def test_good_log_accepted() -> None:
    v = check(GOOD)
    assert v.accepted, v.line()
    assert v.matched == len(GOOD) and v.first_unmatched is None


@pytest.mark.parametrize("bad_at, bad", [
    (6, {"action": "Collect", "job": 1}),             # w1 has not reported job 1 yet
    (3, {"action": "Report", "w": "w1", "job": 3}),   # job 3 was never emitted
    (2, {"action": "EmitStore", "job": 7}),           # ids are monotonic: next is 2
])
def test_corrupted_log_rejected_at_the_event(bad_at: int, bad: dict) -> None:
    events = list(GOOD)
    events[bad_at - 1] = bad
    v = check(events)
    assert not v.accepted
    assert v.first_unmatched == bad_at, v.line()
    assert f"event #{bad_at}" in v.line()


def test_duplicate_report_rejected() -> None:
    events = GOOD[:3] + [GOOD[2]] + GOOD[3:]
    v = check(events)
    assert not v.accepted and v.first_unmatched == 4


def test_to_tla_forms() -> None:
    assert tc.to_tla({"a": [1, True], "b": "x"}) == '[a |-> <<1, TRUE>>, b |-> "x"]'
    assert tc.to_tla({"3": 1, "10": 2}) == "<<<<3, 1>>, <<10, 2>>>>"
    with pytest.raises(tc.TraceCheckError):
        tc.to_tla(1.5)


def test_unreadable_log_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "x.ndjson"
    p.write_text('{"action": "EmitStore", "job": 1}\n{oops\n')
    with pytest.raises(tc.TraceCheckError, match="line 2"):
        tc.read_log(p)
