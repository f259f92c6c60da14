"""The store backend: a thin, safe wrapper over `mooncake.store.MooncakeDistributedStore`.

What it adds over the raw pybind11 client (and why):
  * one result code per key, always (`list[int]`, same length as `keys`), never an exception for a
    per-key problem: the connector turns every negative code into a reported load error or a failed save;
  * inputs checked before they reach C++: mismatched list lengths raise `ValueError` naming the argument;
    a null pointer, a non-positive size or an oversized key becomes a per-key code without calling Mooncake
    (a bad pointer would crash the process, not fail the call);
  * a dead master costs one slow call, not one per step: a circuit breaker. The first -900/-901 opens it;
    while it is open every call returns `StoreCode.UNHEALTHY_SKIPPED` at once (each RPC to a dead master
    takes ~4 s, and Mooncake's own `health_check()` lags a master crash by ~4-12 s). Only `probe()` closes it:
    one `batch_is_exist` of `PROBE_KEY` once `unhealthy_backoff_ms` has passed, the wait doubled for each
    failed probe up to `max_unhealthy_backoff_ms`, the breaker closed by the first probe the master answers.
    A thread of the store's own runs the probes (started at the first failure), so no caller, the
    scheduler's step least of all, ever pays a call to a master that is known down. The backoff reads the
    `clock` given at construction (time.monotonic; a replay passes its own and calls `probe()` itself, to be
    deterministic: no thread then);
  * a master it cannot authenticate is a master down: with an embedded handle (`embedded=`: the servers
    this process started, or another process of the engine did, kvledger_connector/store/rendezvous.py) the
    breaker opens when the listener on the master's port is not that master's (its socket inode; checked at
    most once per `AUTH_CHECK_INTERVAL_S` on the calling thread, counted in `master_unauthentic`), and a
    probe closes it only while it is. Whoever took the port after the master died gets this wrapper's calls
    for at most that interval (the client's own heartbeat to its master address is Mooncake's, not
    stopped here). A master restarted on its address is followed; one its owner moved to a fresh port (its
    old one taken) is not: this client stays on the old address, so the breaker stays open (lookups miss,
    saves and loads fail, nothing wrong is read) and one error says the engine must be restarted to use
    it (no client re-setup here);
  * an exception from the client becomes `StoreCode.CLIENT_EXCEPTION` per key (the message is kept in
    `last_exception`), so a store thread never dies of it;
  * the client is never closed under a live call, nor called once closed: either kills the process
    inside Mooncake (measured: SIGSEGV, even for `batch_is_exist` after `close()`). Every call is
    counted in and out under one lock; `close` refuses new calls, waits (bounded) for the calls inside
    to return, and when one does not, leaves the client open (leaked, logged, `store_close_leaked`) rather
    than close it under that call.

Mooncake's disk tier (``disk_offload``, docs/disk-tier.md): a client that owns a memory segment is set up with
offload on, writing to a private directory of its own that `connect` makes under ``disk_offload_dir``
(`make_offload_dir`) and `close` removes; the variables Mooncake reads for it are set just before `setup()`.

Zero-copy only: puts use `batch_put_from_multi_buffers`, gets `batch_get_into_multi_buffers`; a key's
object is the concatenation of its chunks (e.g. one chunk per layer's K and V), and a get must ask for
exactly the object's total size (larger: -800, smaller: -600).

Network note: the servers we start (kvledger_connector/store/embedded.py) bind 127.0.0.1 only; this client's
transfer-engine ports bind all interfaces by Mooncake's design (INADDR_ANY is hard-coded there), so
`MC_TCP_BIND_ADDRESS` only sets the address we advertise; `kvledger_connector/store/transfer_ports.py` lists
them and prints the firewall recipe.
"""
from __future__ import annotations

import enum
import fcntl
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from kvledger import codes as ledger_codes
from kvledger.counts import Counter, Counts
from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.ownfile import unsafe_ancestor
from kvledger_connector.store.embedded import OFFLOAD_PATH_ENV

if TYPE_CHECKING:
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.store.rendezvous import AttachedMooncake


logger = logging.getLogger(__name__)

#: bound on MooncakeStore.close (a close against a dead master measured ~7 s)
CLOSE_TIMEOUT_S = 30.0
#: share of close's bound spent waiting for calls still inside the client (each is bounded by
#: MC_RPC_TIMEOUT_MS per RPC, so a few RPC timeouts' worth)
CLOSE_DRAIN_SHARE = 0.5
#: how often a call checks that an embedded master is still the authenticated one (a /proc read)
AUTH_CHECK_INTERVAL_S = 1.0


class StoreCode(enum.IntEnum):
    """Result codes. Mooncake's own (mooncake-store/include/types.h, seen through Python) plus local
    ones below -9000 for outcomes decided in this wrapper. Results stay plain ints; use `StoreCode.label`."""

    OK = 0
    INTERNAL_ERROR = -1  # setup() failed (e.g. no valid LAN address)
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = ledger_codes.NO_AVAILABLE_HANDLE  # no space (defined once, in kvledger.codes)
    INVALID_PARAMS = -600  # destination too small, bad size, empty key, client not initialised
    OBJECT_NOT_FOUND = -704  # missing / evicted / lost in a master restart
    OBJECT_ALREADY_EXISTS = -705  # swallowed by put (first writer wins -> 0)
    OBJECT_HAS_LEASE = -706  # remove within the lease without force
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800  # destination larger than the object; segment owner dead
    RPC_FAIL = -900  # master unreachable
    RPC_TIMEOUT = -901  # master hung past MC_RPC_TIMEOUT_MS
    UNABLE_OFFLOAD = -1300  # setup() with the disk tier against a master started without --enable_offload
    # local codes (never produced by Mooncake)
    KEY_TOO_LONG = -9001  # key longer than max_key_bytes: not sent
    UNHEALTHY_SKIPPED = -9002  # skipped: master failed recently (backoff)
    CLIENT_EXCEPTION = -9003  # the client raised; see MooncakeStore.last_exception
    BAD_BUFFER = -9004  # null pointer or size <= 0 for this key: not sent
    # read whole, but its trailer's tag does not match (kvledger_connector/shape/integrity.py)
    INTEGRITY_MISMATCH = -9005

    @staticmethod
    def label(code: int) -> str:
        """Name of a code, e.g. "OBJECT_NOT_FOUND(-704)"; positive results are byte counts."""
        if code > 0:
            return f"BYTES({code})"
        try:
            return f"{StoreCode(code).name}({code})"
        except ValueError:
            return f"UNKNOWN({code})"


MASTER_DOWN_CODES = frozenset({StoreCode.RPC_FAIL, StoreCode.RPC_TIMEOUT})
#: the key the breaker's probe asks for (never stored: any answer, 0 or 1, shows the master answers)
PROBE_KEY = "kvledger-breaker-probe"


class StoreError(RuntimeError):
    """A store operation that has no per-key result failed (setup, buffer registration)."""


class StoreUnavailableError(StoreError):
    """The client could not join the store; names the master address, the metadata server and the code."""

    def __init__(self, master: str, metadata: str, code: int, hint: str = "") -> None:
        self.master, self.metadata, self.code = master, metadata, code
        super().__init__(f"Mooncake setup() against master_server_address={master!r} metadata_server="
                         f"{metadata!r} returned {StoreCode.label(code)}{'; ' + hint if hint else ''}")


@runtime_checkable
class KVStore(Protocol):
    """What the connector needs from a store. `MooncakeStore` is the real one; `testbed.faults.FaultyStore`
    wraps any KVStore to inject faults. Every batch method returns one int per key."""

    def register_buffer(self, ptr: int, size: int) -> None: ...

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 exists, 0 missing, < 0 error."""
        ...

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """0 stored (or already present: first writer wins), < 0 error."""
        ...

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """bytes read (== the object's size) on success, < 0 error."""
        ...

    def remove(self, key: str, force: bool = False) -> int: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


def _check_lists(keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> None:
    if len(ptrs) != len(keys) or len(sizes) != len(keys):
        raise ValueError(f"batch lengths differ: keys={len(keys)} ptrs={len(ptrs)} sizes={len(sizes)}")
    for i, (p, s) in enumerate(zip(ptrs, sizes)):
        if len(p) != len(s):
            raise ValueError(f"key {keys[i]!r}: {len(p)} buffer pointers but {len(s)} sizes")


def _probe(field: str, address: str, other: str, timeout_s: float = 2.0) -> None:
    """Raise StoreUnavailableError unless `address` ("host:port" or a URL) accepts a TCP connection."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if host is None or port is None:
        raise StoreUnavailableError(address if field == "master_server_address" else other,
                                    address if field == "metadata_server" else other, -1,
                                    f"{field}={address!r} has no host:port")
    try:
        socket.create_connection((host, port), timeout_s).close()
    except OSError as e:
        master, metadata = (address, other) if field == "master_server_address" else (other, address)
        raise StoreUnavailableError(master, metadata, int(StoreCode.RPC_FAIL),
                                    f"{field} {host}:{port} does not accept connections ({e})") from None


def _all_positive(ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> bool:
    """Fast path of the buffer check: every pointer and size of every key > 0 (C-speed min over the lists)."""
    try:
        return not ptrs or (min(map(min, ptrs)) > 0 and min(map(min, sizes)) > 0)
    except (ValueError, TypeError):  # an empty chunk list or a non-number: check key by key
        return False


def _unique_rounds(keys: Sequence[str], send: list[int]) -> list[list[int]]:
    """Split `send` so no call repeats a key: Mooncake fails every occurrence of a key that appears twice in
    one batch when any occurrence fails (measured: a good get next to a bad one of the same key gave -800)."""
    if len({keys[i] for i in send}) == len(send):
        return [send] if send else []
    rounds: list[list[int]] = []
    seen: list[set[str]] = []
    for i in send:
        for r, names in zip(rounds, seen):
            if keys[i] not in names:
                r.append(i)
                names.add(keys[i])
                break
        else:
            rounds.append([i])
            seen.append({keys[i]})
    return rounds


#: the disk tier's backend: Mooncake's bucket backend with one object per bucket (written at the next
#: heartbeat; its default of 500 keys per bucket leaves a short run's objects in memory) and a bound on its
#: files with least-recently-used eviction. The file-per-key backend ignores the size bound in 0.3.13
#: (docs/disk-tier.md).
OFFLOAD_BACKEND = "bucket_storage_backend"
#: serialises the process-wide variables Mooncake reads at setup() with the setup that reads them
_SETUP_ENV_LOCK = threading.Lock()


def offload_environment(config: StoreConfig, directory: str) -> dict[str, str]:
    """The variables Mooncake's client reads at setup() for its disk tier, for a client writing to `directory`."""
    return {
        OFFLOAD_PATH_ENV: directory,
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": OFFLOAD_BACKEND,
        "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "1",
        "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(config.disk_offload_size),
        "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru",
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(config.disk_offload_size),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(config.disk_offload_heartbeat_s),
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(config.disk_offload_staging_size),
    }


def offloads(config: StoreConfig) -> bool:
    """Whether a client with `config` writes the disk tier itself (it owns a memory segment)."""
    return config.disk_offload and config.global_segment_size > 0


def load_batch_keys(config: StoreConfig, key_bytes: int, readers: int) -> int:
    """Keys per `batch_get` for objects of `key_bytes`: `load_sub_batch_keys`, and with the disk tier no more
    than one owner's staging buffer (`disk_offload_staging_size`) holds for `readers` ranks reading its files at
    once: past it every disk-resident key of the batch fails (-10; docs/disk-tier.md). `ConfigError` when not
    even one key per reader fits."""
    if key_bytes < 1 or readers < 1:
        raise ConfigError("key_bytes" if key_bytes < 1 else "readers", min(key_bytes, readers), "must be >= 1")
    if not config.disk_offload:
        return config.load_sub_batch_keys
    fits = config.disk_offload_staging_size // (key_bytes * readers)
    if fits < 1:
        raise ConfigError("disk_offload_staging_size", config.disk_offload_staging_size,
                          f"holds no key of {key_bytes} bytes for each of {readers} ranks reading the tier at "
                          f"once: raise it to at least {key_bytes * readers}")
    return min(config.load_sub_batch_keys, fits)


def _refuse_dir(path: str, reason: str) -> ConfigError:
    return ConfigError("disk_offload_dir", path, reason)


def _check_dir(path: str, st: os.stat_result, *, private: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse_dir(path, "is not a directory (or is a link)")
    if st.st_uid != os.geteuid():
        raise _refuse_dir(path, f"is owned by uid {st.st_uid}, not this user ({os.geteuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        raise _refuse_dir(path, f"has mode {mode:04o}: other users may enter it")
    if mode & 0o022:
        raise _refuse_dir(path, f"has mode {mode:04o}: other users may write to it, and could replace the "
                          f"tier's files; chmod go-w or name another directory")


#: the tier's directories of our clients under `disk_offload_dir`; each holds OWNER_LOCK, locked (flock) by
#: the process of the client that writes it for as long as that process lives
TIER_DIR_PREFIX = "kvledger-tier-"
OWNER_LOCK = "owner.lock"
#: a directory of ours with no OWNER_LOCK yet is being made (`make_offload_dir`) for this long at most
UNLOCKED_GRACE_S = 60.0
_owner_locks: dict[str, int] = {}  # this process's tier directories -> the fd holding OWNER_LOCK's lock
_owner_locks_guard = threading.Lock()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _lock_owned(path: str, dir_fd: int) -> int:
    """Create OWNER_LOCK in `path` (open as `dir_fd`) and lock it for this process (released when the process
    exits)."""
    fd = os.open(OWNER_LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with _owner_locks_guard:
        _owner_locks[path] = fd
    return fd


def _rmtree(path: str) -> str | None:
    """Remove `path` (never following a link inside it); why it is still there, or None when it is gone."""
    errors: list[str] = []
    shutil.rmtree(path, onerror=lambda _fn, p, exc: errors.append(f"{p}: {exc[1]}"))
    if not os.path.lexists(path):
        return None
    return errors[0] if errors else "still there after removal"


def remove_offload_dir(path: str) -> None:
    """Remove a tier directory `make_offload_dir` made in this process, and release its owner lock."""
    why = _rmtree(path)
    if why is not None:
        logger.warning("kvledger: disk tier directory %s not removed: %s", path, why)
    with _owner_locks_guard:
        fd = _owner_locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def _owner_gone(parent_fd: int, name: str, now: float) -> bool:
    """Whether the tier directory `name` under `parent_fd` is ours and its client's process is gone: opened
    without following a link, this user's, its OWNER_LOCK a regular file (a FIFO or a device there would block
    the open) that no process holds, or absent for UNLOCKED_GRACE_S."""
    try:
        dfd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return False  # a link, a file, gone
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            return False
        try:
            fd = os.open(OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return now - st.st_mtime >= UNLOCKED_GRACE_S
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                logger.warning("kvledger: disk tier directory %s left alone: its %s is not a regular file",
                               name, OWNER_LOCK)
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False  # its client's process lives
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def sweep_offload_dirs(parent: str, *, now: float | None = None) -> list[str]:
    """Remove the tier directories under `parent` whose client's process is gone (killed before its close
    removed them: nothing reads them again, since every client makes a new one) and return those removed; one
    that could not be removed is logged with why, not returned. Only our own: named TIER_DIR_PREFIX, this
    user's, not links; a directory whose OWNER_LOCK some process holds is live; one with no OWNER_LOCK is left
    for UNLOCKED_GRACE_S (a client may be between making it and locking)."""
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        pfd = os.open(parent, _DIR_FLAGS)
    except OSError:
        return gone
    try:
        names = sorted(os.listdir(pfd))
        for name in names:
            path = os.path.join(parent, name)
            with _owner_locks_guard:
                if not name.startswith(TIER_DIR_PREFIX) or path in _owner_locks:
                    continue
            if not _owner_gone(pfd, name, now):
                continue
            why = _rmtree(path)
            if why is None:
                gone.append(path)
            else:
                logger.warning("kvledger: disk tier directory %s of a client gone without closing not removed: "
                               "%s", path, why)
    finally:
        os.close(pfd)
    return gone


def make_offload_dir(config: StoreConfig) -> str:
    """A fresh private directory (0700) for one client's disk tier, under `config.disk_offload_dir` (created
    0700 when absent). The named directory must be this user's, not a link, writable by no one else, under
    directories no other user may swap (`unsafe_ancestor`), else `ConfigError` naming it: Mooncake allows one
    live client per directory and reads back whatever files are there, so no other user may put files in
    either. Both are opened without following links. The directory's OWNER_LOCK is locked for this process
    until `remove_offload_dir`; first, directories whose clients' processes are gone are swept
    (`sweep_offload_dirs`)."""
    parent = config.disk_offload_dir
    if parent is None:
        raise ConfigError("disk_offload_dir", None, "required with disk_offload and a memory segment")
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    except OSError as e:
        if not os.path.lexists(parent):
            raise _refuse_dir(parent, f"cannot be created: {e.strerror or e}") from None
    try:
        pfd = os.open(parent, _DIR_FLAGS)
    except OSError as e:
        raise _refuse_dir(parent, f"is not a directory (or is a link): {e.strerror or e}") from None
    try:
        _check_dir(parent, os.fstat(pfd), private=False)
        why = unsafe_ancestor(parent)
        if why is not None:
            raise _refuse_dir(parent, why)
        swept = sweep_offload_dirs(parent)
        if swept:
            logger.info("kvledger: removed %d disk tier directories of clients gone without closing under %s",
                        len(swept), parent)
        try:
            mine = tempfile.mkdtemp(prefix=TIER_DIR_PREFIX, dir=parent)
        except OSError as e:
            raise _refuse_dir(parent, f"cannot hold a directory of ours: {e.strerror or e}") from None
        try:
            mfd = os.open(os.path.basename(mine), _DIR_FLAGS, dir_fd=pfd)
        except OSError as e:
            remove_offload_dir(mine)
            raise _refuse_dir(parent, f"cannot open a directory of ours: {e.strerror or e}") from None
    finally:
        os.close(pfd)
    try:
        _check_dir(mine, os.fstat(mfd), private=True)
        _lock_owned(mine, mfd)
    except (ConfigError, OSError) as e:
        remove_offload_dir(mine)
        if isinstance(e, ConfigError):
            raise
        raise _refuse_dir(parent, f"cannot lock a directory of ours: {e.strerror or e}") from None
    finally:
        os.close(mfd)
    return mine


def open_client(config: StoreConfig, *, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                offload_dir: str | None = None) -> tuple[Any, StoreConfig]:
    """A set-up `MooncakeDistributedStore` at `config`'s master (or `embedded`'s), and the config with the
    addresses it used; `MooncakeStore.connect` wraps it. Raises `StoreUnavailableError` when setup() fails.
    A client that writes the disk tier (`offloads`) writes to `offload_dir` (`make_offload_dir`; its caller
    removes it)."""
    if embedded is not None:
        config = config.with_addresses(embedded.master_address, embedded.metadata_server)
    if config.master_server_address is None or config.metadata_server is None:
        raise StoreUnavailableError(str(config.master_server_address), str(config.metadata_server), -1,
                                    "embedded mode: start an EmbeddedMooncake and pass embedded=")
    if embedded is not None and not embedded.authentic():
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, int(StoreCode.RPC_FAIL),
                                    "the listener on the embedded master's port is not that master's (gone, or "
                                    "another process's)")
    # setup() against a dead master retries for ~90 s (measured); a TCP probe answers in milliseconds.
    _probe("master_server_address", config.master_server_address, config.metadata_server)
    if config.metadata_server.startswith(("http://", "https://")):
        _probe("metadata_server", config.metadata_server, config.master_server_address)
    # Read by the transfer engine / RPC client at setup(); process-wide by Mooncake's design. A transfer
    # that makes no progress (a frozen peer) fails with -800 after transfer_timeout_s instead of hanging.
    os.environ["MC_TCP_BIND_ADDRESS"] = config.local_hostname
    os.environ["MC_RPC_TIMEOUT_MS"] = str(config.rpc_timeout_ms)
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(config.transfer_timeout_s)
    os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(config.transfer_timeout_s)
    from mooncake.store import MooncakeDistributedStore  # heavy import, only at the edge

    tier = offloads(config)
    if tier and offload_dir is None:
        raise ConfigError("disk_offload_dir", config.disk_offload_dir, "open_client: pass offload_dir= "
                          "(make_offload_dir) for a client that writes the disk tier")
    raw = MooncakeDistributedStore()
    try:
        with _SETUP_ENV_LOCK:
            if tier and offload_dir is not None:
                os.environ.update(offload_environment(config, offload_dir))
            rc = raw.setup(config.local_hostname, config.metadata_server, config.global_segment_size,
                           config.local_buffer_size, config.protocol, config.rdma_devices,
                           config.master_server_address, None, tier, offload_dir or "")
    except Exception as e:  # pybind11 raises on bad argument types
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, -1,
                                    f"setup raised {type(e).__name__}: {e}") from e
    if rc != 0:
        try:
            raw.close()
        except Exception:
            pass
        # destroyed here, not whenever the traceback is: its destructor unmounts through the master again,
        # ~10 s against one gone meanwhile
        raw = None
        hint = ("disk_offload needs a master started with --enable_offload=true"
                if rc == StoreCode.UNABLE_OFFLOAD else "is the master running and reachable?")
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, rc, hint)
    return raw, config


class MooncakeStore:
    """One Mooncake client. Thread-safe for concurrent batch calls (the client is; our state is a float).

    ``raw``: a set-up `MooncakeDistributedStore` (`open_client`), or a test double over one
    (testbed.faults.FaultyMooncakeClient). ``clock``: seconds, monotonic; only the master-down backoff reads
    it (close's bounds are real waits on time.monotonic). ``background_probe``: run the breaker's probes on a
    thread of the store's own (default: when ``clock`` is time.monotonic); without it the owner of the clock
    calls `probe()`."""

    def __init__(self, raw: Any, config: StoreConfig, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                 *, clock: Callable[[], float] = time.monotonic, background_probe: bool | None = None) -> None:
        self._raw = raw
        self.config = config
        self.embedded = embedded  # kept alive as long as the client; stopped by its owner
        self.max_key_bytes = config.max_key_bytes
        self._clock = clock
        # the breaker (guarded by _lock; `_open` is read without it on the call path: a bool, set last)
        self._open = False
        self._skip_until = -math.inf  # clock time of the next probe while open
        self._down_in_a_row = 0  # master failures in a row: the one that opened the breaker, then failed probes
        self._probing = False
        self._background_probe = clock is time.monotonic if background_probe is None else background_probe
        self._prober: threading.Thread | None = None
        self._auth_due = -math.inf  # time.monotonic() of the next authenticity check (AUTH_CHECK_INTERVAL_S)
        self._moved_logged = False
        # the counter sink: breaker_trips (the breaker opened), breaker_probes (probes made: a master this
        # process cannot authenticate is not sent one), master_unauthentic (trips because the master's
        # listener was not the authenticated one), store_close_leaked; the connector sets its StatsRecorder
        self.stats: Counter = Counts()
        self._closed = False
        self._lock = threading.Lock()  # close() vs calls
        self._idle = threading.Condition(self._lock)  # notified when the last call inside the client returns
        self._wake = threading.Condition(self._lock)  # the prober: the breaker opened, or the store closed
        self._calls_inside = 0  # calls now inside the raw client (guarded by _lock)
        self._close_result: bool | None = None  # what the first close returned (later closes repeat it)
        self.last_exception: BaseException | None = None
        self.registered: dict[int, int] = {}  # ptr -> size
        # this client's own directory of the disk tier (`connect` made it), removed once the client is closed
        self.offload_dir: str | None = None

    # -- connection --------------------------------------------------------------------------------

    @classmethod
    def connect(cls, config: StoreConfig, *, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                clock: Callable[[], float] = time.monotonic) -> MooncakeStore:
        """Join the store at `config`'s master, or at `embedded`'s when given (then `config` may be in
        embedded mode). Raises `StoreUnavailableError` when setup() fails (bad address, master down)."""
        tier_dir = make_offload_dir(config) if offloads(config) else None
        try:
            raw, config = open_client(config, embedded=embedded, offload_dir=tier_dir)
        except BaseException:
            if tier_dir is not None:
                remove_offload_dir(tier_dir)
            raise
        store = cls(raw, config, embedded, clock=clock)
        store.offload_dir = tier_dir
        return store

    @property
    def raw(self) -> Any:
        """The underlying MooncakeDistributedStore (benchmarks compare against it; do not use in the connector)."""
        return self._raw

    # -- calls into the raw client ------------------------------------------------------------------

    def _enter(self) -> bool:
        """Count a call in; False once closing has begun (the caller must not touch the raw client)."""
        with self._lock:
            if self._closed:
                return False
            self._calls_inside += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._calls_inside -= 1
            if self._calls_inside == 0:
                self._idle.notify_all()

    @property
    def calls_inside(self) -> int:
        """Calls now inside the raw client (tests and shutdown diagnostics)."""
        with self._lock:
            return self._calls_inside

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register a KV-cache region for zero-copy transfers (required for RDMA; harmless over TCP)."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise StoreError(f"register_buffer: ptr={ptr!r} must be a positive address")
        if not isinstance(size, int) or size <= 0:
            raise StoreError(f"register_buffer: size={size!r} must be > 0")
        if not self._enter():
            raise StoreError(f"register_buffer(ptr={ptr:#x}, size={size}): the store is closed")
        try:
            rc = self._raw.register_buffer(ptr, size)
        finally:
            self._leave()
        if rc != 0:
            raise StoreError(f"register_buffer(ptr={ptr:#x}, size={size}) returned {StoreCode.label(rc)}")
        self.registered[ptr] = size

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Unregister buffers and leave the store. Idempotent and safe from several threads (later calls
        return the first one's result; one racing the first may return True before it finishes). Does not
        stop an embedded master.

        New calls are refused at once (per-key INVALID_PARAMS). Calls already inside the client are waited
        for, up to `CLOSE_DRAIN_SHARE` of `timeout_s`: closing under a live call, or calling a closed
        client, crashes the process inside Mooncake. If one is still inside then, the client is left open
        (leaked: logged, counted in `store_close_leaked`) and False is returned.

        Bounded: Mooncake's close unmounts the segment through the master (measured ~7 s with a dead
        master, ~3 s with a hung one) and could block longer on a wedged transfer; it runs in a helper
        thread joined for the rest of `timeout_s`. Returns False (and logs an error naming the master) when
        it did not finish in time; the helper is a daemon and the client is abandoned."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return self._close_result if self._close_result is not None else True
            self._closed = True
            self._wake.notify_all()  # the prober ends
            drained = self._idle.wait_for(lambda: self._calls_inside == 0, timeout_s * CLOSE_DRAIN_SHARE)
            inside = self._calls_inside
            if not drained:
                self.stats.add("store_close_leaked")
                self._close_result = False
        if not drained:
            logger.error("Mooncake client of master %s not closed: %d call(s) still inside it after %.1fs; "
                         "the client is leaked (closing it under a live call would crash the process)",
                         self.config.master_server_address, inside, timeout_s * CLOSE_DRAIN_SHARE)
            return False
        done = threading.Event()

        def _close() -> None:
            for ptr in list(self.registered):
                try:
                    self._raw.unregister_buffer(ptr)
                except Exception:
                    pass
            self.registered.clear()
            try:
                self._raw.close()
            except Exception as e:
                self.last_exception = e
            if self.offload_dir is not None:
                # Mooncake's close leaves a client with the disk tier running (its heartbeat writes on, its
                # segment stays mounted): only its destructor unmounts it, run here by the last reference's
                # drop, while the master still answers (every call after close is refused by `_enter`)
                self._raw = None
            done.set()

        t = threading.Thread(target=_close, name="kvledger-store-close", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if not done.is_set():
            logger.error("Mooncake client close against master %s did not finish in %.1fs; abandoned",
                         self.config.master_server_address, timeout_s)
            self._close_result = False
            return False
        self._close_result = True
        if self.offload_dir is not None:  # the client that wrote it is gone: its files are read by no one
            remove_offload_dir(self.offload_dir)
        return True

    # -- health ------------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Cheap: False while the breaker is open, or when Mooncake's heartbeat says so."""
        self._check_authentic()
        if self._open or not self._enter():
            return False
        try:
            return int(self._raw.health_check()) == 0
        except Exception as e:
            self.last_exception = e
            return False
        finally:
            self._leave()

    def backoff_s(self, down_in_a_row: int) -> float:
        """The wait before the next probe after the `down_in_a_row`-th master failure in a row:
        `unhealthy_backoff_ms` doubled per failure after the first, at most `max_unhealthy_backoff_ms` (never
        below the first)."""
        base, cap = self.config.unhealthy_backoff_ms, self.config.max_unhealthy_backoff_ms
        return min(base << min(max(down_in_a_row, 1) - 1, 32), max(base, cap)) / 1000.0

    @property
    def breaker_open(self) -> bool:
        """True while calls are skipped (a master failure opened the breaker; no probe has closed it yet)."""
        return self._open

    @property
    def skip_remaining_s(self) -> float:
        """Seconds until the next probe is due (0 when the breaker is closed, or a probe is due now)."""
        return max(0.0, self._skip_until - self._clock()) if self._open else 0.0

    def trip(self) -> None:
        """Open the breaker as a master failure does (a caller's own deadline passed on a call still inside
        the client: `kvledger_connector.store.deadline`). A breaker already open stays as it is."""
        with self._lock:
            self._trip_locked()

    def authentic(self) -> bool:
        """Whether the master this client talks to is the embedded one it joined (module doc); True without
        an embedded handle (a configured master is the operator's to secure). A master moved to another
        address is not: this client cannot follow it, and says so once."""
        emb = self.embedded
        if emb is None:
            return True
        ok = bool(emb.authentic())
        now = getattr(emb, "moved_to", None) or emb.master_address
        if now != self.config.master_server_address:
            if not self._moved_logged:
                self._moved_logged = True
                logger.error("the embedded Mooncake master moved from %s to %s (another process took its port): "
                             "this process's store client stays on the old address, so its store calls are "
                             "skipped; restart the engine to use the moved master",
                             self.config.master_server_address, now)
            return False
        return ok

    def _check_authentic(self) -> None:
        """At most once per AUTH_CHECK_INTERVAL_S, on the calling thread: an embedded master that is not the
        authenticated one opens the breaker, as a master failure does."""
        if self.embedded is None or self._open or self._closed:
            return
        now = time.monotonic()
        if now < self._auth_due:
            return
        self._auth_due = now + AUTH_CHECK_INTERVAL_S  # set first: concurrent callers skip this round
        if self.authentic():
            return
        with self._lock:
            if self._open:
                return
            self.stats.add("master_unauthentic")
            logger.warning("Mooncake master %s: the listener on its port is not the master this process joined "
                           "(gone, or another process's)", self.config.master_server_address)
            self._trip_locked()

    def _trip_locked(self) -> None:
        if self._open:  # calls that were inside when the master died: one failure, not one per call
            return
        self._down_in_a_row = 1
        self._skip_until = self._clock() + self.backoff_s(1)
        self._open = True
        logger.warning("Mooncake master %s failed: store calls skipped until a probe is answered (first in %.1fs)",
                       self.config.master_server_address, self.backoff_s(1))
        self.stats.add("breaker_trips")
        if self._background_probe and not self._closed:
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe_loop, name="kvledger-store-probe", daemon=True)
                self._prober.start()
            self._wake.notify_all()

    def probe(self, *, force: bool = False) -> bool:
        """One probe of an open breaker whose wait is over (or at once with ``force``): True when the breaker
        is closed after it. The master answered (0 or 1 for `PROBE_KEY`) and is the authenticated one
        (`authentic`, before and after the call): closed. Otherwise the next wait doubles (`backoff_s`). At
        most one probe runs at a time; a closed breaker is not probed."""
        with self._lock:
            if not self._open:
                return True
            if self._closed or self._probing or (not force and self._clock() < self._skip_until):
                return False
            self._probing = True
        res = int(StoreCode.CLIENT_EXCEPTION)
        try:
            # never a call to a master this process cannot authenticate, nor a close on its answer
            if self.authentic():
                res = self._invoke(self._raw.batch_is_exist, 1, [PROBE_KEY])[0]
                if res in (0, 1) and not self.authentic():
                    res = int(StoreCode.RPC_FAIL)
            else:
                res = int(StoreCode.RPC_FAIL)
        finally:
            with self._lock:
                self._probing = False
                self.stats.add("breaker_probes")
                if res in (0, 1):
                    self._open = False
                    self._down_in_a_row = 0
                    logger.warning("Mooncake master %s answered a probe: store calls resume",
                                   self.config.master_server_address)
                else:
                    self._down_in_a_row += 1
                    self._skip_until = self._clock() + self.backoff_s(self._down_in_a_row)
        return res in (0, 1)

    def _probe_loop(self) -> None:
        """The prober: sleeps while the breaker is closed, probes it each time its wait is over."""
        with self._lock:
            while not self._closed:
                if not self._open:
                    self._wake.wait()
                    continue
                wait = self._skip_until - self._clock()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                self._lock.release()
                try:
                    self.probe()
                except Exception as e:  # never seen (probe returns codes); the prober must not die of it
                    self.last_exception = e
                finally:
                    self._lock.acquire()

    def _note(self, results: list[int]) -> list[int]:
        if results and min(results) < 0 and any(r in MASTER_DOWN_CODES for r in results):
            with self._lock:
                self._trip_locked()
        return results

    def _skip(self, n: int) -> list[int] | None:
        self._check_authentic()
        if self._closed:
            return [int(StoreCode.INVALID_PARAMS)] * n
        if self._open:
            return [int(StoreCode.UNHEALTHY_SKIPPED)] * n
        return None

    # -- batch calls -------------------------------------------------------------------------------

    def _key_code(self, key: object) -> int:
        """0 if `key` may be sent, else the local code for it."""
        if not isinstance(key, str) or not key:
            return int(StoreCode.INVALID_PARAMS)
        # ASCII keys (ours always are) are as long in bytes as in chars: skip the encode
        n = len(key) if key.isascii() else len(key.encode())
        return 0 if n <= self.max_key_bytes else int(StoreCode.KEY_TOO_LONG)

    @staticmethod
    def _buffer_ok(ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
        # a null or negative pointer would crash the process inside Mooncake; refuse it here
        # (a non-int that compares, e.g. a float, is rejected by pybind11 for the whole call -> CLIENT_EXCEPTION)
        try:
            return bool(ptrs) and min(ptrs) > 0 and min(sizes) > 0
        except TypeError:
            return False

    def _presend(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]] | None,
                 sizes: Sequence[Sequence[int]] | None) -> tuple[list[int], list[int]]:
        """(indices to send, per-key codes; 0 for the ones sent)."""
        codes = [self._key_code(k) for k in keys]
        if ptrs is not None and sizes is not None and not _all_positive(ptrs, sizes):
            for i, c in enumerate(codes):
                if c == 0 and not self._buffer_ok(ptrs[i], sizes[i]):
                    codes[i] = int(StoreCode.BAD_BUFFER)
        return [i for i, c in enumerate(codes) if c == 0], codes

    def _run(self, fn_name: str, keys: Sequence[str], *args: Sequence[Sequence[int]]) -> list[int]:
        """Check, skip or call: one code per key, never an exception for a per-key problem."""
        n = len(keys)
        skipped = self._skip(n)
        if skipped is not None:
            return skipped
        send, codes = self._presend(keys, *(args or (None, None)))  # type: ignore[arg-type]
        fn = getattr(self._raw, fn_name)
        if len(send) == n and len(set(keys)) == n:  # the common case: one call, no copying
            return self._note(self._invoke(fn, n, list(keys), *[list(a) for a in args]))
        for batch in _unique_rounds(keys, send):
            res = self._invoke(fn, len(batch), [keys[i] for i in batch], *[[a[i] for i in batch] for a in args])
            for i, r in zip(batch, res):
                codes[i] = r
        return self._note(codes)

    def _invoke(self, fn: Any, n: int, *args: list[Any]) -> list[int]:
        if not self._enter():  # closed since _skip: never call a closed client
            return [int(StoreCode.INVALID_PARAMS)] * n
        try:
            res = [int(r) for r in fn(*args)]
        except Exception as e:  # pybind11 type errors, anything else the client throws
            self.last_exception = e
            return [int(StoreCode.CLIENT_EXCEPTION)] * n
        finally:
            self._leave()
        if len(res) != n:  # never seen; do not trust a short answer
            return [int(StoreCode.CLIENT_EXCEPTION)] * n
        return res

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 exists, 0 missing, < 0 error (per key)."""
        return self._run("batch_is_exist", keys)

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """Zero-copy put of each key's chunks; 0 stored or already present (first writer wins), < 0 error."""
        _check_lists(keys, ptrs, sizes)
        return self._run("batch_put_from_multi_buffers", keys, ptrs, sizes)

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """Zero-copy get into each key's chunks; bytes read (== object size) or < 0 error."""
        _check_lists(keys, ptrs, sizes)
        return self._run("batch_get_into_multi_buffers", keys, ptrs, sizes)

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 leased (use force). Used by fault injection and tests."""
        skipped = self._skip(1)
        if skipped is not None:
            return skipped[0]
        code = self._key_code(key)
        if code:
            return code
        return self._single_call(self._raw.remove, key, force)

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        """Keys removed (>= 0) or < 0 error (-600 for a regex the master cannot parse). The master *searches*
        each key (ECMAScript syntax): anchor the pattern. Used by `reset_cache`
        (kvledger_connector/scheduler/reset.py)."""
        skipped = self._skip(1)
        if skipped is not None:
            return skipped[0]
        if not isinstance(regex, str) or not regex:
            return int(StoreCode.INVALID_PARAMS)
        return self._single_call(self._raw.remove_by_regex, regex, force)

    def _single_call(self, fn: Any, *args: Any) -> int:
        """One counted client call returning one code (refused once closing; an exception is CLIENT_EXCEPTION)."""
        if not self._enter():
            return int(StoreCode.INVALID_PARAMS)
        try:
            return self._note([int(fn(*args))])[0]
        except Exception as e:
            self.last_exception = e
            return int(StoreCode.CLIENT_EXCEPTION)
        finally:
            self._leave()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
