"""The embedded default across an engine's processes: one private Mooncake per engine, found by the rest.

With no `master_server_address`, a multi-process engine (`vllm serve --tensor-parallel-size 2`: the
scheduler-side connector in the EngineCore process, one worker-side connector per worker process) must
use ONE master, or the scheduler looks up keys on a master no worker writes to. All processes of one
engine carry the same `kv_transfer_config.engine_id` (the config is pickled to every worker), so:

    <runtime dir>/embedded-<engine_id>.json     {"pid", "start_time", "pid_ns", "master_address",
                                                 "master_inode", "metadata_server": "P2PHANDSHAKE"}
    <runtime dir>/.lock                         flock: one process at a time decides (waited for at most
                                                `LOCK_TIMEOUT_S`, then a RendezvousError)

    the first process to arrive starts the master and writes the file; the others attach to it. The
    engine's clients find each other by Mooncake's peer-to-peer handshake: there is no metadata server
    whose segment addresses another local user could rewrite (kvledger_connector/store/embedded.py).
    The servers die with their owner (parent-death SIGKILL), so a crashed engine leaves no server;
    the owner removes the file at shutdown, and every acquire first sweeps files whose owner is dead.

The master is known by its listener, not by its port: `master_inode` is the socket inode of the LISTEN
socket on 127.0.0.1:<master port> (kvledger_connector/store/embedded.py, `loopback_listener`), which no other
process can choose. A process attaches only while the listener on that port has exactly that inode and
this user's uid: anything else that took the port after the master died (another user's process too)
is never joined; the file is then not trusted and this process starts its own servers. The owner rewrites
the file after each restart of its master (a new inode, and a fresh port when another process took the old
one: `republish`); an attached process follows a new inode on the same address, and one whose master moved
keeps its store shut until the engine restarts (kvledger_connector/store/client.py).

An owner is alive when its pid runs with the start time the file records (a reused pid is another
process); an owner in another PID namespace sharing the directory (its pid means nothing here) is alive
while its master's listener, the recorded inode, is on the master port, since its servers die with it.

The runtime dir (`runtime_dir`) is, in order: `$KVLEDGER_RUNTIME_DIR`; `$XDG_RUNTIME_DIR/kvledger` when
`$XDG_RUNTIME_DIR` is this user's private directory (0700, not a link); else a directory of the engine's own,
`<tmp>/kvledger-<uid>-<tag>`, whose tag another user cannot know in advance, so cannot take the name before
the engine does. The tag hashes what every process of the engine has and no other user sees: the engine id
(vLLM makes it a random UUID in the first process and pickles the config to the EngineCore and every worker,
never on a command line) and `$KVLEDGER_RUNTIME_TOKEN`, random, which the connector's vLLM plugin puts into
the environment of the first vLLM process before it spawns any other (so an engine id the operator chose is
still behind a secret; /proc/<pid>/environ is readable by its user and root only). Whichever it is, it is
created 0700 and refused, by name, when it is not a directory, another user owns it, others may write to it,
or a directory above it lets another user replace it (`unsafe_ancestor`). Nothing in it is trusted: files are opened without
following symlinks, a file not owned by this user, writable by others, larger than `MAX_FILE_BYTES` or not
naming servers on 127.0.0.1 by decimal ports and the master's listener inode is not joined (it is swept like
a dead owner's), and files are written with O_EXCL, mode 0600. The engine's integrity secret
(`engine_secret`) lives there too::

    <runtime dir>/secret-<engine_id>.key        32 random bytes, O_EXCL|O_NOFOLLOW, mode 0600

    the first process of the engine to ask generates it under the lock, the others read it; every reading
    (the generator's too) is checked like an operator's file (kvledger_connector/ownfile.py) in a directory
    no one else may enter (0700). The owner removes it with the engine's file at shutdown, and a sweep
    removes it with a dead owner's file (a start-up that fails before it publishes servers leaves it for
    the next process of the same engine id: it stays private and is still a secret).

Within one process the connectors of an engine share one handle, reference counted
(`acquire_shared` / `release_shared`). Only processes on this host can attach: a multi-node engine must configure
`master_server_address` (the connector refuses the embedded default when `parallel_config.nnodes > 1`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.counts import Counter
from kvledger.errors import LedgerInputError
from kvledger_connector.store.embedded import P2P_HANDSHAKE, EmbeddedMooncake
from kvledger_connector.store.listeners import LOOPBACK, loopback_listener
from kvledger_connector.ownfile import read_own_file, unsafe_ancestor

RUNTIME_DIR_ENV = "KVLEDGER_RUNTIME_DIR"
RUNTIME_TOKEN_ENV = "KVLEDGER_RUNTIME_TOKEN"  # set by kvledger_connector/plugin.py in the first vLLM process
XDG_ENV = "XDG_RUNTIME_DIR"
MAX_FILE_BYTES = 4096  # a rendezvous file is ~120 bytes
SECRET_BYTES = 32  # a generated integrity secret: the key size of HMAC-SHA256 and BLAKE3
LOCK_TIMEOUT_S = 300.0  # the holder may be starting the servers (each waits up to 30 s to accept, with retries)
_LOCK_POLL_S = 0.05
_MASTER_RE = re.compile(rf"{re.escape(LOOPBACK)}:([0-9]{{1,5}})")  # what EmbeddedMooncake publishes, exactly
_METADATA_RE = re.compile(rf"http://{re.escape(LOOPBACK)}:([0-9]{{1,5}})/metadata")

logger = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """The runtime directory is unusable (wrong owner, not a directory); the message says which and why."""


@dataclass
class AttachedMooncake:
    """Another process's embedded servers, as the rendezvous file at `path` named them when this process
    attached; stopping is its owner's job."""

    master_address: str
    metadata_server: str
    owner_pid: int
    master_inode: int  # the master's listener this process authenticated (follows a restart on its address)
    path: str = ""
    owner: tuple[int, int, str] = (0, 0, "")  # the file's (pid, start_time, pid_ns): who may republish
    moved_to: str | None = field(default=None, compare=False)  # the owner republished another address

    def authentic(self) -> bool:
        """Whether the listener on the master's port is the master this process attached to: the inode it
        attached by, or the one its owner republished for the same address after a restart. A master the
        owner moved elsewhere is not (`moved_to` says where): this process's client cannot follow it."""
        port = int(self.master_address.rsplit(":", 1)[1])
        lst = loopback_listener(port)
        if lst is not None and lst.uid == os.getuid() and lst.inode == self.master_inode:
            return True
        info = _read(self.path) if self.path else None
        if info is None or (info["pid"], info["start_time"], info["pid_ns"]) != self.owner:
            return False
        if info["master_address"] != self.master_address:
            self.moved_to = info["master_address"]
            return False
        if lst is not None and lst.uid == os.getuid() and lst.inode == info["master_inode"]:
            self.master_inode = info["master_inode"]
            return True
        return False

    @property
    def server_pids(self) -> list[int]:
        """None of the servers are this process's (their owner's `EmbeddedMooncake.server_pids`)."""
        return []

    def stop(self) -> None:
        return


def runtime_tag(engine_id: str) -> str:
    """The private part of an engine's directory name under <tmp> (module doc): the same in every process of
    the engine, unknown to other users while the engine id or the token is."""
    token = os.environ.get(RUNTIME_TOKEN_ENV, "")
    return hashlib.sha256(f"kvledger-runtime\0{token}\0{engine_id}".encode()).hexdigest()[:32]


_xdg_warned = False


def _xdg_dir() -> str | None:
    """$XDG_RUNTIME_DIR when it is this user's private directory, else None (under su or sudo it often still
    names the invoking user's)."""
    global _xdg_warned
    d = os.environ.get(XDG_ENV, "")
    if not d:
        return None
    try:
        st = os.lstat(d)
        ok = (os.path.isabs(d) and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
              and not st.st_mode & 0o077)
    except OSError:
        ok = False
    if not ok and not _xdg_warned:
        _xdg_warned = True
        logger.warning("%s=%r is not this user's private directory (0700, not a link); the embedded store's "
                       "runtime directory is a private one under %s instead", XDG_ENV, d, tempfile.gettempdir())
    return d if ok else None


def runtime_dir(engine_id: str = "") -> str:
    """The directory of `engine_id`'s rendezvous files and secret (module doc), created 0700 and checked;
    `RendezvousError` naming the setting and the path when another user could read, plant or swap in it."""
    explicit, xdg = os.environ.get(RUNTIME_DIR_ENV), None
    if explicit:
        d, named = explicit, f"{RUNTIME_DIR_ENV}={explicit!r}"
    elif (xdg := _xdg_dir()) is not None:
        d = os.path.join(xdg, "kvledger")
        named = f"{XDG_ENV}'s {d!r}"
    else:
        d = os.path.join(tempfile.gettempdir(), f"kvledger-{os.geteuid()}-{runtime_tag(engine_id)}")
        named = f"the runtime directory {d!r}"
    fix = f"set {RUNTIME_DIR_ENV} to a private directory"
    try:
        os.makedirs(d, 0o700, exist_ok=True)
    except FileExistsError:  # a file or a link there: refused below
        pass
    except OSError as e:
        raise RendezvousError(f"{named}: cannot be created ({e.strerror or e}); {fix}") from None
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RendezvousError(f"{named}: not a directory owned by uid {os.geteuid()}; {fix}")
    if st.st_mode & 0o022:  # another user could plant an engine's file or remove a live one
        raise RendezvousError(f"{named}: mode {stat.S_IMODE(st.st_mode):04o} lets other users write to it; "
                              f"chmod it 0700 or {fix}")
    why = unsafe_ancestor(d)
    if why is not None:
        raise RendezvousError(f"{named}: {why}; {fix}")
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])  # fields from 3 on follow the ")" of comm
    except (OSError, ValueError, IndexError):
        return None


def _pid_ns() -> str:
    """This process's PID namespace ("pid:[4026531836]"), "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_fields(pid: int) -> dict[str, Any]:
    """What a rendezvous file records of its owner: pid, start time and PID namespace."""
    return {"pid": pid, "start_time": _start_time(pid) or 0, "pid_ns": _pid_ns()}


def master_listed(info: dict[str, Any]) -> bool:
    """Whether the listener on the master port a parsed file names is the one it records: that socket
    inode, this user's (module doc). Whoever took the port after the master never is."""
    lst = loopback_listener(info["master_port"])
    return lst is not None and lst.inode == info["master_inode"] and lst.uid == os.getuid()


def owner_alive(info: dict[str, Any]) -> bool:
    """Whether the owner a parsed file names still runs (module doc): the same process, not its pid reused;
    in another PID namespace, while its master's listener is the one the file records."""
    if info["pid_ns"] != _pid_ns():
        return master_listed(info)
    return process_alive(info["pid"], info["start_time"])


def process_alive(pid: int, start_time: int) -> bool:
    """Whether `pid` (of this PID namespace) runs and is the process that started at `start_time` (an
    unreadable start time counts as the same process), not its pid reused."""
    if not _alive(pid):
        return False
    started = _start_time(pid)
    return started is None or started == start_time


def _port_of(m: re.Match[str] | None) -> int | None:
    port = int(m.group(1)) if m else 0
    return port if 0 < port < 65536 else None


def parse_info(blob: bytes) -> dict[str, Any] | None:
    """A rendezvous file's content, or None unless it is exactly what `acquire` writes: a positive pid, its
    start time and PID namespace, the master on 127.0.0.1 at a valid port, the metadata server too unless
    it is ``P2PHANDSHAKE`` (a planted remote address is never joined) and the master's listener inode (a
    positive int)."""
    try:
        info = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    pid, master, metadata = info.get("pid"), info.get("master_address"), info.get("metadata_server")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    start, ns = info.get("start_time"), info.get("pid_ns")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or not isinstance(ns, str) \
            or len(ns) > 64:
        return None
    if not isinstance(master, str) or not isinstance(metadata, str):
        return None
    inode = info.get("master_inode")
    if isinstance(inode, bool) or not isinstance(inode, int) or inode <= 0:
        return None
    port = _port_of(_MASTER_RE.fullmatch(master))
    if port is None or (metadata != P2P_HANDSHAKE and _port_of(_METADATA_RE.fullmatch(metadata)) is None):
        return None
    return {"pid": pid, "start_time": start, "pid_ns": ns, "master_address": master, "metadata_server": metadata,
            "master_port": port, "master_inode": inode}


def _read(path: str) -> dict[str, Any] | None:
    """`parse_info` of the file at `path` when it is a regular file of this user that others cannot write,
    opened without following a symlink; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022
                or st.st_size > MAX_FILE_BYTES):
            return None
        blob = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_info(blob) if len(blob) <= MAX_FILE_BYTES else None


def _sweep(d: str) -> None:
    """Files left by dead owners (a crash skips the removal at shutdown)."""
    for name in os.listdir(d):
        if name.startswith("embedded-") and name.endswith(".json"):
            path = os.path.join(d, name)
            info = _read(path)
            if info is None or not owner_alive(info):
                for dead in (path, os.path.join(d, f"secret-{name[len('embedded-'):-len('.json')]}.key")):
                    try:
                        os.remove(dead)
                    except OSError:
                        pass


def _safe(engine_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)[:120]


def rendezvous_path(engine_id: str) -> str:
    return os.path.join(runtime_dir(engine_id), f"embedded-{_safe(engine_id)}.json")


def secret_path(engine_id: str) -> str:
    return os.path.join(runtime_dir(engine_id), f"secret-{_safe(engine_id)}.key")


def _open_lock(d: str) -> tuple[int, str]:
    lock_path = os.path.join(d, ".lock")
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), lock_path
    except OSError as e:  # a symlink planted there (ELOOP), a directory, ...
        raise RendezvousError(f"{lock_path!r}: cannot open the rendezvous lock ({e.strerror or e}); remove it "
                              f"or set {RUNTIME_DIR_ENV} to a private directory") from None


def read_engine_secret(path: str) -> bytes:
    """A generated secret: exactly SECRET_BYTES of this user's regular file, mode 0600 or stricter, opened
    without following a link (`read_own_file`), else `LedgerInputError("engine_secret", path)`."""
    blob = read_own_file("engine_secret", path, max_bytes=SECRET_BYTES, private=True)
    if len(blob) != SECRET_BYTES:
        raise LedgerInputError("engine_secret", path, f"holds {len(blob)} bytes, a generated secret "
                               f"{SECRET_BYTES}; remove it and the next start generates one")
    return blob


def private_dir(d: str) -> str:
    """`d` when no other user may enter it; a secret's directory must be 0700, not only unwritable by others
    (a directory others may list and enter leaves the secret to its own mode alone)."""
    mode = stat.S_IMODE(os.lstat(d).st_mode)
    if mode & 0o077:
        raise LedgerInputError(RUNTIME_DIR_ENV, d, f"has mode {mode:04o}: other users may enter it, and it holds "
                               f"the engine's integrity secret; chmod 700 or set {RUNTIME_DIR_ENV} to a private "
                               f"directory")
    return d


def engine_secret(engine_id: str, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> bytes:
    """This engine's integrity secret (module doc): generated by the first process of the engine that asks,
    read by the others, under the directory's lock (two that arrive together never make two)."""
    path = secret_path(engine_id)
    d = private_dir(os.path.dirname(path))
    lock, lock_path = _open_lock(d)
    try:
        _lock_within(lock, lock_path, lock_timeout_s)
        _sweep(d)  # a dead engine's secret of this id goes with its file, not into this engine
        if not os.path.lexists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if os.write(fd, os.urandom(SECRET_BYTES)) != SECRET_BYTES:
                    raise OSError(f"{path!r}: short write")
            except BaseException:
                os.close(fd)
                os.remove(path)
                raise
            os.close(fd)
        return read_engine_secret(path)  # the one we wrote too: checked like any other reading
    finally:
        os.close(lock)


def _lock_within(fd: int, path: str, timeout_s: float) -> None:
    """flock(fd) within `timeout_s`, else RendezvousError: a holder that never lets go (a frozen process
    sharing the directory) must fail start-up with a reason, not hang it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"{path!r}: another process has held the rendezvous lock for {timeout_s:g}s; "
                                      f"it may be frozen. Stop it or set {RUNTIME_DIR_ENV} to another "
                                      f"directory") from None
            time.sleep(_LOCK_POLL_S)


def acquire(engine_id: str, start: Callable[[], EmbeddedMooncake], *,
            lock_timeout_s: float = LOCK_TIMEOUT_S) -> EmbeddedMooncake | AttachedMooncake:
    """This engine's servers: attach to those another process of the engine started, or start them
    (`start()`) and publish their addresses and the master's listener inode. Held under the directory's
    lock, so two processes that arrive together never both start servers."""
    path = rendezvous_path(engine_id)
    lock, lock_path = _open_lock(os.path.dirname(path))
    try:
        _lock_within(lock, lock_path, lock_timeout_s)
        _sweep(os.path.dirname(path))
        info = _read(path)
        if info is not None and info["pid"] != os.getpid() and owner_alive(info) and master_listed(info):
            return AttachedMooncake(info["master_address"], info["metadata_server"], info["pid"],
                                    info["master_inode"], path, (info["pid"], info["start_time"], info["pid_ns"]))
        if os.path.lexists(path):
            os.remove(path)  # owner alive but its master gone or not the one recorded, or a file not to be
            # trusted: start afresh
        emb = start()
        _publish(path, emb)
        return emb
    finally:
        os.close(lock)  # releases the flock


def _publish(path: str, emb: EmbeddedMooncake) -> None:
    """Write this process's servers to `path` (under the directory's lock): O_EXCL temp file, renamed."""
    inode = getattr(emb, "master_inode", 0)
    if isinstance(inode, bool) or not isinstance(inode, int) or inode <= 0:
        raise RendezvousError(f"{path!r}: the master started at {emb.master_address} has no listener inode "
                              f"({inode!r}); it cannot be published")
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):  # left by a dead process of this pid
        os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**owner_fields(os.getpid()), "master_address": emb.master_address, "master_inode": inode,
                   "metadata_server": emb.metadata_server}, f)
    os.replace(tmp, path)


def republish(engine_id: str, emb: EmbeddedMooncake, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """The owner's master restarted (a new listener inode, perhaps a new port): rewrite the engine's file,
    under the lock, unless another live process of the engine has published its own servers meanwhile."""
    path = rendezvous_path(engine_id)
    lock, lock_path = _open_lock(os.path.dirname(path))
    try:
        _lock_within(lock, lock_path, lock_timeout_s)
        info = _read(path)
        if info is not None and info["pid"] != os.getpid() and owner_alive(info):
            logger.warning("embedded mooncake_master of engine %r restarted at %s, but pid %d now publishes the "
                           "engine's servers; not republished", engine_id, emb.master_address, info["pid"])
            return
        _publish(path, emb)
    finally:
        os.close(lock)


def release(engine_id: str) -> None:
    """The owner's shutdown: withdraw the file and the engine's secret (only if this process published it)."""
    path = rendezvous_path(engine_id)
    info = _read(path)
    if info is not None and info["pid"] == os.getpid():
        for mine in (path, secret_path(engine_id)):
            try:
                os.remove(mine)
            except OSError:
                pass


_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, list[Any]] = {}  # engine_id -> [EmbeddedMooncake | AttachedMooncake, refcount]


def acquire_shared(engine_id: str, rpc_timeout_ms: int, *, disk_offload: bool = False,
                   stats: Counter | None = None,
                   on_restart: Callable[[], None] | None = None) -> EmbeddedMooncake | AttachedMooncake:
    """This process's handle on the engine's embedded servers: one per engine for every connector of this
    process (reference counted), found across the engine's processes by `acquire`. Servers this process
    starts take the disk tier with `disk_offload`, count master_restarts into `stats` and call `on_restart`
    after republishing a restarted master (the first connector's: every process of an engine has the same
    configuration)."""
    with _SHARED_LOCK:
        ent = _SHARED.get(engine_id)
        if ent is None:
            # supervised: a master that dies is restarted (on its ports unless another process took them) and
            # republished; every process's client re-attaches to it where it stayed on its address. No
            # metadata server: the clients' peer-to-peer handshake leaves nothing to redirect (module doc)
            def restarted(emb: EmbeddedMooncake) -> None:
                republish(engine_id, emb)
                if on_restart is not None:
                    on_restart()

            handle = acquire(engine_id, lambda: EmbeddedMooncake(
                rpc_timeout_ms=rpc_timeout_ms, supervise=True, on_restart=restarted, disk_offload=disk_offload,
                stats=stats, http_metadata=False))
            ent = _SHARED[engine_id] = [handle, 0]
        ent[1] += 1
        return ent[0]


def release_shared(engine_id: str) -> None:
    """One connector's release; the last one of the process stops the servers it owns (or detaches)."""
    with _SHARED_LOCK:
        ent = _SHARED.get(engine_id)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] <= 0:
            del _SHARED[engine_id]
            if isinstance(ent[0], EmbeddedMooncake):
                ent[0].on_restart = None  # a restart from now on must not publish the file again
                release(engine_id)
            ent[0].stop()
