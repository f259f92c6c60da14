"""Stateful fuzzing of the real system with TLC's state graph as the oracle.

`oracle_machine(export, make_driver)` builds a Hypothesis `RuleBasedStateMachine` whose single rule
picks an action from the *universe* (every distinct action input the graph ever takes, e.g.
`Put(w=w1, outcome=fail)`) and drives the real system with it from the current model state:

  * the graph has an edge from the current state whose action has these inputs: the system must do
    it, and its abstract state must equal that edge's successor (one of them, if the model is
    nondeterministic in an output such as a new job id); the oracle moves there;
  * the graph has no such edge: the system must refuse it (`Refused`), and its abstract state must
    be unchanged.

After every step `driver.check_invariants()` checks S1..S9 on the implementation itself (not on
the model). Hypothesis shrinks a failure to the shortest program it can and prints it as a list of
`state.step(...)` calls; the same list can be replayed by calling the methods in order.

A driver used here has, besides the replay methods, `inputs(action) -> hashable` (the part of an
action the caller chooses; outputs such as a new job id are left out) and `check_invariants()`.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conformance.engine.export import Export
from conformance.engine.replay import Refused, action_str, diff


class OracleError(AssertionError):
    """The system and TLC's graph disagree on a fuzzed move (message: the move and the difference)."""


def _key(inputs: Any) -> str:
    return json.dumps(inputs, sort_keys=True)


def action_universe(exp: Export, inputs: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """One representative action per distinct input key, in a stable order."""
    seen: dict[str, dict[str, Any]] = {}
    for i in range(len(exp.graph.states)):
        la = exp.graph.state(i).get("lastAction")
        if isinstance(la, dict) and la.get("name") not in (None, "Init"):
            seen.setdefault(_key(inputs(la)), la)
    return [seen[k] for k in sorted(seen)]


def oracle_machine(exp: Export, make_driver: Callable[[], Any]) -> type[RuleBasedStateMachine]:
    g = exp.graph
    out = g.out_edges()
    probe = make_driver()
    inputs = probe.inputs
    probe.close()
    universe = action_universe(exp, inputs)
    # successors of each state, grouped by the inputs of their action
    succ: dict[int, dict[str, list[int]]] = {}
    for s, es in out.items():
        by: dict[str, list[int]] = {}
        for d, _ in es:
            by.setdefault(_key(inputs(g.state(d)["lastAction"])), []).append(d)
        succ[s] = by

    class OracleMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.driver = make_driver()
            self.node = g.init[0]
            self.driver.reset(g.state(self.node))
            self.moves: list[str] = []
            self.refusals = 0

        @rule(k=st.integers(min_value=0, max_value=len(universe) - 1))
        def step(self, k: int) -> None:
            act = universe[k]
            key = _key(inputs(act))
            pre = g.state(self.node)
            targets = succ.get(self.node, {}).get(key, [])
            name = action_str(act)
            if not targets:
                before = self.driver.observe()
                try:
                    self.driver.apply(act, pre, pre)
                except Refused:
                    self.refusals += 1
                else:
                    raise OracleError(f"after {self._path()}: {name} has no edge in TLC's graph, "
                                      "but the system did it")
                d = diff(before, self.driver.observe())
                if d:
                    raise OracleError(f"after {self._path()}: refusing {name} changed the system: {d}")
                return
            post_opts = [g.state(t) for t in targets]
            try:
                self.driver.apply(post_opts[0]["lastAction"], pre, post_opts[0])
            except Refused as e:
                raise OracleError(f"after {self._path()}: {name} is an edge of TLC's graph, "
                                  f"but the system refused it: {e}") from None
            seen = self.driver.observe()
            for t, post in zip(targets, post_opts):
                if not diff(self.driver.expect(post), seen):
                    self.node = t
                    self.moves.append(action_str(post["lastAction"]))
                    return
            d = diff(self.driver.expect(post_opts[0]), seen)
            raise OracleError(f"after {self._path()}: {name} led to a state that is no successor in "
                              f"TLC's graph; differences to the first: {d}")

        def _path(self) -> str:
            return " -> ".join(self.moves[-10:]) or "Init"

        @invariant()
        def implementation_invariants(self) -> None:
            self.driver.check_invariants()

        def teardown(self) -> None:
            self.driver.close()

    OracleMachine.__name__ = f"Oracle_{exp.module}"
    OracleMachine.universe = universe  # type: ignore[attr-defined]
    return OracleMachine
