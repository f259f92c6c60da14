"""Probes of the embedded master's identity (kvledger_connector/store/embedded.py, store/rendezvous.py, store/authenticity.py): the
master is the LISTEN socket on its port whose inode it was ready with, never "whatever answers there".
A process attaches only to the listener its engine's file records; an attached handle stops trusting a
port another listener took; a server is ready only on a listener its own process holds; a supervised
master whose port another process took moves to a fresh one and is republished; a store's breaker never
closes on a master it cannot authenticate.

Each calls the shipped function through the module (or class) the connector looks it up in, so a patched
function (a mutant) is the one probed, and raises :class:`ProbeFailed` naming what it saw. Real listening
sockets on 127.0.0.1 stand in for the servers (the kernel lists them as it lists a master's); no Mooncake
process is started, every probe runs in milliseconds.

`PROBES` runs in the mutant table (conformance/mutants.py) and, unmutated, in
tests/unit/test_probes_identity.py; `MUTANTS` and `SHOWS` as in conformance/probes_edge.py.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from conformance.kvprobes import ProbeFailed, check, quiet
from conformance.probes_edge import _Clock, _DownClient, _FakePopen
from conformance.probes_parts import runtime_dir_env
from kvledger_connector.store import embedded, listeners
from kvledger_connector.store import rendezvous
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore


def _listen(stack: ExitStack, port: int = 0) -> tuple[socket.socket, int, int]:
    """A listener on 127.0.0.1:`port` (0: a free one), closed with `stack`: (socket, port, inode)."""
    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((embedded.LOOPBACK, port))
    s.listen(4)
    return s, s.getsockname()[1], os.fstat(s.fileno()).st_ino


class _Servers:
    """THIS IS A TEST DOUBLE: what `acquire` publishes of servers this process starts (none are started)."""

    def __init__(self, port: int, inode: int) -> None:
        self.master_address = f"{embedded.LOOPBACK}:{port}"
        self.metadata_server = f"http://{embedded.LOOPBACK}:{port}/metadata"
        self.master_inode = inode


# ---------------------------------------------------------------- 1. attach only to the recorded listener
def probe_attach_only_to_the_recorded_listener() -> None:
    """A live owner's file names its master's port and listener inode. While that listener is on the port,
    another process of the engine attaches and its handle is authentic; once another listener holds the
    port (the master died, a squatter bound it), the handle is not authentic, the file is not joined (this
    process starts its own servers), and an owner in another PID namespace counts as dead."""
    with tempfile.TemporaryDirectory() as tmp, runtime_dir_env(tmp), ExitStack() as socks:
        master, port, inode = _listen(socks)
        owner = rendezvous.owner_fields(os.getppid())  # a live process that is not this one
        path = Path(rendezvous.rendezvous_path("probe-id"))

        def plant(**over: Any) -> None:
            path.write_text(json.dumps({**owner, "master_address": f"{embedded.LOOPBACK}:{port}",
                                        "master_inode": inode,
                                        "metadata_server": f"http://{embedded.LOOPBACK}:{port}/metadata", **over}))
            path.chmod(0o600)

        def never() -> Any:
            raise ProbeFailed("a process of the engine started its own servers beside its owner's live master")

        plant()
        att = rendezvous.acquire("probe-id", never)
        check(isinstance(att, rendezvous.AttachedMooncake), f"the live owner's master was not joined: {att!r}")
        check(att.authentic(), "the attached handle does not authenticate the master it attached to")
        master.close()
        _, squat_port, squat_inode = _listen(socks, port)  # another process's listener on the master's port
        check(squat_port == port and squat_inode != inode, "probe: the squatter did not get the master's port")
        check(not att.authentic(), f"the attached handle trusts listener {squat_inode} on port {port}; its master "
                                   f"was {inode}")
        mine = _Servers(listeners.free_port(), 1)
        for where, over in (("this PID namespace", {}), ("another PID namespace", {"pid_ns": "pid:[1]"})):
            plant(**over)
            got = rendezvous.acquire("probe-id", lambda: mine)  # type: ignore[arg-type, return-value]
            check(got is mine, f"an owner in {where} whose port another listener holds (inode {squat_inode}, "
                               f"recorded {inode}) was joined: {got!r}")
        rendezvous.release("probe-id")


def _listed_by_port(orig):  # the recorded master is whatever accepts on its port
    def master_listed(info):
        orig(info)
        return listeners.port_accepts(info["master_port"])
    return master_listed


def _attached_by_port(orig):  # an attached handle trusts whatever accepts on the master's port
    def authentic(self):
        orig(self)
        return listeners.port_accepts(int(self.master_address.rsplit(":", 1)[1]))
    return authentic


# ---------------------------------------------------------------- 2. ready only on the server's own listener
def probe_a_server_is_ready_only_on_its_own_listener() -> None:
    """A port another process listens on when the spawned server should (it took the port after the busy
    check) is never taken for the server's: the start fails naming it, and no inode is recorded."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as socks:
        _, port, _ = _listen(socks)
        emb = embedded.EmbeddedMooncake(start=False, log_dir=tmp)
        emb._kill = lambda proc, sig=0: None  # type: ignore[method-assign, assignment]  (a double: no process)
        server = _FakePopen(4_100_000)  # a spawned server that has not bound yet (holds no socket)
        proc = embedded._Proc("probe-server", ["probe-server"], os.devnull, server)  # type: ignore[arg-type]
        try:
            t0 = time.monotonic()
            try:
                got = emb._wait_ready(proc, [port])
            except embedded.EmbeddedStartError:
                check(time.monotonic() - t0 < 5.0, "a server whose port another process holds was waited on "
                                                   "until its start timeout instead of refused")
            else:
                raise ProbeFailed(f"a listener the server does not hold on port {port} was taken as the server's "
                                  f"ready listener (inodes {got})")
        finally:
            server.exit(0)
            emb.stop()


def _ready_when_port_accepts(orig):  # readiness is "the port accepts": a squatter looks ready
    def _wait_ready(self, proc, ports):
        deadline = time.monotonic() + 5.0
        while not all(listeners.port_accepts(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [lst.inode if (lst := listeners.loopback_listener(p)) else 0 for p in ports]
    return _wait_ready


# ---------------------------------------------------------------- 3. a squatted port: move and republish
def probe_a_squatted_master_port_moves_and_is_republished() -> None:
    """The master died and another process holds its port: the restart does not wait for it, it starts the
    master on a fresh port, and the owner's rendezvous file then names the new address and inode."""
    with tempfile.TemporaryDirectory() as tmp, runtime_dir_env(tmp), ExitStack() as socks:
        _, old_port, _ = _listen(socks)  # the squatter on the dead master's port
        emb = embedded.EmbeddedMooncake(start=False, log_dir=tmp,
                                        on_restart=lambda e: rendezvous.republish("probe-move", e))
        emb.rpc_port, emb.metadata_port, emb.master_inode = old_port, listeners.free_port(), 1
        rendezvous.acquire("probe-move", lambda: emb)  # published as the engine's servers
        started: list[int] = []

        def start_master() -> None:  # the double of spawning mooncake_master: it binds where it is told
            check(not listeners.port_accepts(emb.rpc_port), f"the master was started on port {emb.rpc_port}, "
                                                           "which another process holds")
            _, port, inode = _listen(socks, emb.rpc_port)
            started.append(port)
            emb.master_inode = inode

        emb.start_master = start_master  # type: ignore[method-assign]
        try:
            with quiet("kvledger_connector.store.embedded"):  # the squatter is the probe's own doing
                emb.restart_master()
            check(started == [emb.rpc_port] and emb.rpc_port != old_port,
                  f"the restart started the master on {started}, its port {old_port} being another process's")
            info = json.loads(Path(rendezvous.rendezvous_path("probe-move")).read_text())
            want = (emb.master_address, emb.master_inode)
            check((info.get("master_address"), info.get("master_inode")) == want,
                  f"after the move the rendezvous file names {info.get('master_address')} inode "
                  f"{info.get('master_inode')}, not {want}")
        finally:
            emb.on_restart = None
            rendezvous.release("probe-move")
            emb.stop()


def _restart_on_the_same_port(orig):  # the old supervisor: a squatted port is waited for, then used anyway
    def _restart(self):
        with self._start_lock:
            if self._stopped or self.master_pid is not None:
                return False
            self.start_master()
            return True
    return _restart


def _restart_not_republished(orig):  # the owner never rewrites the file: attachers keep the dead master's
    def republish(engine_id, emb, *, lock_timeout_s=rendezvous.LOCK_TIMEOUT_S):
        return None
    return republish


# ---------------------------------------------------------------- 4. the store's breaker and authenticity
class _Handle:
    """THIS IS A TEST DOUBLE: an embedded handle whose master is authentic while ``ok`` is set."""

    def __init__(self) -> None:
        self.master_address = "127.0.0.1:1"
        self.moved_to: str | None = None
        self.ok = True

    def authentic(self) -> bool:
        return self.ok


def probe_the_store_never_trusts_an_unauthenticated_master() -> None:
    """With an embedded handle, a call finding the master not authentic opens the breaker without reaching
    the client (counted); a probe then sends nothing and leaves it open; once authentic, a probe closes it;
    a master that moved off this client's address keeps it open."""
    cfg = StoreConfig(master_server_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata",
                      local_hostname="127.0.0.1", unhealthy_backoff_ms=100, max_unhealthy_backoff_ms=100)
    raw, clock, handle = _DownClient(), _Clock(), _Handle()
    raw.up = True
    st = MooncakeStore(raw, cfg, handle, clock=clock, background_probe=False)  # type: ignore[arg-type]
    handle.ok = False
    with quiet("kvledger_connector.store"):  # the unauthentic master is the probe's own doing (client, breaker)
        res = st.batch_is_exist(["k"])
        check(st.breaker_open and raw.calls == 0 and res == [int(StoreCode.UNHEALTHY_SKIPPED)]
              and st.stats.total("master_unauthentic") == 1,
              f"a call to a master that is not authentic answered {res} with {raw.calls} client call(s), breaker "
              f"{'open' if st.breaker_open else 'closed'}, {st.stats.total('master_unauthentic')} counted")
        clock.t += st.skip_remaining_s + 1e-6
        check(not st.probe() and st.breaker_open and raw.calls == 0,
              f"a probe of a master that is not authentic closed the breaker or reached it ({raw.calls} calls)")
        handle.ok = True
        clock.t += st.skip_remaining_s + 1e-6
        check(st.probe() and not st.breaker_open, "a probe of the authentic master did not close the breaker")
        handle.master_address = "127.0.0.1:3"  # the owner moved it; this client stays on 127.0.0.1:1
        st.trip()
        clock.t += st.skip_remaining_s + 1e-6
        check(not st.probe() and st.breaker_open, "the breaker closed although the master moved off this "
                                                  "client's address")


def _store_trusts_any_master(orig):  # the store never asks who answers: a squatter closes its breaker
    def authentic(self):
        return True
    return authentic


PROBES: list[Callable[[], None]] = [
    probe_attach_only_to_the_recorded_listener, probe_a_server_is_ready_only_on_its_own_listener,
    probe_a_squatted_master_port_moves_and_is_republished, probe_the_store_never_trusts_an_unauthenticated_master,
]

Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    # acquire and owner_alive look master_listed up in the rendezvous module
    "master_identity_port_only": [(rendezvous, "master_listed", _listed_by_port)],
    "attached_master_identity_port_only": [(rendezvous.AttachedMooncake, "authentic", _attached_by_port)],
    "server_ready_when_port_accepts": [(embedded.EmbeddedMooncake, "_wait_ready", _ready_when_port_accepts)],
    "squatted_master_port_reused": [(embedded.EmbeddedMooncake, "_restart", _restart_on_the_same_port)],
    # the owner's on_restart calls republish through the rendezvous module
    "moved_master_not_republished": [(rendezvous, "republish", _restart_not_republished)],
    "store_trusts_any_master": [(MooncakeStore, "authentic", _store_trusts_any_master)],
}

#: the shows-probe of each mutant: the probe that observes the patched function directly
SHOWS: dict[str, Callable[[], None]] = {
    "master_identity_port_only": probe_attach_only_to_the_recorded_listener,
    "attached_master_identity_port_only": probe_attach_only_to_the_recorded_listener,
    "server_ready_when_port_accepts": probe_a_server_is_ready_only_on_its_own_listener,
    "squatted_master_port_reused": probe_a_squatted_master_port_moves_and_is_republished,
    "moved_master_not_republished": probe_a_squatted_master_port_moves_and_is_republished,
    "store_trusts_any_master": probe_the_store_never_trusts_an_unauthenticated_master,
}
