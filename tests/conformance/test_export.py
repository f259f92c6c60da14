"""Export on a tiny spec of our own (tests/conformance/tiny/TinyPin.tla), run by real TLC:
the graph parses, simulated behaviours land on graph states, every step of every exported
behaviour is a graph edge whose action is the successor's lastAction, and the coverage count
is exact (simulation alone misses edges; the covering paths take all of them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.engine import export as ex

TINY = Path(__file__).parent / "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ex.Export:
    out = tmp_path_factory.mktemp("export") / "tiny.json"
    lines: list[str] = []
    ex.export(TINY, "TinyPin", "MC_tiny.cfg", num=50, depth=12, seed=7, out=out, log=lines.append)
    assert any("coverage:" in ln for ln in lines)
    return ex.read_export(out)


def test_graph_shape(tiny: ex.Export) -> None:
    g = tiny.graph
    # 2 ranks, 3 jobs: TLC reports 462 distinct states (lastAction included in the state).
    assert len(g.states) == 462
    assert len(g.init) == 1
    init = g.state(g.init[0])
    assert init["pinned"] == [] and init["nextJob"] == 1
    assert init["reported"] == {"w0": [], "w1": []}
    assert {a for _, _, a in g.edges} == {"EmitStore", "Report", "Collect"}


def test_edge_label_is_successor_lastaction(tiny: ex.Export) -> None:
    g = tiny.graph
    for s, d, a in g.edges:
        assert g.state(d)["lastAction"]["name"] == a


def test_behaviours_are_graph_paths(tiny: ex.Export) -> None:
    g = tiny.graph
    edges = {(s, d) for s, d, _ in g.edges}
    sims = [b for o, b in tiny.behaviours if o == "simulate"]
    assert len(sims) == 50
    assert all(len(b) <= 12 for b in sims)
    for _, b in tiny.behaviours:
        assert b[0] in g.init
        for k in range(len(b) - 1):
            assert (b[k], b[k + 1]) in edges


def test_coverage_counts(tiny: ex.Export) -> None:
    g = tiny.graph
    sims = [b for o, b in tiny.behaviours if o == "simulate"]
    taken_sim, total = ex.coverage(g, sims)
    assert total == len({(s, d) for s, d, _ in g.edges})
    assert 0 < taken_sim < total  # 50 short random runs cannot take every edge
    taken_all, _ = ex.coverage(g, (b for _, b in tiny.behaviours))
    assert taken_all == total


def test_coverage_rejects_non_edge(tiny: ex.Export) -> None:
    g = tiny.graph
    init = g.init[0]
    with pytest.raises(ex.ExportError, match="not graph edges"):
        ex.coverage(g, [[init, init]])  # no self-loop at Init


def test_same_seed_same_behaviours(tmp_path: Path) -> None:
    graph, _ = ex.dump_graph(TINY, "TinyPin", "MC_tiny.cfg")
    a, _ = ex.simulate(TINY, "TinyPin", "MC_tiny.cfg", graph, 20, 10, seed=3)
    b, _ = ex.simulate(TINY, "TinyPin", "MC_tiny.cfg", graph, 20, 10, seed=3)
    assert a == b


def test_value_parser() -> None:
    v = ex.parse_plain_value('[a |-> {2, 1}, b |-> <<"x", TRUE>>, c |-> (r1 :> 0 @@ r2 :> -3)]')
    assert v == {"a": [1, 2], "b": ["x", True], "c": {"r1": 0, "r2": -3}}
    with pytest.raises(ex.ExportError):
        ex.parse_plain_value("[a |-> ")
