"""Who listens where, as the kernel says: the LISTEN sockets of this network namespace's /proc/net/tcp{,6}
tables, each with its inode (no process can choose it) and its owner's uid, and the socket inodes a process
holds (/proc/<pid>/fd). Identity of a server is its listener's inode held by the pid that was started, never
"the port accepts" (kvledger_connector/store/embedded.py); the firewall closes the ports a process listens on
(kvledger_connector/store/firewall.py); the transfer-port recipe lists the clients' ports (transfer_ports.py)."""
from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import NamedTuple

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks; a race with other binders is retried by start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_accepts(port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts on 127.0.0.1:port: whether a port is busy, never who holds it
    (`loopback_listener`)."""
    try:
        socket.create_connection((LOOPBACK, port), timeout).close()
        return True
    except OSError:
        return False


class Listener(NamedTuple):
    """A LISTEN socket as the kernel lists it: its inode (no process can choose it) and its owner's uid."""

    inode: int
    uid: int


#: bound on what is read of a /proc/net/tcp table (a line is ~150 bytes: ~28,000 listeners)
MAX_TCP_TABLE_BYTES = 4 << 20
_TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN


def _address(hex_addr: str) -> str | None:
    """/proc/net/tcp{,6}'s address: 32-bit words printed in host byte order."""
    try:
        words = int(hex_addr, 16)
    except ValueError:
        return None
    if len(hex_addr) == 8:
        return socket.inet_ntoa(struct.pack("=I", words))
    if len(hex_addr) == 32:
        packed = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16)) for i in range(0, 32, 8))
        return socket.inet_ntop(socket.AF_INET6, packed)
    return None


def parse_tcp_listeners(blob: bytes) -> list[tuple[str, int, Listener]]:
    """The LISTEN sockets of a /proc/net/tcp{,6} table: (address, port, Listener). Lines that are not
    exactly the kernel's (too few fields, non-hex, a port or inode out of range) are skipped."""
    out: list[tuple[str, int, Listener]] = []
    for raw in blob.splitlines()[1:]:  # the first line is the header
        f = raw.decode("ascii", "replace").split()
        if len(f) < 10 or not f[0].endswith(":") or f[3] != _TCP_LISTEN:
            continue
        hex_addr, sep, hex_port = f[1].partition(":")
        address = _address(hex_addr) if sep and len(hex_port) == 4 else None
        if address is None or not f[7].isdigit() or not f[9].isdigit():
            continue
        try:
            port = int(hex_port, 16)
        except ValueError:
            continue
        uid, inode = int(f[7]), int(f[9])
        if 0 < port < 65536 and inode > 0 and uid < (1 << 32):
            out.append((address, port, Listener(inode, uid)))
    return out


def read_tcp_table(path: str) -> bytes:
    """At most MAX_TCP_TABLE_BYTES of a /proc table, whole lines, stopping past the listeners; b"" when it
    cannot be read."""
    lines: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                size += len(line)
                if size > MAX_TCP_TABLE_BYTES:
                    break
                lines.append(line)
                # the kernel lists the listening sockets first (its listening hash, then the established
                # one): past them the rest is connections, possibly many, so reading stops there
                if len(lines) > 1 and line.split()[3:4] != [_TCP_LISTEN.encode()]:
                    break
    except OSError:
        return b""
    return b"".join(lines)


def loopback_listener(port: int, table: str = "/proc/self/net/tcp") -> Listener | None:
    """The one LISTEN socket on 127.0.0.1:`port` in this network namespace, None if there is none or more
    than one (SO_REUSEPORT: the kernel would share connections between them, so neither is "the" master)."""
    found = [lst for addr, p, lst in parse_tcp_listeners(read_tcp_table(table)) if p == port and addr == LOOPBACK]
    return found[0] if len(found) == 1 else None


def port_holders(port: int) -> list[tuple[str, Listener]]:
    """Every LISTEN socket on `port`, any address, IPv4 and IPv6 (who took a port: for the warning)."""
    return [(addr, lst) for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6")
            for addr, p, lst in parse_tcp_listeners(read_tcp_table(table)) if p == port]


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` has open (its /proc/<pid>/fd/* that read ``socket:[inode]``);
    empty when they cannot be read (gone, another user's)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()
    out: set[int] = set()
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
            out.add(int(link[8:-1]))
    return out


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process `pid` has socket `inode` open (`socket_inodes`)."""
    return inode in socket_inodes(pid)


def held_ports(pids: Sequence[int]) -> list[int]:
    """The TCP ports, IPv4 and IPv6, any address, that the processes `pids` listen on (sorted, once each)."""
    held = set().union(*(socket_inodes(pid) for pid in pids)) if pids else set()
    return sorted({port for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6")
                   for _addr, port, lst in parse_tcp_listeners(read_tcp_table(table)) if lst.inode in held})


def holders_text(port: int) -> str:
    held = port_holders(port)
    if not held:
        return f"port {port}: held by a process not listed in this network namespace's tables"
    return f"port {port}: " + ", ".join(f"{addr} uid {lst.uid} (socket inode {lst.inode})" for addr, lst in held)
