"""Processes on this host, read from /proc (Linux): what the engine tests use to say that a run left nothing
behind and which Mooncake servers an engine's processes started; stopping a process group; the Mooncake
servers a test module or a demo starts and stops by pid."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvledger_connector.store.listeners import socket_inodes


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, process group, session) of a live process; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid, pgrp, sid = f.read().rsplit(")", 1)[1].split()[:4]
    except (OSError, ValueError):
        return None
    return None if state == "Z" else (int(ppid), int(pgrp), int(sid))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None


def session_members(sid: int) -> list[str]:
    """'pid: cmdline' of every live process whose session or process group is `sid`."""
    return [f"{p}: {cmdline(p)[:160]}" for p in _pids()
            if (st := proc_stat(p)) is not None and sid in (st[1], st[2])]


def processes_matching(*needles: str) -> list[str]:
    """'pid: cmdline' of every live process whose command line contains all `needles`."""
    out = []
    for p in _pids():
        if proc_stat(p) is not None and (cmd := cmdline(p)) and all(n in cmd for n in needles):
            out.append(f"{p}: {cmd[:160]}")
    return out


def mooncake_servers_started_by_session(sid: int) -> list[dict[str, object]]:
    """Mooncake server processes (`mooncake_master`, the HTTP metadata server) whose parent is a process of
    session `sid` (an engine's processes; the servers run in a session of their own)."""
    stats = {p: st for p in _pids() if (st := proc_stat(p)) is not None}
    ours = {p for p, st in stats.items() if st[2] == sid}
    found: list[dict[str, object]] = []
    for p, st in stats.items():
        if st[0] in ours and ("mooncake_master" in (cmd := cmdline(p)) or "http_metadata_server" in cmd):
            found.append({"pid": p, "ppid": st[0], "cmdline": cmd})
    return found


def connects_as(uid: int, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a process of `uid` (a child forked and switched to it; this process must be root for another
    uid, 0: unchanged) connects to 127.0.0.1:`port` within `timeout_s`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if uid:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            s = socket.socket()
            s.settimeout(timeout_s)
            s.connect(("127.0.0.1", port))
            s.close()
            code = 0
        except OSError:
            pass
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def loopback_peer_ports(pid: int) -> list[int]:
    """Remote ports of the established IPv4 TCP connections process `pid` holds to 127.0.0.1 (sorted, with
    repeats removed): e.g. whether a process is connected to a given Mooncake master."""
    inodes = socket_inodes(pid)
    ports: set[int] = set()
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return []
    for row in rows:
        cols = row.split()
        if len(cols) > 9 and cols[3] == "01" and cols[9].isdigit() and int(cols[9]) in inodes:  # ESTABLISHED
            host, port = cols[2].split(":")
            if host == "0100007F":
                ports.add(int(port, 16))
    return sorted(ports)


def session_processes(sid: int) -> list[dict[str, object]]:
    """pid, ppid, command line and loopback peer ports of every live process of session `sid`."""
    return [{"pid": p, "ppid": st[0], "cmdline": cmdline(p)[:200], "peer_ports": loopback_peer_ports(p)}
            for p in _pids() if (st := proc_stat(p)) is not None and st[2] == sid]


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is still there (zombies count: not yet reaped)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_group(pgid: int, *, grace_s: float = 10.0, done: Callable[[], bool] | None = None) -> None:
    """SIGTERM to process group `pgid`, SIGKILL to what is left after `grace_s`. `done` (e.g. the leader's
    ``poll() is not None``, which also reaps it) must hold too before a signal counts as enough."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if (done is None or done()) and not group_alive(pgid):
                return
            time.sleep(0.1)


@contextlib.contextmanager
def mooncake_servers(**kw: Any) -> Iterator[Any]:
    """A `mooncake_master` and metadata server on 127.0.0.1 (kvledger_connector.store.embedded.EmbeddedMooncake,
    `kw` passed on), stopped by pid on exit; a RuntimeError if either outlives the stop."""
    from kvledger_connector.store.embedded import EmbeddedMooncake

    mc = EmbeddedMooncake(**kw)
    try:
        yield mc
    finally:
        mc.stop()
    if mc.master_pid is not None or mc.metadata_pid is not None:
        raise RuntimeError(f"mooncake servers still running: {mc.master_pid}, {mc.metadata_pid}")


def wait_until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether ``pred()`` holds within ``timeout_s`` (polled: a condition another process or thread makes true)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll_s)
    return bool(pred())
