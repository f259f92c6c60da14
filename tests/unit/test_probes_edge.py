"""The edge probes (conformance/probes_edge.py: the integrity secret's mode, the replicated KV head's owner,
the breaker's backoff, the lookup deadline, the rendezvous metadata URL, the embedded master's supervision,
the weights-version switch at reset) pass on the shipped code; the mutant table runs them under every
mutant, and tests/unit/test_mutant_shows.py checks each of their mutants both ways."""
from __future__ import annotations

import pytest

from conformance import probes_edge
from conformance.kvprobes import quiet


@pytest.mark.parametrize("probe", probes_edge.PROBES, ids=lambda p: p.__name__)
def test_probe(probe):
    with quiet():
        probe()
