"""The compiled tables and the transitions machines come from one definition and agree everywhere."""
from __future__ import annotations

import json

import pytest

from kvledger import LedgerInvariantError
from kvledger.machines import SPEC_PATH, SPECS, TABLES, build_machine, fire_definition, step


@pytest.mark.parametrize("name", sorted(SPECS))
def test_table_equals_transitions_machine_on_every_state_trigger_dest(name):
    spec = SPECS[name]
    table = TABLES[name]
    checked = allowed = 0
    for state in spec.states:
        for trigger in spec.triggers:
            for dest in spec.states:
                by_def = fire_definition(spec, state, trigger, dest)
                by_table = dest if dest in table.get((state, trigger), ()) else None
                assert by_def == by_table, (name, state, trigger, dest, by_def, by_table)
                checked += 1
                allowed += by_table is not None
    assert checked == len(spec.states) ** 2 * len(spec.triggers)
    assert allowed == len(set((s, t, d) for t, s, d, _ in spec.transitions))


def test_machines_match_the_json_file():
    raw = json.loads(SPEC_PATH.read_text())["machines"]
    assert set(SPECS) == set(raw) == {"StoreJob", "StoreRequest"}
    for name, m in raw.items():
        assert SPECS[name].initial == m["initial"]
        assert set(SPECS[name].states) == set(m["states"])


def test_every_store_job_path_ends_reported_then_released():
    spec = SPECS["StoreJob"]
    table = TABLES["StoreJob"]
    # from every reachable state, "released" is reachable and goes through "reported"
    reach = {spec.initial}
    frontier = [spec.initial]
    while frontier:
        s = frontier.pop()
        for (src, _), dests in table.items():
            if src == s:
                for d in dests - reach:
                    reach.add(d)
                    frontier.append(d)
    assert reach == set(spec.states)
    for s in reach - {"released"}:
        outs = set().union(*(d for (src, _), d in table.items() if src == s))
        assert outs, f"{s} is a dead end"
    assert {src for (src, _), d in table.items() if "released" in d} == {"reported"}


def test_step_raises_named_lifecycle_error():
    with pytest.raises(LedgerInvariantError) as e:
        step(TABLES["StoreJob"], "StoreJob", "queued", "Report", "reported", 7)
    assert e.value.invariant_id == "StoreJob" and "7: Report from 'queued'" in str(e.value)


def test_definition_machine_walks_a_whole_job():
    machine, model = build_machine(SPECS["StoreJob"])
    for trig, dest in [("Receive", "queued"), ("DmaRead", "running"), ("Put", "stored"),
                       ("Report", "reported"), ("Collect", "released")]:
        assert model.trigger(trig, dest=dest)
        assert model.state == dest
