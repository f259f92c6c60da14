"""Shared fixtures of the conformance tests: one real Mooncake master on 127.0.0.1 per session
(started here, stopped by pid), with a client and the driver's staging buffer registered."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mooncake_backend():
    from conformance.kvdriver import MooncakeBackend
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.embedded import EmbeddedMooncake
    from kvledger_connector.store import MooncakeStore

    mc = EmbeddedMooncake(rpc_timeout_ms=2000)
    try:
        cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
        store = MooncakeStore.connect(cfg, embedded=mc)
        try:
            yield MooncakeBackend(store)
        finally:
            store.close()
    finally:
        mc.stop()
