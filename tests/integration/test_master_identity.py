"""The embedded master's identity is its listener's socket inode, never "a port that answers"
(kvledger_connector/store/embedded.py, store/rendezvous.py, store/authenticity.py). A squatter, a real process that binds the
master's port the moment the master dies, is never joined by another process of the engine, never taken
for a ready server, never lets a store breaker close; the supervisor moves the master to a fresh port and
the owner republishes it. Real processes and a real `mooncake_master`, on 127.0.0.1 only, stopped by pid."""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvledger_connector.store.listeners as listeners_mod
from kvledger_connector.store import rendezvous
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake, EmbeddedStartError
from kvledger_connector.store.listeners import (
    LOOPBACK,
    free_port,
    holds_socket,
    loopback_listener,
    parse_tcp_listeners,
    port_accepts,
)
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from testbed.procs import wait_until
from tests.integration.conftest import NS_OWNER

ROOT = Path(__file__).resolve().parents[2]

# another local process that takes a port the moment it is free: it spins on bind (SO_REUSEADDR, as a
# server would: the dead master's connections leave TIME_WAIT sockets on the port) and then listens
SQUATTER = """
import socket, sys, time
port, give_up = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
print("ready", flush=True)
while True:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        if time.monotonic() > give_up:
            sys.exit(3)
s.listen(64)
print("bound", flush=True)
sys.stdin.read()
"""

# one process of the engine: attach (or start), then answer "auth" with what its handle authenticates
CHILD = """
import json, sys
from kvledger_connector.store.rendezvous import acquire_shared, release_shared
from kvledger_connector.store.embedded import EmbeddedMooncake
h = acquire_shared(sys.argv[1], 2000)
print(json.dumps({"master": h.master_address, "owner": isinstance(h, EmbeddedMooncake),
                  "authentic": h.authentic()}), flush=True)
for line in sys.stdin:
    if line.strip() == "auth":
        print(json.dumps({"authentic": h.authentic(), "moved_to": getattr(h, "moved_to", None)}), flush=True)
    else:
        break
release_shared(sys.argv[1])
"""


def _spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _line(p: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert p.stdout is not None
    if not select.select([p.stdout], [], [], timeout_s)[0]:
        return ""
    return p.stdout.readline().strip()


def _ask(p: subprocess.Popen[str], what: str = "auth") -> dict[str, object]:
    assert p.stdin is not None
    p.stdin.write(what + "\n")
    p.stdin.flush()
    return dict(json.loads(_line(p)))


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(30)



@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """A private runtime directory and an engine id; (engine id, the environment of its other processes)."""
    run = tmp_path / "rt"
    run.mkdir(mode=0o700)
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(run))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
    yield f"engine-{uuid.uuid4().hex[:8]}", env


def test_a_squatter_on_the_killed_masters_port_is_never_joined_and_the_master_moves(
        engine: tuple[str, dict[str, str]], caplog: pytest.LogCaptureFixture) -> None:
    """The owner's master is SIGKILLed while another process spins on binding its port: that process gets the
    port. The supervisor does not wait for it: it warns (port, uid), starts the master on a fresh port and
    the owner republishes the file. A process that had attached stops trusting the old port and learns where
    the master went; a new process of the engine attaches to the new master, never to the squatter; the
    owner's store (its client on the old address) trips on authenticity and its breaker never closes."""
    eid, env = engine
    caplog.set_level(logging.WARNING)
    h = rendezvous.acquire_shared(eid, 2000)
    assert isinstance(h, EmbeddedMooncake) and h.supervise
    path = Path(rendezvous.rendezvous_path(eid))
    store: MooncakeStore | None = None
    procs: list[subprocess.Popen[str]] = []
    try:
        stats = StatsRecorder()
        store = MooncakeStore.connect(StoreConfig(global_segment_size=16 << 20, rpc_timeout_ms=1000,
                                                  unhealthy_backoff_ms=200, max_unhealthy_backoff_ms=400),
                                      embedded=h)
        store.stats = stats
        assert store.batch_is_exist(["k"]) == [0] and store.authentic()
        old_port, old_inode = h.rpc_port, h.master_inode
        attached = _spawn(CHILD, eid, env=env)
        procs.append(attached)
        hello = json.loads(_line(attached))
        assert hello == {"master": h.master_address, "owner": False, "authentic": True}

        squatter = _spawn(SQUATTER, str(old_port), "120")
        procs.append(squatter)
        assert _line(squatter) == "ready"
        kills = 0
        while True:  # the squatter spins on bind; should the restart win the port, kill the master again
            assert kills < 5 and wait_until(lambda: h.master_pid is not None, 60.0), "the squatter never got the port"
            pid = h.master_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            kills += 1
            if _line(squatter, 10.0) == "bound":
                break
        squat = loopback_listener(old_port)
        assert squat is not None and not holds_socket(pid, squat.inode) and squat.inode != old_inode

        assert h.wait_restarts(kills, 60.0) and wait_until(lambda: h.rpc_port != old_port, 10.0)
        assert h.master_pid is not None and h.master_inode != old_inode
        assert holds_socket(h.master_pid, h.master_inode)
        assert loopback_listener(h.rpc_port) == (h.master_inode, os.getuid())
        assert any(f"port {old_port}" in r.getMessage() and f"uid {os.getuid()}" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert wait_until(lambda: json.loads(path.read_text())["master_address"] == h.master_address, 10.0)
        info = json.loads(path.read_text())
        assert (info["pid"], info["master_inode"]) == (os.getpid(), h.master_inode)

        # the process attached before: the old port is not its master any more; it knows where it went
        assert _ask(attached) == {"authentic": False, "moved_to": h.master_address}
        # a new process of the engine: the new master, never the squatter
        newcomer = _spawn(CHILD, eid, env=env)
        procs.append(newcomer)
        assert json.loads(_line(newcomer)) == {"master": h.master_address, "owner": False, "authentic": True}

        # the owner's store: its client is on the squatter's port. It trips on authenticity (counted) without
        # a call reaching the squatter, and no probe closes it.
        time.sleep(1.1)  # past the authenticity check's interval
        assert store.batch_is_exist(["k"]) == [int(StoreCode.UNHEALTHY_SKIPPED)]
        assert store.breaker_open and not store.authentic()
        assert stats.total("master_unauthentic") >= 1
        for _ in range(3):
            assert not store.probe(force=True) and store.breaker_open
        assert any("restart the engine" in r.getMessage() for r in caplog.records)
    finally:
        for p in procs:
            _stop(p)
        if store is not None:
            store.close(timeout_s=15.0)
        rendezvous.release_shared(eid)
    assert h.master_pid is None and not path.exists()


def test_an_attached_process_follows_a_restart_on_the_same_port(engine: tuple[str, dict[str, str]]) -> None:
    """Without a squatter the supervisor restarts the master on its port (a new listener, a new inode) and
    republishes; the attached process authenticates the new master, as its client reconnects to it."""
    eid, env = engine
    h = rendezvous.acquire_shared(eid, 2000)
    child = _spawn(CHILD, eid, env=env)
    try:
        assert json.loads(_line(child))["authentic"] is True
        port, inode, pid = h.rpc_port, h.master_inode, h.master_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert h.wait_restarts(1, 60.0) and h.rpc_port == port and h.master_inode != inode
        assert wait_until(lambda: _ask(child)["authentic"] is True, 10.0)
    finally:
        _stop(child)
        rendezvous.release_shared(eid)


class _Started:
    """Test double for `start`: what acquire publishes of servers it starts (none are started)."""
    master_address = "127.0.0.1:1"
    metadata_server = "http://127.0.0.1:1/metadata"
    master_inode = 1


def test_a_squatter_is_refused_when_the_owner_is_in_another_pid_namespace(
        engine: tuple[str, dict[str, str]]) -> None:
    """The owner's pid means nothing across PID namespaces; only its master's listener says it is alive. Its
    master's listener goes and another process binds the port: the attacher does not join the squatter (the
    file is swept, this process starts its own servers), though something accepts on the port."""
    _, env = engine
    cmd = ["unshare", "--pid", "--kill-child", sys.executable, "-c", NS_OWNER]
    try:
        owner = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env)
    except OSError as e:
        pytest.skip(f"unshare cannot run here: {e}")
    squatter: subprocess.Popen[str] | None = None
    try:
        first = _line(owner).split()
        if not first:
            owner.wait(30)
            pytest.skip(f"no PID namespace could be created: {owner.stderr.read() if owner.stderr else ''}")
        ns_pid, port = int(first[0]), int(first[1])
        assert ns_pid == 1
        info = json.loads(Path(rendezvous.rendezvous_path("ns-engine")).read_text())
        assert info["pid_ns"] != os.readlink("/proc/self/ns/pid")
        joined = rendezvous.acquire("ns-engine", _Started)  # type: ignore[arg-type]  (the control: joined)
        assert isinstance(joined, rendezvous.AttachedMooncake) and joined.master_address == f"127.0.0.1:{port}"

        squatter = _spawn(SQUATTER, str(port), "30")
        assert _line(squatter) == "ready"
        assert owner.stdin is not None
        owner.stdin.write("close\n")
        owner.stdin.flush()
        assert _line(owner) == "closed" and _line(squatter) == "bound"
        assert port_accepts(port)  # something answers there: the old rule would have joined it
        assert not joined.authentic()
        got = rendezvous.acquire("ns-engine", _Started)  # type: ignore[arg-type]
        assert isinstance(got, _Started), got
        assert json.loads(Path(rendezvous.rendezvous_path("ns-engine")).read_text())["pid"] == os.getpid()
        rendezvous.release("ns-engine")
    finally:
        if squatter is not None:
            _stop(squatter)
        _stop(owner)


def test_a_squatter_that_binds_after_the_busy_check_is_never_taken_for_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The master's ports are free at the busy check; another process binds the RPC port before the master
    does. The start fails naming the port; the squatter's listener is never recorded as the master's."""
    mc = EmbeddedMooncake(start=False)
    mc.rpc_port, mc.metrics_port = free_port(), free_port()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    refuse_busy = EmbeddedMooncake._refuse_busy

    def busy_check_then_squat(name: str, ports: list[int]) -> None:
        refuse_busy(name, ports)  # passes: nothing listens yet
        squatter.bind((LOOPBACK, mc.rpc_port))
        squatter.listen(8)

    monkeypatch.setattr(mc, "_refuse_busy", busy_check_then_squat)
    try:
        with pytest.raises(EmbeddedStartError, match=rf"\b{mc.rpc_port}\b"):
            mc.start_master()
        assert mc.master_pid is None and mc.master_inode == 0 and not mc.authentic()
    finally:
        squatter.close()
        mc.stop()


# -------------------------------------------------------------------------------- the /proc/net/tcp reader
HEADER = b"  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(local: str, state: str = "0A", uid: str = "1000", inode: str = "4242") -> bytes:
    return (f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  {uid}        0 {inode} 1 "
            f"0000000000000000 100 0 0 10 0\n").encode()


def test_the_tcp_table_reader_takes_only_well_formed_listen_lines(tmp_path: Path) -> None:
    loop = socket.inet_aton(LOOPBACK)
    hex_loop = f"{int.from_bytes(loop, sys.byteorder):08X}"  # the kernel prints the address as a host u32
    good = _row(f"{hex_loop}:1F90")
    assert parse_tcp_listeners(HEADER + good) == [(LOOPBACK, 0x1F90, (4242, 1000))]
    malformed = [
        b"", b"\x00\xff garbage \xfe\n", b"   0: truncated\n",
        _row(f"{hex_loop}:1F90", state="01"),  # a connection, not a listener
        _row(f"{hex_loop}:1F90", inode="0"), _row(f"{hex_loop}:1F90", inode="-5"),
        _row(f"{hex_loop}:1F90", uid="root"), _row(f"{hex_loop}:1F90", inode="12ab"),
        _row("ZZ00007F:1F90"), _row("0100007F:1F9"), _row("0100007F1F90"), _row(f"{hex_loop}:0000"),
        _row("0100007F00:1F90"), _row(f"{hex_loop}:GGGG"),
    ]
    for bad in malformed:
        assert parse_tcp_listeners(HEADER + bad) == [], bad
    assert parse_tcp_listeners(HEADER + b"".join(malformed) + good) == [(LOOPBACK, 0x1F90, (4242, 1000))]
    assert parse_tcp_listeners(good) == []  # the first line is always the header
    v6 = _row("00000000000000000000000000000000:1F90")
    assert parse_tcp_listeners(HEADER + v6) == [("::", 0x1F90, (4242, 1000))]

    table = tmp_path / "tcp"
    table.write_bytes(HEADER + good)
    assert loopback_listener(0x1F90, str(table)) == (4242, 1000)
    assert loopback_listener(0x1F91, str(table)) is None
    table.write_bytes(HEADER + good + _row(f"{hex_loop}:1F90", inode="4343"))  # two (SO_REUSEPORT): neither
    assert loopback_listener(0x1F90, str(table)) is None
    assert loopback_listener(0x1F90, str(tmp_path / "missing")) is None


def test_a_listener_is_known_by_its_inode_and_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's table in this network namespace names this process's listener, with its inode and uid;
    the process holds it, another does not. Past the read bound nothing is found (no partial answer)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen(1)
        port, inode = s.getsockname()[1], os.fstat(s.fileno()).st_ino
        assert loopback_listener(port) == (inode, os.getuid())
        assert holds_socket(os.getpid(), inode) and not holds_socket(os.getppid(), inode)
    assert loopback_listener(port) is None
    assert not holds_socket(2 ** 22 + 1, inode)  # above any pid_max: no such process
    table = tmp_path / "tcp"
    hex_loop = f"{int.from_bytes(socket.inet_aton(LOOPBACK), sys.byteorder):08X}"
    table.write_bytes(HEADER + _row(f"{hex_loop}:1F90"))
    assert loopback_listener(0x1F90, str(table)) == (4242, 1000)
    monkeypatch.setattr(listeners_mod, "MAX_TCP_TABLE_BYTES", len(HEADER) + 10)
    assert loopback_listener(0x1F90, str(table)) is None
