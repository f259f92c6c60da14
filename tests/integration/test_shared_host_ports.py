"""The shared-host port recipe of docs/security.md, as written there: in a network namespace of its own, the
embedded store (master, its metrics port, the metadata server) and a client with a memory segment and the
disk tier (handshake, data and tier RPC ports) listen as root; another local uid (65534) reaches every one
of those ports until the recipe is applied and none after it, while the engine's own uid still reaches
each and a put/get round trip still works."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("nft", "unshare", "ss", "ip")),
    reason="needs root, nft, unshare, ss and ip (a network namespace with nftables rules, a second uid)")


def recipe() -> str:
    """The shell recipe in docs/security.md (the fenced block after the 'Shared host' recipe marker)."""
    doc = (ROOT / "docs" / "security.md").read_text()
    m = re.search(r"<!-- shared-host recipe -->\s*```sh\n(.*?)```", doc, re.S)
    assert m, "docs/security.md lost its shared-host recipe"
    return m.group(1)


CHILD = r"""
import json, os, socket, subprocess, sys, tempfile, ctypes
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.store.listeners import parse_tcp_listeners, read_tcp_table
from testbed.procs import connects_as

tier = tempfile.mkdtemp()
with EmbeddedMooncake(rpc_timeout_ms=2000, disk_offload=True) as emb:
    cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, disk_offload=True,
                      disk_offload_dir=tier).with_addresses(emb.master_address, emb.metadata_server)
    store = MooncakeStore.connect(cfg)
    try:
        ports = sorted({port for table in ("tcp", "tcp6")
                        for _addr, port, lst in parse_tcp_listeners(read_tcp_table(f"/proc/net/{table}"))
                        if lst.uid == os.geteuid()})  # a namespace of its own: every listener is the store's
        named = {"master": emb.rpc_port, "metrics": emb.metrics_port, "metadata": emb.metadata_port}
        before = {p: connects_as(int(sys.argv[2]), p) for p in ports}
        rules = subprocess.run(["sh", "-c", sys.argv[1]], env={**os.environ, "ENGINE_UID": str(os.geteuid())},
                               capture_output=True, text=True)
        after = {p: connects_as(int(sys.argv[2]), p) for p in ports}
        own = {p: connects_as(0, p) for p in ports}
        buf = ctypes.create_string_buffer(b"x" * 4096, 4096)
        store.register_buffer(ctypes.addressof(buf), 4096)
        put = store.batch_put(["shared-host-k"], [[ctypes.addressof(buf)]], [[4096]])
        ctypes.memset(buf, 0, 4096)
        got = store.batch_get(["shared-host-k"], [[ctypes.addressof(buf)]], [[4096]])
        print(json.dumps({"ports": ports, "named": named, "before": before, "after": after, "own": own,
                          "rules_rc": rules.returncode, "rules_err": rules.stderr[-2000:], "put": put,
                          "got": got, "bytes_ok": buf.raw == b"x" * 4096}), flush=True)
    finally:
        store.close()
"""


def test_the_recipe_closes_every_port_of_the_embedded_store_to_another_local_uid() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", CHILD, recipe(), str(OTHER_UID)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    ports = res["ports"]
    assert set(res["named"].values()) <= set(ports)  # master, metrics, metadata
    assert len(ports) >= 6, ports  # and the client's handshake, data and tier RPC ports
    assert res["rules_rc"] == 0, res["rules_err"]
    assert all(res["before"].values()), res["before"]  # today: every port open to the other uid
    assert not any(res["after"].values()), res["after"]  # after the recipe: none
    assert all(res["own"].values()), res["own"]  # the engine's uid still reaches each
    assert res["put"] == [0] and res["got"] == [4096] and res["bytes_ok"], res
