"""docs/machines.md is rendered from spec/machines.json and is current."""
from __future__ import annotations

from kvledger.machines import SPECS
from spec import diagram


def test_docs_machines_md_is_current():
    assert diagram.OUT.read_text() == diagram.render(), "run `make diagram`"
    assert diagram.main(["--check"]) == 0


def test_every_transition_is_drawn():
    text = diagram.render()
    for spec in SPECS.values():
        assert f"[*] --> {spec.initial}" in text
        for trig, src, dst, _ in spec.transitions:
            assert f"    {src} --> {dst} : {trig}" in text
