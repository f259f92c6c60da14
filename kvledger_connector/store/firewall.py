"""The store's ports closed to every other local user, by nftables (opt-in: ``firewall: "nftables"``).

Mooncake 0.3.13 authenticates nobody and its clients bind wildcards, and an engine's own processes need
127.0.0.1, so another local user is kept out by the socket's owner: a rule on the output hook that drops TCP
to the store's ports from every uid but the engine's (``meta skuid``). Each process of the engine keeps one
table of its own, covering every TCP port it listens on (its Mooncake client: handshake, data and disk-tier
RPC ports) and those of the servers it started (master, metrics, metadata server, holders)::

    table inet kvledger_<engine tag>_<pid ns>_<pid>_<start time> {
      chain output {
        type filter hook output priority 0; policy accept;
        tcp dport { <ports> } meta skuid != <engine uid> drop
      }
    }

The engine tag hashes the engine id (the name says which engine, not its id). The table is created when the
process's store is up (`acquire`), rewritten after its master restarts (`refresh`), deleted when the last
connector of the engine in the process stops (`release`, also at interpreter exit). A process killed
(SIGKILL) leaves its table: every `acquire` first deletes the tables of this PID namespace whose process is
gone or whose pid now names another process (its start time differs); a table from another PID namespace
sharing this network namespace is left alone (its pid means nothing here). Until the next start sweeps it,
a dead process's table still drops other users' connections to ports its store no longer holds.

Needs the nft command and CAP_NET_ADMIN (root); the opt-in fails start-up naming the key otherwise (the
connector's first `sweep`, before its store starts). Between the store's start and its table (milliseconds)
the ports are open. Root is not kept out.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvledger.errors import LedgerInputError
from kvledger_connector.store.listeners import held_ports
from kvledger_connector.store.rendezvous import owner_fields, process_alive

logger = logging.getLogger(__name__)

FIREWALL_KEY = "firewall"
NFTABLES = "nftables"
FAMILY = "inet"
TABLE_PREFIX = "kvledger_"
_TABLE_RE = re.compile(rf"{TABLE_PREFIX}([0-9a-f]{{12}})_([0-9]+)_([0-9]+)_([0-9]+)")
_NFT_TIMEOUT_S = 10.0


class FirewallError(LedgerInputError):
    """The opted-in firewall could not be put in place (no nft, not permitted, a rule refused)."""

    def __init__(self, reason: str) -> None:
        super().__init__(FIREWALL_KEY, NFTABLES, reason, f"{FIREWALL_KEY}={NFTABLES!r}: {reason}")


def _pid_ns_id(ns: str) -> int:
    """The inode of a PID namespace link ("pid:[4026531836]"), 0 where /proc does not say."""
    digits = ns[len("pid:["):-1] if ns.startswith("pid:[") and ns.endswith("]") else ""
    return int(digits) if digits.isdigit() else 0


def table_name(engine_id: str, pid: int | None = None) -> str:
    """The table of `engine_id` owned by process `pid` (this one by default): module doc."""
    owner = owner_fields(os.getpid() if pid is None else pid)
    tag = hashlib.sha256(f"kvledger-firewall\0{engine_id}".encode()).hexdigest()[:12]
    return f"{TABLE_PREFIX}{tag}_{_pid_ns_id(owner['pid_ns'])}_{owner['pid']}_{owner['start_time']}"


def ruleset(name: str, ports: Sequence[int], uid: int) -> str:
    """`name`'s whole definition, for `nft -f`: replaces a table of that name atomically (created empty
    first, so that its deletion never fails), every port in `ports` closed to every uid but `uid`."""
    body = ""
    if ports:
        body = f"    tcp dport {{ {', '.join(str(p) for p in sorted(set(ports)))} }} meta skuid != {uid} drop\n"
    return (f"table {FAMILY} {name}\ndelete table {FAMILY} {name}\n"
            f"table {FAMILY} {name} {{\n  chain output {{\n"
            f"    type filter hook output priority 0; policy accept;\n{body}  }}\n}}\n")


def _nft(args: Sequence[str], stdin: str | None = None) -> str:
    """Run nft; its stdout, or FirewallError with its stderr."""
    nft = shutil.which("nft")
    if nft is None:
        raise FirewallError("the nft command is not installed (apt-get install nftables); it must be, with root "
                            "(CAP_NET_ADMIN), or set firewall to 'off' and apply docs/security.md's recipe")
    try:
        out = subprocess.run([nft, *args], input=stdin, capture_output=True, text=True, timeout=_NFT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FirewallError(f"nft {' '.join(args)}: {e}") from None
    if out.returncode != 0:
        hint = " (needs root: CAP_NET_ADMIN)" if os.geteuid() != 0 else ""
        raise FirewallError(f"nft {' '.join(args)} failed{hint}: {out.stderr.strip()[-500:]}")
    return out.stdout


def owned_tables() -> list[str]:
    """The names of this module's tables in this network namespace (any engine, any process)."""
    out = _nft(["list", "tables", FAMILY])
    return [m.group(0) for line in out.splitlines()
            if (m := _TABLE_RE.fullmatch(line.strip().removeprefix(f"table {FAMILY} ")))]


def sweep() -> list[str]:
    """Delete the tables of processes of this PID namespace that are gone (or whose pid was reused): those
    a crash left. Returns the names deleted."""
    ns = _pid_ns_id(owner_fields(os.getpid())["pid_ns"])
    gone = []
    for name in owned_tables():
        m = _TABLE_RE.fullmatch(name)
        if m is None or int(m.group(2)) != ns or process_alive(int(m.group(3)), int(m.group(4))):
            continue
        try:
            _nft(["delete", "table", FAMILY, name])
            gone.append(name)
        except FirewallError as e:  # deleted meanwhile by another process's sweep
            logger.debug("firewall sweep: %s", e)
    if gone:
        logger.warning("firewall: deleted %d nftables table(s) left by processes that are gone: %s", len(gone),
                       ", ".join(gone))
    return gone


class PortFirewall:
    """This process's table for one engine (module doc). ``pids``: the processes whose listening ports it
    closes, asked at each `refresh` (this process and the servers it owns)."""

    def __init__(self, engine_id: str, pids: Callable[[], Sequence[int]]) -> None:
        self.engine_id = engine_id
        self.name = table_name(engine_id)
        self.uid = os.geteuid()
        self._pids = pids
        self.ports: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    def refresh(self) -> list[int]:
        """Rewrite the table for the ports the processes listen on now; returns them."""
        with self._lock:
            if self._closed:
                return []
            ports = held_ports(list(self._pids()))
            _nft(["-f", "-"], ruleset(self.name, ports, self.uid))
            self.ports = ports
            return ports

    def close(self) -> None:
        """Delete the table (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _nft(["-f", "-"], f"table {FAMILY} {self.name}\ndelete table {FAMILY} {self.name}\n")


@dataclass
class _Shared:
    fw: PortFirewall
    refs: int = 0


_LOCK = threading.Lock()
_ACTIVE: dict[str, _Shared] = {}  # engine_id -> this process's table of that engine


def acquire(engine_id: str, server_pids: Callable[[], Sequence[int]]) -> PortFirewall:
    """This process's table for `engine_id`, shared by its connectors (reference counted): swept, created
    and filled on the first call, refreshed on each (a later connector's client adds its ports).
    `server_pids`: the servers this process started (their ports are closed too). FirewallError when it
    cannot be put in place."""
    with _LOCK:
        ent = _ACTIVE.get(engine_id)
        if ent is None:
            sweep()
            ent = _Shared(PortFirewall(engine_id, lambda: [os.getpid(), *server_pids()]))
        ports = ent.fw.refresh()  # a failure leaves no entry behind (a first call's is not registered yet)
        ent.refs += 1
        _ACTIVE[engine_id] = ent
        logger.info("firewall: nftables table %s closes TCP ports %s to every uid but %d", ent.fw.name, ports,
                    ent.fw.uid)
        return ent.fw


def table_of(engine_id: str) -> PortFirewall | None:
    """This process's table for `engine_id`, None when it has none."""
    with _LOCK:
        ent = _ACTIVE.get(engine_id)
    return ent.fw if ent is not None else None


def refresh(engine_id: str) -> None:
    """After a master restart (its ports may have moved): rewrite `engine_id`'s table, if this process has
    one. A failure is logged: the old ports stay closed."""
    with _LOCK:
        ent = _ACTIVE.get(engine_id)
    if ent is None:
        return
    try:
        ent.fw.refresh()
    except FirewallError as e:
        logger.error("firewall: the table of engine %r was not rewritten after a master restart: %s", engine_id, e)


def release(engine_id: str) -> None:
    """One connector's release; the last one of the process deletes the table."""
    with _LOCK:
        ent = _ACTIVE.get(engine_id)
        if ent is None:
            return
        ent.refs -= 1
        if ent.refs > 0:
            return
        del _ACTIVE[engine_id]
    ent.fw.close()


def _at_exit() -> None:
    with _LOCK:
        fws = [ent.fw for ent in _ACTIVE.values()]
        _ACTIVE.clear()
    for fw in fws:
        try:
            fw.close()
        except FirewallError as e:
            logger.error("firewall: %s", e)


atexit.register(_at_exit)
