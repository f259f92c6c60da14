"""The TCP ports a worker's Mooncake client listens on, and an nftables ruleset that lets only the
deployment's hosts reach them.

What each Mooncake client (every `MooncakeDistributedStore.setup()`, so every worker) opens, measured on
mooncake-transfer-engine-non-cuda 0.3.13.post1 with /proc/net/tcp{,6}:
  * the transfer engine's handshake port, `0.0.0.0:<port>`;
  * the TCP transport's data port, `[::]:<port>` (dual-stack: IPv4 peers reach it too);
both random in 15000-17000 (`MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT`); and the port named in the client's
`local_hostname` ("host:port", 12300-14300), bound but not listening. Neither listener can be bound to one
address: Mooncake hard-codes the wildcard, and `MC_TCP_BIND_ADDRESS` only sets the address it advertises.
Whoever connects to the data port reads and writes any buffer the client registered (its segment, its
staging buffer and, on the zero-copy path, the KV cache) without authentication; no integrity mode helps,
since the bytes change in place, after the tag was checked or before it is.

So the recipe is a firewall: ``python -m kvledger_connector.store.transfer_ports --allow HOST ... --pid PID ...``
prints an nftables table that accepts TCP to the listed processes' listening ports from the allowed hosts
and drops it from anyone else; nothing is applied here (``nft -f -`` in the processes' network namespace
does). The ports are random per start, and applying the table replaces the previous one whole: run it after
each start, with every engine process of the host (each worker rank is one) in one call.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvledger.errors import LedgerInputError
from kvledger_connector.store.listeners import parse_tcp_listeners, read_tcp_table

TABLE = "kvledger_transfer"
_Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, order=True)
class Listener:
    """A listening TCP socket: its port and the address it is bound to ("0.0.0.0" and "::" are any)."""

    port: int
    address: str

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def loopback_only(self) -> bool:
        """Reachable from this host only (no rule needed for it)."""
        return ipaddress.ip_address(self.address).is_loopback


@dataclass(frozen=True)
class StorePorts:
    """A set-up client's advertised "host:port" (the name peers find its segment under) and the TCP
    listeners of this process."""

    advertised: str
    listeners: tuple[Listener, ...]


def parse_proc_net_tcp(text: str) -> list[tuple[Listener, int]]:
    """The LISTEN rows of a /proc/net/tcp or /proc/net/tcp6 text, as (listener, socket inode): the embedded
    master's parser (`listeners.parse_tcp_listeners`), malformed lines skipped."""
    return [(Listener(port, address), lst.inode) for address, port, lst in parse_tcp_listeners(text.encode())]


def _proc(pid: int | None) -> str:
    return "/proc/self" if pid is None else f"/proc/{pid}"


def socket_inodes(pid: int | None = None) -> set[int]:
    """Inodes of the sockets process `pid` (None: this one) holds, from its /proc fd links `socket:[N]`."""
    fd_dir = f"{_proc(pid)}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        raise LedgerInputError("pid", pid, "no such process") from None
    except PermissionError:
        raise LedgerInputError("pid", pid, "its file descriptors cannot be read: run as its user or root") from None
    inodes: set[int] = set()
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:["):-1]))
    return inodes


def listeners(pid: int | None = None) -> list[Listener]:
    """The TCP listeners (IPv4 and IPv6) whose socket process `pid` (None: this one) holds, sorted.

    /proc/PID/net/ shows the network namespace of that process, so this works from outside it."""
    held = socket_inodes(pid)
    found: set[Listener] = set()
    for table in ("tcp", "tcp6"):
        blob = read_tcp_table(f"{_proc(pid)}/net/{table}")  # bounded; b"": unreadable, or (tcp6) IPv6 off
        if not blob and not os.path.exists(_proc(pid)):
            raise LedgerInputError("pid", pid, "no such process")
        found.update(Listener(port, address) for address, port, lst in parse_tcp_listeners(blob)
                     if lst.inode in held)
    return sorted(found)


def store_ports(client: Any) -> StorePorts:
    """`client` (a set-up Mooncake client: `MooncakeStore.raw`) and this process's listeners: what
    `nft_ruleset` must cover for it. Mooncake does not say which listener is whose, so with several
    clients in one process (a one-process multi-rank driver) each gets the listeners of all."""
    return StorePorts(str(client.get_hostname()), tuple(listeners()))


def parse_peer(value: str) -> _Net:
    """An allowed peer: an IPv4/IPv6 address or network ("10.0.0.7", "10.0.0.0/24", "fd00::/64")."""
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise LedgerInputError("allow", value, "not an IPv4 or IPv6 address or network") from None
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen == 128 and net.network_address.ipv4_mapped:
        return ipaddress.ip_network(net.network_address.ipv4_mapped)  # a mapped IPv4 peer sends IPv4 packets
    return net


def nft_ruleset(ports: Iterable[int], peers: Iterable[str]) -> str:
    """An nftables table (`inet kvledger_transfer`) on the input hook: TCP to `ports` from `peers` is
    accepted, from anyone else dropped; other traffic is left to the host's other tables. It deletes any
    earlier table of that name first, so applying it again after a restart replaces the old ports."""
    want: set[int] = set()
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536:
            raise LedgerInputError("port", p, "must be an int in 1-65535")
        want.add(p)
    if not want:
        raise LedgerInputError("ports", [], "no port to protect")
    nets = sorted({parse_peer(a) for a in peers}, key=lambda n: (n.version, n.network_address, n.prefixlen))
    if not nets:
        raise LedgerInputError("allow", [], "at least one peer address: every host of the deployment, this one too")
    dport = f"tcp dport {{ {', '.join(map(str, sorted(want)))} }}"
    rules = []
    for version, match in ((4, "ip"), (6, "ip6")):
        group = [n.with_prefixlen if n.prefixlen < n.max_prefixlen else str(n.network_address)
                 for n in nets if n.version == version]
        if group:
            rules.append(f"{dport} {match} saddr {{ {', '.join(group)} }} accept")
    rules.append(f"{dport} drop")
    body = "\n".join(f"\t\t{r}" for r in rules)
    return (f"table inet {TABLE}\ndelete table inet {TABLE}\n"  # create-then-delete: no error when absent
            f"table inet {TABLE} {{\n\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n"
            f"{body}\n\t}}\n}}\n")


def _pid(value: str) -> int:
    try:
        pid = int(value)
    except ValueError:
        pid = 0
    if pid <= 0:
        raise argparse.ArgumentTypeError(f"pid={value!r}: not a process id")
    return pid


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvledger_connector.store.transfer_ports",
        description="Print an nftables ruleset that lets only the --allow hosts reach the TCP ports the "
                    "--pid processes listen on (their Mooncake transfer ports). Nothing is applied: pipe it "
                    "to `nft -f -` in their network namespace, again after each restart.")
    ap.add_argument("--allow", action="append", required=True, metavar="ADDR",
                    help="a deployment host's address or network (repeat; include this host)")
    ap.add_argument("--pid", action="append", required=True, type=_pid, metavar="PID",
                    help="an engine process, e.g. each worker rank (repeat)")
    args = ap.parse_args(argv)
    try:
        for a in args.allow:
            parse_peer(a)
        found = {pid: [lst for lst in listeners(pid) if not lst.loopback_only] for pid in args.pid}
        for pid, lsts in found.items():
            if not lsts:
                raise LedgerInputError("pid", pid, "listens on no TCP port another host can reach "
                                       "(is its Mooncake client set up?)")
        ruleset = nft_ruleset((lst.port for lsts in found.values() for lst in lsts), args.allow)
    except LedgerInputError as e:
        ap.error(f"--{e.field} {e.value!r}: {e.reason}")
    for pid, lsts in found.items():
        print(f"# pid {pid} listens on {', '.join(map(str, lsts))}")
    print(ruleset, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
