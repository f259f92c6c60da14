"""The probes of the connector's parts (conformance/probes_parts.py: KV cache copy plans of every vLLM
layout, keys, reset_cache's pattern, the runtime directory) pass on the shipped code; the mutant table runs
them under every mutant."""
from __future__ import annotations

import pytest

from conformance import probes_parts


@pytest.mark.parametrize("probe", probes_parts.PROBES, ids=lambda p: p.__name__)
def test_probe(probe):
    probe()
