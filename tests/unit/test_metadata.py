"""aggregate: associative, commutative, identity {} (property tests), and input checks."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import LedgerInputError, aggregate, aggregate_all, aggregate_into

reports = st.dictionaries(st.integers(0, 50), st.integers(1, 4), max_size=12)


@given(reports, reports)
def test_aggregate_commutative(a, b):
    assert aggregate(a, b) == aggregate(b, a)


@given(reports, reports, reports)
def test_aggregate_associative(a, b, c):
    assert aggregate(aggregate(a, b), c) == aggregate(a, aggregate(b, c))


@given(reports)
def test_aggregate_identity_and_purity(a):
    before = dict(a)
    assert aggregate(a, {}) == a == aggregate({}, a)
    assert a == before


@given(st.lists(reports, max_size=6))
def test_aggregate_all_sums_counts(parts):
    out = aggregate_all(parts)
    for job in {j for p in parts for j in p}:
        assert out[job] == sum(p.get(job, 0) for p in parts)


def test_aggregate_into_mutates_accumulator():
    acc = {1: 1}
    assert aggregate_into(acc, {1: 1, 2: 1}) is acc
    assert acc == {1: 2, 2: 1}


@pytest.mark.parametrize("bad,field", [({1: 0}, "completed_saves[1]"), ({1: -2}, "completed_saves[1]"),
                                       ({-1: 1}, "completed_saves key"), ({"1": 1}, "completed_saves key"),
                                       ({1: True}, "completed_saves[1]")])
def test_bad_reports_name_the_field(bad, field):
    with pytest.raises(LedgerInputError) as e:
        aggregate({}, bad)
    assert e.value.field == field
