"""The identity probes (conformance/probes_identity.py: attach only to the recorded listener, a server ready
only on its own listener, a squatted master port moved and republished, a store that never trusts an
unauthenticated master) pass on the shipped code; the mutant table runs them under every mutant, and
tests/unit/test_mutant_shows.py checks each of their mutants both ways."""
from __future__ import annotations

import pytest

from conformance import probes_identity
from conformance.kvprobes import quiet


@pytest.mark.parametrize("probe", probes_identity.PROBES, ids=lambda p: p.__name__)
def test_probe(probe):
    with quiet():
        probe()
