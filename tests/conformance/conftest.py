"""Shared fixtures of the conformance tests: one real Mooncake master on 127.0.0.1 per session
(started here, stopped by pid), with the driver's backend on it (the connector's MooncakeStore over a
fault-injecting client)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mooncake_backend():
    from conformance.mutants import mooncake_backend

    with mooncake_backend() as backend:
        yield backend
