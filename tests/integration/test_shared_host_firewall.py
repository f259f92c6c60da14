"""The connector's own firewall (``firewall: "nftables"``, kvledger_connector/store/firewall.py): each process of
the engine closes every port its store listens on to every other local uid, removes its table at shutdown, and
a table a killed process left is swept at the next start.

Each engine runs as root in a network namespace of its own (`unshare -n`; nftables tables are per namespace),
through the real connectors of a TP 2 engine in one process (testbed.harness). Another local uid is uid
65534: it connects to every listener in the namespace."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.firewall import FirewallError
from testbed.harness import Harness
from tests.integration.test_master_identity import SQUATTER

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("nft", "unshare", "ip")),
    reason="needs root, nft, unshare and ip (nftables rules in a network namespace of its own, a second uid)")

# shared by the children: an engine with the firewall on, and a connection attempt as a given uid
PRELUDE = r"""
import json, os, subprocess, sys, tempfile
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
rt = tempfile.mkdtemp()
os.environ["KVLEDGER_RUNTIME_DIR"] = rt
from kvledger_connector.config import StoreConfig
from kvledger_connector.store import firewall
from kvledger_connector.store.listeners import parse_tcp_listeners, read_tcp_table
from testbed.harness import Harness, shared_prefix_prompts
from testbed.procs import connects_as

def engine():
    cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
    return Harness(cfg, tp_size=2, num_blocks=18, max_num_seqs=8, extra={"firewall": "nftables"},
                   workdir=tempfile.mkdtemp())

def listeners():
    return sorted({p for t in ("tcp", "tcp6") for _a, p, _l in parse_tcp_listeners(read_tcp_table(f"/proc/net/{t}"))})
"""

RUN = PRELUDE + r"""
prompts = shared_prefix_prompts(8, num_prefixes=2, prefix_len=48, suffix_len=8, seed=5)
with engine() as h:
    ports = listeners()  # a namespace of its own: every listener is the engine's store
    tables = firewall.owned_tables()
    other = {p: connects_as(int(sys.argv[1]), p) for p in ports}
    own = {p: connects_as(0, p) for p in ports}
    h.run_pass(prompts, 8, tag="p1")
    h.reset_prefix_cache_when_idle()
    h.run_pass(prompts, 8, tag="p2")
    res = {"ports": ports, "tables": tables, "pid": os.getpid(), "other": other, "own": own,
           "closed": firewall.table_of(h.scheduler_connector.engine.engine_id).ports,
           "loaded_tokens": h.scheduler_connector.stats.totals.data.get("loaded_tokens", 0),
           "load_errors": h.stats.load_error_blocks, "garbage": h.garbage}
res["tables_after"] = firewall.owned_tables()
print(json.dumps(res), flush=True)
"""


@needs_netns
def test_the_connectors_firewall_shuts_out_another_uid_and_loads_still_hit() -> None:
    """Every port of the engine's store (the master's RPC and metrics ports, and each of the three clients'
    handshake and data ports: scheduler and two workers) refuses uid 65534 and answers root, the engine's
    uid; the second pass loads what the first saved; shutdown removes the table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", RUN, str(OTHER_UID)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    assert len(res["ports"]) >= 8, res  # master, metrics, 2 ports of each of 3 clients
    assert res["closed"] == res["ports"], res  # the table names every one of them
    assert [t.split("_")[3] for t in res["tables"]] == [str(res["pid"])], res["tables"]  # one table, this pid's
    assert not any(res["other"].values()), res["other"]  # another uid: nothing through any port
    assert all(res["own"].values()), res["own"]
    assert res["loaded_tokens"] > 0 and res["load_errors"] == 0 and res["garbage"] == [], res
    assert res["tables_after"] == [], res["tables_after"]  # removed at shutdown


# one engine that says its table and its pid, then waits (to be killed, or to stop on stdin's end)
HOLD = PRELUDE + r"""
with engine() as h:
    print(json.dumps({"pid": os.getpid(), "tables": firewall.owned_tables(), "ports": listeners()}), flush=True)
    sys.stdin.read()
"""

CRASH = r"""
import json, os, signal, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from kvledger_connector.store import firewall
hold = sys.argv[1]
def start():
    p = subprocess.Popen([sys.executable, "-c", hold], text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    return p, json.loads(p.stdout.readline())
live, a = start()
killed, b = start()
os.kill(killed.pid, signal.SIGKILL)
killed.wait(30)
left = firewall.owned_tables()
nxt, c = start()
after_next = firewall.owned_tables()
for p in (nxt, live):
    p.stdin.close(); p.wait(120)
print(json.dumps({"live": a, "killed": b, "left": left, "next": c, "after_next": after_next,
                  "end": firewall.owned_tables()}), flush=True)
"""


@needs_netns
def test_a_killed_processs_table_is_swept_at_the_next_start() -> None:
    """Two engines run; one is SIGKILLed: its table stays (no code of it runs) until the next engine's start
    deletes it. The live engine's table is kept; both clean shutdowns remove theirs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", CRASH, HOLD], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=500)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    live, killed, nxt = ([t for t in res[k]["tables"] if t.split("_")[3] == str(res[k]["pid"])]
                         for k in ("live", "killed", "next"))
    assert len(live) == len(killed) == len(nxt) == 1, res
    assert sorted(res["left"]) == sorted(live + killed), res  # the crash left its table
    assert sorted(res["after_next"]) == sorted(live + nxt), res  # the next start swept it, kept the live one
    assert res["end"] == [], res


# the owner's master moves: another process of root takes its port the moment it dies (the squatter of
# test_master_identity.py), so the supervisor starts the master on a fresh port; the table must follow it
MOVE = r"""
import json, os, signal, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from kvledger_connector.store import firewall, rendezvous
from testbed.procs import connects_as, wait_until
squat, uid, eid = sys.argv[1], int(sys.argv[2]), "engine-moves"
os.environ["KVLEDGER_RUNTIME_DIR"] = __import__("tempfile").mkdtemp()
h = rendezvous.acquire_shared(eid, 2000, on_restart=lambda: firewall.refresh(eid))
fw = firewall.acquire(eid, lambda: h.server_pids)
old, before = h.rpc_port, list(fw.ports)
squatter = subprocess.Popen([sys.executable, "-c", squat, str(old), "60"], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
assert squatter.stdout.readline().strip() == "ready"
kills = 0
while True:  # should the restart win the port, kill the master again
    assert kills < 5 and wait_until(lambda: h.master_pid is not None, 60.0)
    os.kill(h.master_pid, signal.SIGKILL)
    kills += 1
    if squatter.stdout.readline().strip() == "bound":
        break
moved = h.wait_restarts(kills, 60.0) and wait_until(lambda: h.rpc_port != old and h.rpc_port in fw.ports, 20.0)
res = {"old": old, "before": before, "new": h.rpc_port, "after": fw.ports, "moved": moved,
       "other": connects_as(uid, h.rpc_port), "own": connects_as(0, h.rpc_port)}
squatter.kill(); squatter.wait(10)
firewall.release(eid)
rendezvous.release_shared(eid)
res["tables_after"] = firewall.owned_tables()
print(json.dumps(res), flush=True)
"""


@needs_netns
def test_the_table_follows_a_master_that_moved_to_a_fresh_port() -> None:
    """The owner's master dies and another process holds its port: the supervisor starts it on a fresh port
    and the owner's table is rewritten to close that one too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", MOVE, SQUATTER, str(OTHER_UID)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res["moved"] and res["old"] in res["before"] and res["new"] in res["after"], res
    assert not res["other"] and res["own"], res
    assert res["tables_after"] == [], res


def test_the_firewall_opt_in_fails_start_up_by_name_without_nft(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Opted in where nft is missing: start-up fails naming the key and what is missing, and stops what it
    started (no rendezvous file, so no master, is left)."""
    rdir = tmp_path / "run"
    rdir.mkdir(mode=0o700)
    monkeypatch.setenv("KVLEDGER_RUNTIME_DIR", str(rdir))
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    cfg = StoreConfig(global_segment_size=16 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
    with pytest.raises(FirewallError, match=r"firewall='nftables'.*nft command is not installed"):
        Harness(cfg, tp_size=1, extra={"firewall": "nftables"}, workdir=str(tmp_path / "m"))
    assert list(rdir.glob("embedded-*.json")) == []
