"""Every runtime mutant changes the function its name says: its shows-probe (conformance/probes_shows.py)
passes on the shipped code and fails, with ProbeFailed, under the mutant's patches."""
from __future__ import annotations

import pytest

from conformance import mutants
from conformance.kvprobes import ProbeFailed, quiet
from conformance.probes_shows import SHOWS


def test_every_mutant_has_a_shows_probe():
    assert set(SHOWS) == set(mutants.MUTANTS)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_shows_probe_sees_the_mutant(name):
    with quiet():
        SHOWS[name]()
        with mutants.applied(name), pytest.raises(ProbeFailed):
            SHOWS[name]()
        SHOWS[name]()  # the patches are gone again
