"""The scheduler-side probes (conformance/probes_sched.py) on the shipped steps, and each scheduler-side
mutant seen by its shows-probe: it passes unmutated and fails with the mutant applied."""
from __future__ import annotations

import contextlib

import pytest

from conformance import probes_sched as ps
from conformance.kvprobes import ProbeFailed
from conformance.mutants import patched


@pytest.mark.parametrize("probe", ps.PROBES, ids=lambda p: p.__name__)
def test_probe_passes_on_the_shipped_steps(probe) -> None:
    probe()


@pytest.mark.parametrize("name", sorted(ps.MUTANTS))
def test_mutant_changes_what_its_name_says(name: str) -> None:
    ps.SHOWS[name]()
    with contextlib.ExitStack() as stack:
        for obj, attr, make in ps.MUTANTS[name]:
            stack.enter_context(patched(obj, attr, make))
        with pytest.raises(ProbeFailed):
            ps.SHOWS[name]()
