"""The scheduler-side probes (conformance/probes_sched.py) pass on the shipped steps (each mutant's
shows-probe is checked both ways by test_mutant_shows.py)."""
from __future__ import annotations

import pytest

from conformance import probes_sched as ps


@pytest.mark.parametrize("probe", ps.PROBES, ids=lambda p: p.__name__)
def test_probe_passes_on_the_shipped_steps(probe) -> None:
    probe()
