"""EmbeddedMooncake: loopback-only listeners, stop by pid (idempotent, also at interpreter exit), and a
start-up failure that says why (command line + log tail)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvledger_connector.store.embedded import EmbeddedMooncake, EmbeddedStartError

ROOT = Path(__file__).resolve().parents[2]


def listeners(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_servers_listen_on_loopback_only_and_stop_by_pid(mooncake: EmbeddedMooncake) -> None:
    mc = EmbeddedMooncake()
    try:
        assert mc.master_pid and mc.metadata_pid
        assert mc.master_pid != mooncake.master_pid  # a second private deployment, its own ports
        master, metadata = listeners(mc.master_pid), listeners(mc.metadata_pid)
        assert (("127.0.0.1", mc.rpc_port)) in master and ("127.0.0.1", mc.metadata_port) in metadata
        assert {ip for ip, _ in master | metadata} == {"127.0.0.1"}, master | metadata
        assert mc.metadata_server == f"http://127.0.0.1:{mc.metadata_port}/metadata"
        pids = (mc.master_pid, mc.metadata_pid)
    finally:
        mc.stop()
    assert all(gone(p) for p in pids)
    assert mc.master_pid is None and mc.metadata_pid is None
    mc.stop()  # idempotent
    with pytest.raises(EmbeddedStartError, match="was stopped"):
        mc.start()


def test_start_failure_reports_command_and_log_tail() -> None:
    with pytest.raises(EmbeddedStartError) as e:
        EmbeddedMooncake(extra_master_flags=["--no_such_flag_for_test=1"])
    msg = str(e.value)
    assert "mooncake master exited with code" in msg and "--no_such_flag_for_test=1" in msg
    assert "last lines of" in msg and "no_such_flag_for_test" in msg.split("last lines of", 1)[1]


def test_busy_port_is_refused_not_mistaken_for_ready() -> None:
    mc = EmbeddedMooncake(start=False)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        mc.rpc_port = squatter.getsockname()[1]
        with pytest.raises(EmbeddedStartError, match=f"port\\(s\\) \\[{mc.rpc_port}\\].*already in use"):
            mc.start_master()
    assert mc.master_pid is None
    mc.stop()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"rpc_timeout_ms": 0}, "rpc_timeout_ms=0"),
    ({"lease_ttl_ms": "1"}, "lease_ttl_ms='1'"),
    ({"extra_master_flags": ["--rpc_address=0.0.0.0"]}, "--rpc_address=0.0.0.0"),
    ({"extra_master_flags": ["eviction_ratio=0.1"]}, "eviction_ratio=0.1"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        EmbeddedMooncake(start=False, **kwargs)  # type: ignore[arg-type]


def test_servers_are_stopped_at_interpreter_exit() -> None:
    code = ("from kvledger_connector.store.embedded import EmbeddedMooncake\n"
            "mc = EmbeddedMooncake()\n"
            "print(mc.master_pid, mc.metadata_pid, flush=True)\n")  # exits without stop()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and all(gone(p) for p in pids)
