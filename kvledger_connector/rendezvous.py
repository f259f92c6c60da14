"""The embedded default across an engine's processes: one private Mooncake per engine, found by the rest.

With no `master_server_address`, a multi-process engine (`vllm serve --tensor-parallel-size 2`: the
scheduler-side connector in the EngineCore process, one worker-side connector per worker process) must
use ONE master, or the scheduler looks up keys on a master no worker writes to. All processes of one
engine carry the same `kv_transfer_config.engine_id` (the config is pickled to every worker), so:

    <runtime dir>/embedded-<engine_id>.json     {"pid", "master_address", "metadata_server"}
    <runtime dir>/.lock                         flock: one process at a time decides

    the first process to arrive starts the servers and writes the file; the others attach to it.
    The servers die with their owner (parent-death SIGKILL), so a crashed engine leaves no server;
    the owner removes the file at shutdown, and every acquire first sweeps files whose owner is dead.

The runtime dir is `$KVLEDGER_RUNTIME_DIR`, else `<tmp>/kvledger-<uid>`, created 0700 and refused when
another user owns it. Within one process the connectors of an engine share one handle, reference counted
(`acquire_shared` / `release_shared`). Only processes on this host can attach: a multi-node engine must configure
`master_server_address` (the connector refuses the embedded default when `parallel_config.nnodes > 1`).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvledger_connector.embedded import EmbeddedMooncake, port_accepts

RUNTIME_DIR_ENV = "KVLEDGER_RUNTIME_DIR"


class RendezvousError(RuntimeError):
    """The runtime directory is unusable (wrong owner, not a directory); the message says which and why."""


@dataclass(frozen=True)
class AttachedMooncake:
    """Another process's embedded servers; stopping is its owner's job."""

    master_address: str
    metadata_server: str
    owner_pid: int

    def stop(self) -> None:
        return


def runtime_dir() -> str:
    d = os.environ.get(RUNTIME_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"kvledger-{os.getuid()}")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except FileExistsError:  # a file there: refused below
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RendezvousError(f"{RUNTIME_DIR_ENV}={d!r}: not a directory owned by uid {os.getuid()}; "
                              f"set {RUNTIME_DIR_ENV} to a private directory")
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            info = json.load(f)
        return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _sweep(d: str) -> None:
    """Files left by dead owners (a crash skips the removal at shutdown)."""
    for name in os.listdir(d):
        if name.startswith("embedded-") and name.endswith(".json"):
            path = os.path.join(d, name)
            info = _read(path)
            if info is None or not _alive(info["pid"]):
                try:
                    os.remove(path)
                except OSError:
                    pass


def rendezvous_path(engine_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)[:120]
    return os.path.join(runtime_dir(), f"embedded-{safe}.json")


def acquire(engine_id: str, start: Callable[[], EmbeddedMooncake]) -> EmbeddedMooncake | AttachedMooncake:
    """This engine's servers: attach to those another process of the engine started, or start them
    (`start()`) and publish their addresses. Held under the directory's lock, so two processes that
    arrive together never both start servers."""
    path = rendezvous_path(engine_id)
    with open(os.path.join(os.path.dirname(path), ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _sweep(os.path.dirname(path))
        info = _read(path)
        if info is not None and info["pid"] != os.getpid():
            port = int(str(info.get("master_address", ":0")).rsplit(":", 1)[-1] or 0)
            if port and port_accepts(port, timeout=1.0):
                return AttachedMooncake(str(info["master_address"]), str(info["metadata_server"]), info["pid"])
            os.remove(path)  # owner alive but its master is gone: start afresh
        emb = start()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "master_address": emb.master_address,
                       "metadata_server": emb.metadata_server}, f)
        os.replace(tmp, path)
        return emb


def release(engine_id: str) -> None:
    """The owner's shutdown: withdraw the file (only if this process published it)."""
    path = rendezvous_path(engine_id)
    info = _read(path)
    if info is not None and info["pid"] == os.getpid():
        try:
            os.remove(path)
        except OSError:
            pass


_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, list[Any]] = {}  # engine_id -> [EmbeddedMooncake | AttachedMooncake, refcount]


def acquire_shared(engine_id: str, rpc_timeout_ms: int) -> EmbeddedMooncake | AttachedMooncake:
    """This process's handle on the engine's embedded servers: one per engine for every connector of this
    process (reference counted), found across the engine's processes by `acquire`."""
    with _SHARED_LOCK:
        ent = _SHARED.get(engine_id)
        if ent is None:
            handle = acquire(engine_id, lambda: EmbeddedMooncake(rpc_timeout_ms=rpc_timeout_ms))
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
                release(engine_id)
            ent[0].stop()
