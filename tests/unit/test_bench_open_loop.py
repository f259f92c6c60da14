"""bench.scheduler's open-loop helpers: the fixed arrival schedule and the per-group TTFT/TPOT summary."""
from __future__ import annotations

import pytest

from bench.scheduler import RequestTimes, _groups, arrival_schedule, ttft_summary


def test_arrivals_are_i_over_rate() -> None:
    assert arrival_schedule(4, 12.5) == [0.0, 0.08, 0.16, 0.24]
    assert arrival_schedule(0, 20.0) == []


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_a_rate_that_is_not_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="Workload.rate"):
        arrival_schedule(3, rate)


def _req(arrival: float, first: float | None, finish: float | None, *, hit: bool, tokens: int = 5,
         admit: float | None = None) -> RequestTimes:
    return RequestTimes(arrival, 0, first=first, first_step=2 if first is not None else None, finish=finish,
                        tokens=tokens, hit=hit, admit=admit, admit_step=1 if admit is not None else None)


def test_summary_times_from_arrival_and_splits_hits_from_misses() -> None:
    recs = [_req(0.0, 0.010, 0.050, hit=True, admit=0.002),  # TTFT 10 ms, TPOT (50-10)/4 = 10 ms
            _req(0.1, 0.130, 0.150, hit=True, admit=0.110),  # TTFT 30 ms, TPOT 5 ms
            _req(0.2, 0.220, 0.240, hit=False),  # a miss: TTFT 20 ms
            _req(0.3, None, 0.310, hit=True, tokens=0)]  # ended without a token (an error)
    groups = _groups(recs)
    assert sorted(groups) == ["all", "hit", "miss"]
    hit = ttft_summary(groups["hit"])
    assert (hit["n"], hit["no_token"]) == (3, 1)
    assert hit["ttft50"] == pytest.approx(10.0) and hit["ttft99"] == pytest.approx(30.0)
    assert sorted([hit["tpot50"], hit["tpot90"]]) == pytest.approx([5.0, 10.0])
    assert hit["wait50"] == pytest.approx(2.0) and hit["load_steps50"] == 1.0
    assert hit["sync"] == 2  # hits with no step in WAITING_FOR_REMOTE_KVS
    miss = ttft_summary(groups["miss"])
    assert miss["ttft50"] == pytest.approx(20.0) and miss["wait50"] is None and miss["sync"] is None
    assert "miss" not in _groups(recs[:2])
