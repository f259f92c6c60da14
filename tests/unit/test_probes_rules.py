"""The rule probes (conformance/probes_rules.py: a secret file refused beside 'checksum' or 'off', the
operator's secret used under the embedded store, every part of a key's identity, the tier sweep's own
directories, tail-first release of every pin at shutdown) pass on the shipped code; the mutant table runs
them under every mutant, and tests/unit/test_mutant_shows.py checks each of their mutants both ways."""
from __future__ import annotations

import pytest

from conformance import probes_rules
from conformance.kvprobes import quiet


@pytest.mark.parametrize("probe", probes_rules.PROBES, ids=lambda p: p.__name__)
def test_probe(probe):
    with quiet():
        probe()
