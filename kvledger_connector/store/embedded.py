"""A private Mooncake deployment on loopback: `mooncake_master`, and the standalone HTTP metadata server
unless the clients find each other by Mooncake's peer-to-peer handshake.

Used when no `master_server_address` is configured (embedded mode), by the integration tests and by the
benchmark. Every server binds 127.0.0.1 only:

    mooncake_master --rpc_address=127.0.0.1 --metrics_host=127.0.0.1 --enable_http_metadata_server=false
    mooncake_http_metadata_server --host 127.0.0.1          (``http_metadata=True`` only)

(the master's *embedded* metadata server binds 0.0.0.0 whatever its host flag says, so we run the
standalone one). With ``http_metadata=False`` (what the connector's embedded default asks for) there is no
metadata server at all: `metadata_server` is ``P2PHANDSHAKE``, and a client asks a segment's owner for its
descriptor (buffers, data port) at the owner's own handshake port, the port the segment is named by; the
owner answers with its own descriptor and keeps nothing a caller sends. The HTTP server instead takes an
unauthenticated PUT from any local user, who can then rewrite a segment's data port to a listener of theirs
and receive the KV another process of the engine sends there.

Each Mooncake *client* (every `setup()`: the scheduler's and every worker rank's) listens
on two TCP ports, random in 15000-17000: the transfer engine's handshake port on 0.0.0.0 and the TCP
transport's data port on [::] (dual-stack). Mooncake hard-codes the wildcard; `MC_TCP_BIND_ADDRESS` only
sets the address it advertises. Whoever reaches the data port reads and writes the client's registered
memory, unauthenticated: across hosts, firewall these ports (`python -m kvledger_connector.store.transfer_ports`);
against other users of this host, `firewall: "nftables"` (kvledger_connector/store/firewall.py).

Processes are started in their own session and stopped by pid (`stop()`, idempotent, also at interpreter
exit). `restart_master()` kills and restarts the master on the same ports: every key is lost, as in a real
master restart, and connected clients re-mount after ~2 s.

Supervised (``supervise=True``, what the connector's embedded mode asks for): a thread of the owner waits on
the master process and, when it exits without `stop()`, starts a new one on the same ports, a failed start
retried after 1 s doubling up to `MAX_RESTART_BACKOFF_S`. The new master has no keys (every stored block is a
miss again); the engine's clients, the owner's and those of the attached processes, reconnect to the same
address and their store breakers close at the next probe. The metadata server is not restarted.

Identity. A port that accepts proves nothing: once the master is gone any local process may bind its port.
The kernel's word is what counts: the master is the LISTEN socket on 127.0.0.1:<rpc port> whose inode
(`loopback_listener`, from /proc/self/net/tcp: loopback is per network namespace, so every process that
reaches the master on 127.0.0.1 reads the same table) is held by the spawned pid (`holds_socket`). No other
process can choose that inode. A server is ready only when its own listener is there (never "the port
accepts"); `master_inode` records the master's after each (re)start, and `authentic()` is "that listener
is still the one on the port". When the old master is gone and another process holds its port, the
supervisor does not wait for it: it warns (port, uid) and starts the master on a fresh port, then calls
`on_restart` (the rendezvous owner republishes the new address and inode; kvledger_connector/store/rendezvous.py).
Clients on the old address cannot follow: their stores stay shut (kvledger_connector/store/client.py) until the
engine restarts.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvledger.counts import Counter, Counts
from kvledger_connector.store.listeners import (
    LOOPBACK,
    free_port,
    holders_text,
    holds_socket,
    loopback_listener,
    port_accepts,
)

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
#: where a Mooncake client with the disk tier writes (an existing absolute directory, one live client each)
OFFLOAD_PATH_ENV = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
MAX_RESTART_BACKOFF_S = 30.0  # a supervised master that keeps failing to start is retried at most this often
#: Mooncake's `metadata_server` value for its peer-to-peer handshake: no metadata server (module doc)
P2P_HANDSHAKE = "P2PHANDSHAKE"
# flags we set ourselves; overriding them could open a listener beyond loopback or break readiness
_OWN_FLAGS = frozenset({"--rpc_address", "--rpc_port", "--port", "--enable_http_metadata_server",
                        "--http_metadata_server_host", "--http_metadata_server_port", "--metrics_host",
                        "--metrics_port", "--logtostderr"})


class EmbeddedStartError(RuntimeError):
    """A server did not come up; the message carries its command line and the tail of its log."""


def _tool(name: str) -> list[str]:
    """Command prefix for a Mooncake console tool: next to this interpreter first, then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(here):
        return [here]
    found = shutil.which(name)
    if found:
        return [found]
    if name == "mooncake_http_metadata_server":
        return [sys.executable, "-m", "mooncake.http_metadata_server"]
    raise EmbeddedStartError(f"{name} not found next to {sys.executable} nor on PATH; "
                             "install mooncake-transfer-engine(-non-cuda)")


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"<no log: {e}>"


def _pdeathsig_prefix() -> list[str]:
    """`setpriv --pdeathsig KILL --` when available and called from the main thread: the kernel kills the
    server when this process dies, even by SIGKILL (no atexit then), so a killed or timed-out test run
    leaves no master behind. The signal follows the spawning *thread*, hence the main thread only, or a
    supervisor thread (it lives until the servers are stopped)."""
    me = threading.current_thread()
    if (me is not threading.main_thread() and not getattr(me, "kvl_outlives_children", False)) \
            or not sys.platform.startswith("linux"):
        return []
    global _SETPRIV
    if _SETPRIV is None:
        path = shutil.which("setpriv")
        ok = False
        if path:
            try:
                ok = "--pdeathsig" in subprocess.run([path, "--help"], capture_output=True, text=True,
                                                     timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                ok = False
        _SETPRIV = [path, "--pdeathsig", "KILL", "--"] if ok and path else []
    return list(_SETPRIV)


_SETPRIV: list[str] | None = None


@dataclass
class _Proc:
    name: str
    cmd: list[str]
    log_path: str
    popen: subprocess.Popen[bytes] | None = None


def _child_env(rpc_timeout_ms: int) -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    env["MC_RPC_TIMEOUT_MS"] = str(rpc_timeout_ms)
    return env


class EmbeddedMooncake:
    """Starts on construction (unless ``start=False``); ``with EmbeddedMooncake() as mc: ...`` stops it.

    Attributes once started: `master_address` ("127.0.0.1:port"), `metadata_server`
    ("http://127.0.0.1:port/metadata", or ``P2PHANDSHAKE`` with ``http_metadata=False``: no metadata server;
    module doc), `master_pid`, `master_inode` (its listener's socket inode), `metadata_pid` (None without
    one), `log_dir`, `restarts` (the supervisor's restarts of this master). ``on_restart``: called
    with this object after each restart of the master (by the supervisor or `restart_master`), from the
    restarting thread, once the new master is ready; its address may have moved (module doc).
    ``disk_offload``: the master takes Mooncake's disk tier (``--enable_offload=true``; docs/disk-tier.md).
    ``stats``: the counter sink the supervisor counts ``master_restarts`` into (its own `Counts` if none).
    """

    moved_to: str | None = None  # the owner's handle follows its master: `master_address` is where it is

    def __init__(self, *, start: bool = True, rpc_timeout_ms: int = 2000, lease_ttl_ms: int = 2000,
                 client_ttl_s: int = 10, log_dir: str | None = None, quiet: bool = True,
                 extra_master_flags: Sequence[str] = (), supervise: bool = False,
                 on_restart: Callable[[EmbeddedMooncake], None] | None = None, disk_offload: bool = False,
                 stats: Counter | None = None, http_metadata: bool = True) -> None:
        for name, value in (("rpc_timeout_ms", rpc_timeout_ms), ("lease_ttl_ms", lease_ttl_ms),
                            ("client_ttl_s", client_ttl_s)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmbeddedMooncake {name}={value!r}: must be an int >= 1")
        bad = [f for f in extra_master_flags if not f.startswith("--") or f.split("=")[0] in _OWN_FLAGS]
        if bad:
            raise ValueError(f"EmbeddedMooncake extra_master_flags={bad!r}: must be --flag[=value] and not one of "
                             f"{sorted(_OWN_FLAGS)} (those keep every listener on 127.0.0.1)")
        self.extra_master_flags = tuple(extra_master_flags)
        self.http_metadata = bool(http_metadata)
        # the master takes the disk tier of the clients that write one (docs/disk-tier.md)
        self.disk_offload = bool(disk_offload)
        self.rpc_timeout_ms = rpc_timeout_ms
        # short leases let tests remove/evict recently read keys; Mooncake's default is 10 s
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.quiet = quiet
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvledger-mooncake-")
        self.rpc_port = 0
        self.metadata_port = 0
        self.metrics_port = 0
        self._master: _Proc | None = None
        self._metadata: _Proc | None = None
        self._holders: list[_Proc] = []
        self._stopped = False
        self.supervise = supervise
        self.on_restart = on_restart
        self.master_inode = 0  # the master's listener (socket inode) since its last start; 0: none yet
        # the counter sink: master_restarts (by the supervisor); `restarts` counts this master's alone
        self.stats: Counter = stats if stats is not None else Counts()
        self.restarts = 0
        self._start_lock = threading.Lock()  # the supervisor vs restart_master: one starts the master
        self._restarted = threading.Condition()
        self._supervisor: threading.Thread | None = None
        self._wake = threading.Event()  # stop() cuts a supervisor's backoff short
        # stop at interpreter exit even if the owner forgets; weak so the object can still be collected
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda o: o.stop() if o is not None else None)(ref())
        atexit.register(self._atexit)
        if start:
            self.start()

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata" if self.http_metadata else P2P_HANDSHAKE

    @property
    def master_pid(self) -> int | None:
        return self._pid(self._master)

    @property
    def metadata_pid(self) -> int | None:
        return self._pid(self._metadata)

    @property
    def server_pids(self) -> list[int]:
        """Every server of this deployment that runs: master, metadata server, holders."""
        return [pid for pid in (self.master_pid, self.metadata_pid, *self.holder_pids) if pid is not None]

    @staticmethod
    def _pid(p: _Proc | None) -> int | None:
        return p.popen.pid if p is not None and p.popen is not None and p.popen.poll() is None else None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> EmbeddedMooncake:
        """Pick free ports and start the servers; retries port races, then raises `EmbeddedStartError`."""
        if self._stopped:
            raise EmbeddedStartError("this EmbeddedMooncake was stopped; create a new one")
        last: Exception | None = None
        for _ in range(3):
            self.rpc_port, self.metrics_port = free_port(), free_port()
            self.metadata_port = free_port() if self.http_metadata else 0
            try:
                if self.http_metadata:
                    self._start_metadata()
                self.start_master()
                if self.supervise and self._supervisor is None:
                    t = threading.Thread(target=self._supervise, name="kvledger-mooncake-supervisor", daemon=True)
                    t.kvl_outlives_children = True  # type: ignore[attr-defined]  (see _pdeathsig_prefix)
                    self._supervisor = t
                    t.start()
                return self
            except EmbeddedStartError as e:
                last = e
                self._kill(self._master)
                self._kill(self._metadata)
        raise last if last is not None else EmbeddedStartError("unreachable")

    def _start_metadata(self) -> None:
        cmd = _tool("mooncake_http_metadata_server") + [
            "--host", LOOPBACK, "--port", str(self.metadata_port),
            "--log-level", "WARNING" if self.quiet else "INFO"]
        self._refuse_busy("metadata", [self.metadata_port])
        self._metadata = self._spawn("metadata", cmd)
        self._wait_ready(self._metadata, [self.metadata_port])

    def start_master(self) -> None:
        """Start the master on the current ports (after `kill_master`, the same ports)."""
        if self._pid(self._master) is not None:
            raise EmbeddedStartError(f"mooncake_master already running (pid {self.master_pid})")
        cmd = _tool("mooncake_master") + [
            f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=false",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            *(["--enable_offload=true"] if self.disk_offload else []),
            "--logtostderr", f"--minloglevel={1 if self.quiet else 0}", *self.extra_master_flags]
        self._refuse_busy("master", [self.rpc_port, self.metrics_port])
        self._master = self._spawn("master", cmd)
        self.master_inode = 0
        self.master_inode = self._wait_ready(self._master, [self.rpc_port])[0]

    def authentic(self) -> bool:
        """Whether the listener on 127.0.0.1:`rpc_port` is still this master's (the socket inode it was
        ready with) and the master runs: False once it died, and whoever took its port after it."""
        lst = loopback_listener(self.rpc_port)
        return (self.master_pid is not None and self.master_inode > 0 and lst is not None
                and lst.inode == self.master_inode and lst.uid == os.getuid())

    def _supervise(self) -> None:
        """Wait on the master; restart it whenever it exits before `stop()`, on its ports unless another
        process took them (module doc)."""
        backoff = 1.0
        while not self._stopped:
            proc = self._master
            if proc is not None and proc.popen is not None:
                rc = proc.popen.wait()
                if self._stopped:
                    return
                logger.warning("embedded mooncake_master (pid %d) exited with %s; restarting it (its keys "
                               "are lost)", proc.popen.pid, rc)
            try:
                started = self._restart()
                if self._stopped:  # stop() ran meanwhile and may have missed the new master
                    self._kill(self._master, signal.SIGTERM)
                    return
            except EmbeddedStartError as e:
                if self.master_pid is not None:  # started meanwhile (restart_master): wait on that one
                    continue
                logger.warning("embedded mooncake_master did not restart (%s); retrying in %.0f s",
                               str(e).splitlines()[0], backoff)
                if self._wake.wait(backoff):
                    return
                backoff = min(backoff * 2, MAX_RESTART_BACKOFF_S)
                continue
            backoff = 1.0
            if not started:  # restart_master started it: wait on that one
                continue
            with self._restarted:
                self.restarts += 1
                self._restarted.notify_all()
            self.stats.add("master_restarts")
            logger.warning("embedded mooncake_master restarted (pid %s, restart %d) on %s", self.master_pid,
                           self.restarts, self.master_address)
            self._announce()

    def _restart(self) -> bool:
        """Start the master unless one runs (True: this call started it). A port of the dead master that
        accepts is another process's: the master moves to a fresh one rather than wait for it."""
        with self._start_lock:
            if self._stopped or self.master_pid is not None:
                return False
            for name in ("rpc_port", "metrics_port"):
                port = getattr(self, name)
                if port_accepts(port):
                    new = free_port()
                    logger.warning("embedded mooncake_master's %s is taken by another process (%s); the master "
                                   "moves to port %d", name, holders_text(port), new)
                    setattr(self, name, new)
            self.start_master()
            return True

    def _announce(self) -> None:
        if self.on_restart is None:
            return
        try:
            self.on_restart(self)
        except Exception:  # the supervisor must outlive a failed republish; the caller logs its own cause
            logger.exception("embedded mooncake_master restarted at %s, but on_restart failed",
                             self.master_address)

    def wait_restarts(self, n: int, timeout: float) -> bool:
        """Whether the supervisor has restarted the master at least ``n`` times within ``timeout`` seconds."""
        with self._restarted:
            return self._restarted.wait_for(lambda: self.restarts >= n, timeout)

    def start_holder(self, segment_size: int, *, offload_env: Mapping[str, str] | None = None) -> int:
        """Start a storage-only `mooncake_client` contributing `segment_size` bytes to the pool (RPC port on
        127.0.0.1); returns its pid. Workers can then run with ``global_segment_size=0`` and every byte they
        store crosses a real TCP connection, and stored KV outlives any one worker (Mooncake §6 advice).
        ``offload_env``: the holder writes Mooncake's disk tier, with these variables (kvledger_connector's
        `store.tier.offload_environment`: its directory, an existing absolute path, and the rest); the
        master must take the tier (``disk_offload``)."""
        if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size < (1 << 20):
            raise ValueError(f"start_holder segment_size={segment_size!r}: must be an int >= 1 MiB")
        if self._pid(self._master) is None:
            raise EmbeddedStartError("start_holder: the master is not running")
        tier: list[str] = []
        if offload_env is not None:
            where = offload_env.get(OFFLOAD_PATH_ENV, "")
            if not self.disk_offload:
                raise ValueError("start_holder offload_env: this master was started without disk_offload")
            if not os.path.isabs(where) or not os.path.isdir(where):
                raise ValueError(f"start_holder offload_env {OFFLOAD_PATH_ENV}={where!r}: must be an existing "
                                 "absolute directory")
            tier = ["--enable_offload=true"]
        port = free_port()
        cmd = _tool("mooncake_client") + [
            f"--host={LOOPBACK}", f"--port={port}", f"--global_segment_size={segment_size >> 20}MB",
            f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata_server}",
            "--protocol=tcp", *tier, "--logtostderr", f"--minloglevel={1 if self.quiet else 0}"]
        self._refuse_busy("holder", [port])
        proc = self._spawn(f"holder-{len(self._holders)}", cmd, offload_env)
        self._wait_ready(proc, [port])
        self._holders.append(proc)
        return proc.popen.pid if proc.popen is not None else -1

    @property
    def holder_pids(self) -> list[int]:
        return [pid for pid in (self._pid(h) for h in self._holders) if pid is not None]

    def kill_holder(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Kill one holder by pid (the data in its segment is gone: readers see -800, then -704)."""
        for h in self._holders:
            if h.popen is not None and h.popen.pid == pid:
                self._kill(h, sig)
                return
        raise ValueError(f"kill_holder pid={pid!r}: not a holder of this deployment ({self.holder_pids})")

    def kill_master(self, sig: int = signal.SIGKILL) -> None:
        """Kill the master by pid (SIGKILL by default: a crash). Clients see -900 until it is back."""
        self._kill(self._master, sig)

    def restart_master(self, down_s: float = 0.0) -> None:
        """Kill the master and start it again on the same ports (fresh ones only if another process took
        them meanwhile; `on_restart` says where). All keys are lost. Under a supervisor, whichever of the
        two comes first starts it."""
        self.kill_master()
        if down_s > 0:
            time.sleep(down_s)
        if self._restart():
            self._announce()
        elif self.master_pid is None:
            raise EmbeddedStartError("restart_master: this EmbeddedMooncake was stopped")

    def stop(self) -> None:
        """Kill every server by pid. Idempotent; also called at interpreter exit. Bounded: each process
        gets SIGTERM (and SIGCONT, in case it was stopped), then SIGKILL after 10 s; a failure to stop one
        does not keep the others running (the first error is raised after all were tried)."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        first: BaseException | None = None
        for proc in [*self._holders, self._master, self._metadata]:
            try:
                self._kill(proc, signal.SIGTERM)
            except Exception as e:
                first = first or e
        atexit.unregister(self._atexit)
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if first is not None:
            raise EmbeddedStartError(f"stopping mooncake servers: {type(first).__name__}: {first}") from first

    def __enter__(self) -> EmbeddedMooncake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers -----------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], extra_env: Mapping[str, str] | None = None) -> _Proc:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        cmd = _pdeathsig_prefix() + cmd
        env = _child_env(self.rpc_timeout_ms)
        env.update(extra_env or {})
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        return _Proc(name, cmd, log_path, popen)

    @staticmethod
    def _refuse_busy(name: str, ports: list[int]) -> None:
        # a clear error for a port already served (readiness would refuse it too, after the spawn)
        busy = [p for p in ports if port_accepts(p)]
        if busy:
            raise EmbeddedStartError(f"mooncake {name}: port(s) {busy} on {LOOPBACK} already in use")

    def _wait_ready(self, proc: _Proc, ports: list[int]) -> list[int]:
        """Until the spawned process itself listens on 127.0.0.1 at every port (setpriv execs: its pid is
        the server's): their socket inodes. "The port accepts" is never ready: another process that took a
        port after `_refuse_busy` fails the start at once, naming it."""
        popen = proc.popen
        if popen is None:
            raise EmbeddedStartError(f"{proc.name}: not spawned")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            inodes: list[int] = []
            for p in ports:
                lst = loopback_listener(p)
                if lst is None:
                    continue
                if holds_socket(popen.pid, lst.inode):
                    inodes.append(lst.inode)
                elif popen.poll() is None:
                    self._kill(proc)
                    raise EmbeddedStartError(f"mooncake {proc.name}: another process listens on {LOOPBACK}:{p} "
                                             f"({holders_text(p)}); not taken for the server")
            if len(inodes) == len(ports):
                return inodes
            rc = popen.poll()
            if rc is not None or time.monotonic() > deadline:
                why = f"exited with code {rc}" if rc is not None else f"not listening after {_START_TIMEOUT_S}s"
                self._kill(proc)
                raise EmbeddedStartError(
                    f"mooncake {proc.name} {why} (ports {ports}); command: {' '.join(proc.cmd)}\n"
                    f"--- last lines of {proc.log_path} ---\n{_tail(proc.log_path)}")
            time.sleep(0.05)

    @staticmethod
    def _kill(proc: _Proc | None, sig: int = signal.SIGKILL) -> None:
        if proc is None or proc.popen is None or proc.popen.poll() is not None:
            return
        try:
            os.kill(proc.popen.pid, sig)
            if sig != signal.SIGKILL:
                os.kill(proc.popen.pid, signal.SIGCONT)  # a stopped (hung) process acts on SIGTERM at once
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)
        except ProcessLookupError:
            pass
