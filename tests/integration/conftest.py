"""Integration fixtures: a real Mooncake master + metadata server on 127.0.0.1, stopped by pid.

    mooncake       session-scoped `EmbeddedMooncake` shared by every integration test (keys are namespaced
                   per test by `key_prefix`, so tests never see each other's keys)
    store_config   a `StoreConfig` pointed at it (small segment, short RPC timeout)
    store          function-scoped `MooncakeStore` client, closed after the test (close costs ~1-2 s:
                   Mooncake unmounts the segment; prefer `shared_store` when a fresh client is not needed)
    shared_store   session-scoped `MooncakeStore` client on the shared master
    key_prefix     a unique key prefix per test

Fault tests that kill or restart a master must use their own `EmbeddedMooncake` (see
test_store_faults.py), never the shared one.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from connector.config import StoreConfig  # noqa: E402
from connector.embedded import EmbeddedMooncake  # noqa: E402
from connector.store import MooncakeStore  # noqa: E402

TEST_SEGMENT = 128 << 20


@pytest.fixture(scope="session")
def mooncake() -> Iterator[EmbeddedMooncake]:
    mc = EmbeddedMooncake(rpc_timeout_ms=2000)
    try:
        yield mc
    finally:
        mc.stop()
    if mc.master_pid is not None or mc.metadata_pid is not None:
        raise RuntimeError(f"mooncake servers still running: {mc.master_pid}, {mc.metadata_pid}")


@pytest.fixture
def store_config(mooncake: EmbeddedMooncake) -> StoreConfig:
    return StoreConfig(global_segment_size=TEST_SEGMENT, local_buffer_size=4 << 20,
                       rpc_timeout_ms=2000).with_addresses(mooncake.master_address, mooncake.metadata_server)


@pytest.fixture
def store(store_config: StoreConfig) -> Iterator[MooncakeStore]:
    s = MooncakeStore.connect(store_config)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def shared_store(mooncake: EmbeddedMooncake) -> Iterator[MooncakeStore]:
    cfg = StoreConfig(global_segment_size=TEST_SEGMENT, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
    s = MooncakeStore.connect(cfg, embedded=mooncake)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def key_prefix() -> str:
    return f"test/{uuid.uuid4().hex[:12]}/"
