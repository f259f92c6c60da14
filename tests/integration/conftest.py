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
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvledger_connector.config import StoreConfig  # noqa: E402
from kvledger_connector.store.embedded import EmbeddedMooncake  # noqa: E402
from kvledger_connector.store.client import MooncakeStore  # noqa: E402
from testbed.procs import mooncake_servers  # noqa: E402

TEST_SEGMENT = 128 << 20

# the owner of engine "ns-engine" run in a PID namespace of its own (`unshare --pid`): a listener stands in for
# its master (a test double) and is published by `rendezvous.acquire`; it prints its pid there and the port,
# and at a line on stdin closes the listener (as when its master dies) and says "closed", staying alive
NS_OWNER = """
import os, socket, sys
from kvledger_connector.store import rendezvous
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
port = s.getsockname()[1]
class Servers:
    master_address = f"127.0.0.1:{port}"
    metadata_server = f"http://127.0.0.1:{port}/metadata"
    master_inode = os.fstat(s.fileno()).st_ino
rendezvous.acquire("ns-engine", Servers)
print(os.getpid(), port, flush=True)
sys.stdin.readline()
s.close()
print("closed", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="session")
def mooncake() -> Iterator[EmbeddedMooncake]:
    with mooncake_servers(rpc_timeout_ms=2000) as mc:
        yield mc


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


# ---------------------------------------------------------------- trace validation of every real run
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "runlog_unchecked(why): this test's harness log is not checked "
                                       "against the model (say why: e.g. it feeds the ledger invalid input)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.stash[_CALL_FAILED] = rep.failed


_CALL_FAILED = pytest.StashKey[bool]()
_RUNLOG_COUNTS = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    c = config.stash.get(_RUNLOG_COUNTS, None)
    if c:
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"[runlog] {c['accepted']} logs of real runs accepted by TLC ({c['events']} events; "
            f"{c['at_rest']} also checked at rest)")


# Every harness's lookup deadline unless its test sets one (`Harness.lookup_timeout_ms`): generous, so a
# loaded machine never turns a lookup into a miss in a test of something else.
TEST_LOOKUP_TIMEOUT_MS = 5000


@pytest.fixture(autouse=True)
def runlog_checked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every Harness of the test logs its run (connector `trace_path`); after the test, TLC checks each
    log against tla/TraceRuntime.tla (conformance.runlog), with the end state at rest when the test's
    check_at_rest() found nothing. A rejected log fails the test (as an error in teardown)."""
    from testbed.harness import Harness
    Harness.runlog_dir = str(tmp_path_factory.mktemp("runlog"))
    Harness.opened = []
    Harness.lookup_timeout_ms = TEST_LOOKUP_TIMEOUT_MS
    try:
        yield
    finally:
        opened, Harness.opened, Harness.runlog_dir = Harness.opened, [], None
        Harness.lookup_timeout_ms = None
    marker = request.node.get_closest_marker("runlog_unchecked")
    if marker is not None or request.node.stash.get(_CALL_FAILED, True):
        return
    from conformance import runlog
    from conformance.engine import tracecheck
    from kvledger.trace import TraceSchemaError, validate_events
    for h in opened:
        path = h.trace_path
        if path is None or not os.path.exists(path):
            continue
        events = tracecheck.read_log(Path(path))
        try:  # every event in kvledger.trace's schema, none only the conformance driver logs
            validate_events(events, runtime=True)
        except TraceSchemaError as e:
            pytest.fail(f"{os.path.basename(path)}: {e} [log kept: {path}]", pytrace=False)
        if not any(e["action"] == "EmitStore" for e in events):
            continue  # nothing was saved: no job lifecycle to check
        v = runlog.check_events(events, pin_cap=h.max_inflight_jobs, expect_rest=h.rested)
        counts = request.config.stash.setdefault(_RUNLOG_COUNTS, {"accepted": 0, "events": 0, "at_rest": 0})
        if v.accepted:
            counts["accepted"] += 1
            counts["events"] += v.events
            counts["at_rest"] += h.rested
        if not v.accepted:
            pytest.fail(f"{v.line(os.path.basename(path))} [log kept: {path}]", pytrace=False)
