"""The disk tier's directories (``disk_offload``, docs/disk-tier.md): a client that owns a memory segment is set
up with Mooncake's offload on, writing to a private directory of its own that `make_offload_dir` makes under
``disk_offload_dir`` and `remove_offload_dir` removes once the client is closed; `sweep_offload_dirs` removes
those of clients whose process died before their close. `offload_environment` is what Mooncake reads for the
tier at setup(): an external owner's environment (`EmbeddedMooncake.start_holder`); our own client
(kvledger_connector/store/client.py) passes the directory as setup()'s argument and sets the rest.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
import threading
import time

from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.ownfile import unsafe_ancestor
from kvledger_connector.store.embedded import OFFLOAD_PATH_ENV

logger = logging.getLogger(__name__)

#: the disk tier's backend: Mooncake's bucket backend with one object per bucket (written at the next
#: heartbeat; its default of 500 keys per bucket leaves a short run's objects in memory) and a bound on its
#: files with least-recently-used eviction. The file-per-key backend ignores the size bound in 0.3.13
#: (docs/disk-tier.md).
OFFLOAD_BACKEND = "bucket_storage_backend"


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

