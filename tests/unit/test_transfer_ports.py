"""kvledger_connector/store/transfer_ports.py: /proc/net/tcp parsing, this process's listeners, the nftables ruleset
text for given ports and peers, and the CLI's errors naming the field and value."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.store.transfer_ports import (Listener, listeners, main, nft_ruleset, parse_proc_net_tcp,
                                               store_ports)

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
_REST = "00000000:00000000 00:00000000 00000000     0        0"
TCP = HEADER + (
    f"   0: 00000000:3E2B 00000000:0000 0A {_REST} 4101 1 0 100 0 0 10 0\n"
    f"   1: 0100007F:C1EB 00000000:0000 0A {_REST} 4102 1 0 100 0 0 10 0\n"
    f"   2: 0201A8C0:3E2B 0301A8C0:D431 01 {_REST} 4103 1 0 20 4 30 10 -1\n")
TCP6 = HEADER + (
    f"   0: 00000000000000000000000000000000:3F1D 00000000000000000000000000000000:0000 0A {_REST} 4201 1 0\n"
    f"   1: 00000000000000000000000001000000:2328 00000000000000000000000000000000:0000 0A {_REST} 4202 1 0\n")

RULESET = """table inet kvledger_transfer
delete table inet kvledger_transfer
table inet kvledger_transfer {
\tchain input {
\t\ttype filter hook input priority filter; policy accept;
\t\ttcp dport { 15915, 16147 } ip saddr { 10.0.0.0/24, 10.1.0.2 } accept
\t\ttcp dport { 15915, 16147 } ip6 saddr { fd00::7 } accept
\t\ttcp dport { 15915, 16147 } drop
\t}
}
"""


@pytest.mark.skipif(sys.byteorder != "little", reason="the rows above are a little-endian kernel's")
def test_listen_rows_are_parsed_and_other_states_skipped():
    assert parse_proc_net_tcp(TCP) == [(Listener(15915, "0.0.0.0"), 4101), (Listener(49643, "127.0.0.1"), 4102)]
    assert parse_proc_net_tcp(TCP6) == [(Listener(16157, "::"), 4201), (Listener(9000, "::1"), 4202)]
    assert [lst.loopback_only for lst, _ in parse_proc_net_tcp(TCP + TCP6.split("\n", 1)[1])] == [
        False, True, False, True]


@pytest.fixture
def sockets() -> Iterator[dict[str, socket.socket]]:
    """Listening on the IPv4 wildcard, the IPv6 wildcard (where IPv6 is on) and loopback, plus one bound
    socket that does not listen (like the port in a Mooncake client's local_hostname)."""
    made: dict[str, socket.socket] = {}
    try:
        for name, family, addr, listen in (("any4", socket.AF_INET, "0.0.0.0", True),
                                           ("lo4", socket.AF_INET, "127.0.0.1", True),
                                           ("bound", socket.AF_INET, "0.0.0.0", False),
                                           ("any6", socket.AF_INET6, "::", True)):
            try:
                s = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6
            made[name] = s
            s.bind((addr, 0))
            if listen:
                s.listen()
        yield made
    finally:
        for s in made.values():
            s.close()


def test_this_process_listeners_are_found_with_their_addresses(sockets: dict[str, socket.socket]):
    found = listeners()
    for name, addr in (("any4", "0.0.0.0"), ("lo4", "127.0.0.1"), ("any6", "::")):
        if name in sockets:
            assert Listener(sockets[name].getsockname()[1], addr) in found, (name, found)
    assert sockets["bound"].getsockname()[1] not in {lst.port for lst in found}  # bound, not listening
    assert [lst for lst in found if lst.loopback_only] != []
    raw = SimpleNamespace(get_hostname=lambda: "10.0.0.2:12345")  # a set-up client (`MooncakeStore.raw`)
    got = store_ports(raw)
    assert got.advertised == "10.0.0.2:12345" and Listener(sockets["any4"].getsockname()[1], "0.0.0.0") in \
        got.listeners


def test_the_ruleset_allows_the_peers_and_drops_everyone_else():
    got = nft_ruleset([16147, 15915, 16147], ["10.1.0.2", "fd00::7", "10.0.0.9/24", "::ffff:10.1.0.2"])
    assert got == RULESET  # sorted, deduplicated, a network kept as one, a mapped IPv4 peer as IPv4
    only4 = nft_ruleset([15001], ["192.168.1.5"])
    assert "ip6 saddr" not in only4 and "tcp dport { 15001 } ip saddr { 192.168.1.5 } accept" in only4
    assert only4.rstrip().splitlines()[-3].strip() == "tcp dport { 15001 } drop"


@pytest.mark.parametrize("ports, peers, field, value", [
    ([15001], ["10.0.0.999"], "allow", "10.0.0.999"),
    ([15001], ["host-a"], "allow", "host-a"),
    ([15001], [], "allow", []),
    ([0], ["10.0.0.1"], "port", 0),
    ([70000], ["10.0.0.1"], "port", 70000),
    (["15001"], ["10.0.0.1"], "port", "15001"),
    ([], ["10.0.0.1"], "ports", []),
])
def test_bad_input_names_the_field_and_value(ports, peers, field, value):
    with pytest.raises(LedgerInputError) as e:
        nft_ruleset(ports, peers)
    assert (e.value.field, e.value.value) == (field, value)
    assert str(e.value).startswith(f"{field}={value!r}: ")


def test_the_cli_prints_a_ruleset_for_a_process_ports(sockets: dict[str, socket.socket],
                                                        capsys: pytest.CaptureFixture[str]):
    assert main(["--allow", "10.0.0.1", "--allow", "10.0.0.2", "--pid", str(os.getpid())]) == 0
    out = capsys.readouterr().out
    port = sockets["any4"].getsockname()[1]
    assert f"0.0.0.0:{port}" in out.splitlines()[0] and f"{port}" in out.split("tcp dport", 1)[1]
    assert str(sockets["lo4"].getsockname()[1]) not in out  # loopback only: no other host reaches it
    assert "ip saddr { 10.0.0.1, 10.0.0.2 } accept" in out


def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("argv, says", [
    (["--allow", "10.0.0.999", "--pid", "1"], "--allow '10.0.0.999': not an IPv4 or IPv6 address or network"),
    (["--allow", "10.0.0.1", "--pid", "abc"], "pid='abc': not a process id"),
    (["--allow", "10.0.0.1", "--pid", "-3"], "pid='-3': not a process id"),
    (["--allow", "10.0.0.1", "--pid", "GONE"], "--pid GONE: no such process"),
    (["--pid", "1"], "the following arguments are required: --allow"),
])
def test_the_cli_refuses_bad_input_naming_it(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]):
    gone = str(_gone_pid())
    with pytest.raises(SystemExit) as e:
        main([gone if a == "GONE" else a for a in argv])
    assert e.value.code == 2
    assert says.replace("GONE", gone) in capsys.readouterr().err
