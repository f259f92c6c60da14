"""No metadata server to redirect (kvledger_connector/store/embedded.py, store/rendezvous.py): the embedded default's
clients find each other by Mooncake's peer-to-peer handshake, so another local user has no endpoint at which to
rewrite where a segment's bytes go.

In a network namespace of its own, two processes of one engine run the embedded default as root: the first
starts the master and holds the only memory segment, the second attaches (no segment: what it puts and gets
crosses to the first's). Between them, uid 65534 (`setpriv`) listens on a port of its own and tries what
worked against the HTTP metadata server: find it among root's listeners, read the first process's segment
descriptor and PUT it back with the data port pointed at its listener. Then the second process puts a value
carrying prompt text and reads the first's value."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534
MARK = b"PROMPT-TEXT-the-victims-prompt"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "setpriv", "ip")),
    reason="needs root, unshare, setpriv and ip (a network namespace of its own, a second uid)")

# one process of the engine: attach to (or start) the engine's servers, connect a client, then obey
ENGINE = r"""
import ctypes, json, sys
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.store.rendezvous import acquire_shared, release_shared
eid, segment = sys.argv[1], int(sys.argv[2])
h = acquire_shared(eid, 2000)
store = MooncakeStore.connect(StoreConfig(global_segment_size=segment, local_buffer_size=4 << 20,
                                          rpc_timeout_ms=2000), embedded=h)
buf = ctypes.create_string_buffer(4096)
store.register_buffer(ctypes.addressof(buf), 4096)
print(json.dumps({"segment": store.raw.get_hostname(), "metadata_server": h.metadata_server,
                  "server_pids": h.server_pids}), flush=True)
for line in sys.stdin:
    op, key, fill = line.split()
    if op == "put":
        ctypes.memmove(buf, (fill.encode() * 4096)[:4096], 4096)
        rc = store.batch_put([key], [[ctypes.addressof(buf)]], [[4096]])
    else:
        ctypes.memset(buf, 0, 4096)
        rc = store.batch_get([key], [[ctypes.addressof(buf)]], [[4096]])
    print(json.dumps({"rc": rc, "ok": buf.raw == (fill.encode() * 4096)[:4096]}), flush=True)
store.close()
release_shared(eid)
"""

# uid 65534: a listener of its own, then the metadata rewrite against every listener root holds
ATTACKER = r"""
import http.client, json, socket, sys, threading
from kvledger_connector.store.listeners import parse_tcp_listeners, read_tcp_table
segments = sys.argv[1].split(",")
trap = socket.socket(); trap.bind(("127.0.0.1", 0)); trap.listen(16)
got = []
def serve():
    while True:
        c, _ = trap.accept()
        c.settimeout(2.0)
        try:
            while (b := c.recv(65536)):
                got.append(b)
        except OSError:
            pass
threading.Thread(target=serve, daemon=True).start()
ports = sorted({p for t in ("tcp", "tcp6") for _a, p, lst in parse_tcp_listeners(read_tcp_table(f"/proc/net/{t}"))
                if lst.uid == 0})
servers, rewritten = [], []
for port in ports:
    for seg in segments:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            c.request("GET", f"/metadata?key=mooncake/ram/{seg}")
            r = c.getresponse(); body = r.read()
        except (OSError, http.client.HTTPException):
            break  # not an HTTP server
        if r.status != 200 or b"tcp_data_port" not in body:
            continue  # an HTTP server, but no segment's descriptor (the master's metrics answer 404)
        servers.append(port)
        desc = json.loads(body)
        desc["tcp_data_host"], desc["tcp_data_port"] = "127.0.0.1", trap.getsockname()[1]
        c.request("PUT", f"/metadata?key=mooncake/ram/{seg}", body=json.dumps(desc))
        if c.getresponse().status == 200:
            rewritten.append(seg)
print(json.dumps({"root_ports": ports, "descriptors": sorted(set(servers)), "rewritten": rewritten}), flush=True)
sys.stdin.readline()
print(json.dumps({"received": len(b"".join(got)), "mark": sys.argv[2].encode() in b"".join(got)}), flush=True)
"""

CHILD = r"""
import json, os, subprocess, sys, uuid
from kvledger_connector.store.listeners import parse_tcp_listeners, read_tcp_table, socket_inodes
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
engine, attacker, mark, uid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
eid = f"engine-{uuid.uuid4().hex[:8]}"
def spawn(argv):
    return subprocess.Popen(argv, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
def ask(p, line=None):
    if line is not None:
        p.stdin.write(line + "\n"); p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise SystemExit(f"child {p.args[:3]} exited with {p.wait()}")
    return json.loads(out)
first = spawn([sys.executable, "-c", engine, eid, str(64 << 20)])
a = ask(first)
second = spawn([sys.executable, "-c", engine, eid, "0"])
b = ask(second)
res = {"first": a, "second": b}
res["put_first"] = ask(first, "put victim-k A")
held = set().union(*(socket_inodes(p) for p in (first.pid, second.pid, *a["server_pids"])))
res["root_listeners_not_the_engines"] = sorted(
    p for t in ("tcp", "tcp6") for _a, p, lst in parse_tcp_listeners(read_tcp_table(f"/proc/net/{t}"))
    if lst.uid == 0 and lst.inode not in held)
evil = spawn(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", attacker,
              a["segment"], mark])
res["attack"] = ask(evil)
res["put_second"] = ask(second, f"put victim-k2 {mark}")
res["get_second"] = ask(second, "get victim-k A")
res["get_first"] = ask(first, f"get victim-k2 {mark}")
res["trap"] = ask(evil, "")
for p in (second, first):
    p.stdin.close(); p.wait(60)
print(json.dumps(res), flush=True)
"""


def test_another_uid_finds_no_metadata_server_and_cannot_redirect_a_segment(tmp_path: Path) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2", "KVLEDGER_RUNTIME_DIR": str(rt)}
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", CHILD, ENGINE, ATTACKER, MARK.decode(),
                          str(OTHER_UID)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    # the embedded default runs no metadata server: the handshake mode, and no listener of root but the
    # master's and the two clients' (and the attacker sees every one of them)
    assert res["first"]["metadata_server"] == res["second"]["metadata_server"] == "P2PHANDSHAKE", res
    assert len(res["first"]["server_pids"]) == 1 and res["second"]["server_pids"] == [], res  # the master alone
    assert res["root_listeners_not_the_engines"] == [], res
    assert len(res["attack"]["root_ports"]) >= 6, res  # master, metrics, two ports of each client
    # the attack: no listener hands out a segment's descriptor, nothing rewritten, nothing sent to its listener
    assert res["attack"]["descriptors"] == [] and res["attack"]["rewritten"] == [], res["attack"]
    assert res["trap"] == {"received": 0, "mark": False}, res["trap"]
    # and the engine's processes still put and get across each other's segments
    for step in ("put_first", "put_second"):
        assert res[step]["rc"] == [0], res
    for step in ("get_second", "get_first"):
        assert res[step]["rc"] == [4096] and res[step]["ok"], res
