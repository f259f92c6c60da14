"""A private Mooncake deployment on loopback: `mooncake_master` + the standalone HTTP metadata server.

Used when no `master_server_address` is configured (embedded mode), by the integration tests and by the
benchmark. Both servers bind 127.0.0.1 only:

    mooncake_master --rpc_address=127.0.0.1 --metrics_host=127.0.0.1 --enable_http_metadata_server=false
    mooncake_http_metadata_server --host 127.0.0.1

(the master's *embedded* metadata server binds 0.0.0.0 whatever its host flag says, so we run the
standalone one). Mooncake *clients* — every `MooncakeDistributedStore.setup()`, i.e. every worker — open
their transfer-engine ports on all interfaces by Mooncake's design (hard-coded INADDR_ANY); no flag
confines them. Isolate hosts with a network namespace or firewall if that matters.

Processes are started in their own session and stopped by pid (`stop()`, idempotent, also at interpreter
exit). `restart_master()` kills and restarts the master on the same ports: every key is lost, as in a real
master restart, and connected clients re-mount after ~2 s.

Supervised (``supervise=True``, what the connector's embedded mode asks for): a thread of the owner waits on
the master process and, when it exits without `stop()`, starts a new one on the same ports, a failed start
retried after 1 s doubling up to `MAX_RESTART_BACKOFF_S`. The new master has no keys (every stored block is a
miss again); the engine's clients, the owner's and those of the attached processes, reconnect to the same
address and their store breakers close at the next probe. The metadata server is not restarted.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_START_TIMEOUT_S = 30.0
MAX_RESTART_BACKOFF_S = 30.0  # a supervised master that keeps failing to start is retried at most this often
# flags we set ourselves; overriding them could open a listener beyond loopback or break readiness
_OWN_FLAGS = frozenset({"--rpc_address", "--rpc_port", "--port", "--enable_http_metadata_server",
                        "--http_metadata_server_host", "--http_metadata_server_port", "--metrics_host",
                        "--metrics_port", "--logtostderr"})


class EmbeddedStartError(RuntimeError):
    """A server did not come up; the message carries its command line and the tail of its log."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks; a race with other binders is retried by start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_accepts(port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout).close()
        return True
    except OSError:
        return False


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
    ("http://127.0.0.1:port/metadata"), `master_pid`, `metadata_pid`, `log_dir`.
    """

    def __init__(self, *, start: bool = True, rpc_timeout_ms: int = 2000, lease_ttl_ms: int = 2000,
                 client_ttl_s: int = 10, log_dir: str | None = None, quiet: bool = True,
                 extra_master_flags: Sequence[str] = (), supervise: bool = False) -> None:
        for name, value in (("rpc_timeout_ms", rpc_timeout_ms), ("lease_ttl_ms", lease_ttl_ms),
                            ("client_ttl_s", client_ttl_s)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmbeddedMooncake {name}={value!r}: must be an int >= 1")
        bad = [f for f in extra_master_flags if not f.startswith("--") or f.split("=")[0] in _OWN_FLAGS]
        if bad:
            raise ValueError(f"EmbeddedMooncake extra_master_flags={bad!r}: must be --flag[=value] and not one of "
                             f"{sorted(_OWN_FLAGS)} (those keep every listener on 127.0.0.1)")
        self.extra_master_flags = tuple(extra_master_flags)
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
        self.num_master_restarts = 0  # by the supervisor
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
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    @property
    def master_pid(self) -> int | None:
        return self._pid(self._master)

    @property
    def metadata_pid(self) -> int | None:
        return self._pid(self._metadata)

    @staticmethod
    def _pid(p: _Proc | None) -> int | None:
        return p.popen.pid if p is not None and p.popen is not None and p.popen.poll() is None else None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> EmbeddedMooncake:
        """Pick free ports and start both servers; retries port races, then raises `EmbeddedStartError`."""
        if self._stopped:
            raise EmbeddedStartError("this EmbeddedMooncake was stopped; create a new one")
        last: Exception | None = None
        for _ in range(3):
            self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
            try:
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
            "--logtostderr", f"--minloglevel={1 if self.quiet else 0}", *self.extra_master_flags]
        self._refuse_busy("master", [self.rpc_port, self.metrics_port])
        self._master = self._spawn("master", cmd)
        self._wait_ready(self._master, [self.rpc_port])

    def _supervise(self) -> None:
        """Wait on the master; restart it on its ports whenever it exits before `stop()` (module doc)."""
        backoff = 1.0
        while not self._stopped:
            proc = self._master
            if proc is not None and proc.popen is not None:
                rc = proc.popen.wait()
                if self._stopped:
                    return
                logger.warning("embedded mooncake_master (pid %d) exited with %s; restarting it on %s (its keys "
                               "are lost)", proc.popen.pid, rc, self.master_address)
            try:
                self._wait_master_port_free()
                if self._stopped:
                    return
                self.start_master()
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
            with self._restarted:
                self.num_master_restarts += 1
                self._restarted.notify_all()
            logger.warning("embedded mooncake_master restarted (pid %s, restart %d)", self.master_pid,
                           self.num_master_restarts)

    def _wait_master_port_free(self, timeout_s: float = 10.0) -> None:
        """The old master's listener must be gone before a new one binds its port (at most `timeout_s`;
        `stop()` cuts the wait short)."""
        deadline = time.monotonic() + timeout_s
        while port_accepts(self.rpc_port) and time.monotonic() < deadline and not self._stopped:
            self._wake.wait(0.05)

    def wait_restarts(self, n: int, timeout: float) -> bool:
        """Whether the supervisor has restarted the master at least ``n`` times within ``timeout`` seconds."""
        with self._restarted:
            return self._restarted.wait_for(lambda: self.num_master_restarts >= n, timeout)

    def start_holder(self, segment_size: int) -> int:
        """Start a storage-only `mooncake_client` contributing `segment_size` bytes to the pool (RPC port on
        127.0.0.1); returns its pid. Workers can then run with ``global_segment_size=0`` and every byte they
        store crosses a real TCP connection, and stored KV outlives any one worker (Mooncake §6 advice)."""
        if isinstance(segment_size, bool) or not isinstance(segment_size, int) or segment_size < (1 << 20):
            raise ValueError(f"start_holder segment_size={segment_size!r}: must be an int >= 1 MiB")
        if self._pid(self._master) is None:
            raise EmbeddedStartError("start_holder: the master is not running")
        port = free_port()
        cmd = _tool("mooncake_client") + [
            f"--host={LOOPBACK}", f"--port={port}", f"--global_segment_size={segment_size >> 20}MB",
            f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata_server}",
            "--protocol=tcp", "--logtostderr", f"--minloglevel={1 if self.quiet else 0}"]
        self._refuse_busy("holder", [port])
        proc = self._spawn(f"holder-{len(self._holders)}", cmd)
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
        """Kill the master and start it again on the same ports. All keys are lost."""
        self.kill_master()
        if down_s > 0:
            time.sleep(down_s)
        self._wait_master_port_free()
        self.start_master()

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

    def _spawn(self, name: str, cmd: list[str]) -> _Proc:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        cmd = _pdeathsig_prefix() + cmd
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=_child_env(self.rpc_timeout_ms), start_new_session=True)
        return _Proc(name, cmd, log_path, popen)

    @staticmethod
    def _refuse_busy(name: str, ports: list[int]) -> None:
        # readiness is "the port accepts": a port someone else already serves would look ready at once
        busy = [p for p in ports if port_accepts(p)]
        if busy:
            raise EmbeddedStartError(f"mooncake {name}: port(s) {busy} on {LOOPBACK} already in use")

    def _wait_ready(self, proc: _Proc, ports: list[int]) -> None:
        popen = proc.popen
        if popen is None:
            raise EmbeddedStartError(f"{proc.name}: not spawned")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(port_accepts(p) for p in ports):
            rc = popen.poll()
            if rc is not None or time.monotonic() > deadline:
                why = f"exited with code {rc}" if rc is not None else f"not accepting after {_START_TIMEOUT_S}s"
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
