"""Across hosts: the master and metadata server in one network namespace, two engines (the harness: vLLM's real
Scheduler, two ranks each) in two others, all joined by veth pairs on a bridge the test creates and removes.

Engine A saves pass 1 and keeps its store segment (the bytes live in its process); engine B, on another
"host", loads what A saved, through the master and A's segment, and its stand-in forward checks every loaded
position (S7); each engine's `local_hostname` is the address its route to the master picks. Then B's link is
cut while B runs a pass (lookups miss, the breaker opens, every request computes) and restored: the breakers
close and the next pass loads from A again. Traffic stays between the test's namespaces; each is removed at
the end. Skipped, with the reason, where namespaces cannot be created (not root, no `ip`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.embedded import _tool

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.{}.{}"
HANG_GUARD_S = 180.0

ENGINE = r"""
import json, sys, time
from kvledger_connector.config import StoreConfig
from testbed.harness import Harness
from testbed.emu_model import expected_output, shared_prefix_prompts

master, metadata, workdir, role = sys.argv[1:5]
cfg = StoreConfig(master_server_address=master, metadata_server=metadata, global_segment_size=32 << 20,
                  local_buffer_size=4 << 20, rpc_timeout_ms=1000, unhealthy_backoff_ms=300,
                  max_unhealthy_backoff_ms=1200, transfer_timeout_s=2)
prompts = shared_prefix_prompts(8, num_prefixes=2, prefix_len=48, suffix_len=16, seed=5)


def say(**kw):
    print(json.dumps(kw), flush=True)


def run_pass(h, tag):
    h.reset_prefix_cache_when_idle()
    for i, p in enumerate(prompts):
        h.add_request(f"{tag}-{i}", p, 8)
    h.run(max_steps=5_000, timeout_s=120)
    return all(h.stats.outputs[f"{tag}-{i}"] == expected_output(p, 8) for i, p in enumerate(prompts))


with Harness(cfg, tp_size=2, num_blocks=40, policy="recompute", workdir=workdir) as h:
    ss = h.scheduler_connector.scheduler_side
    stores = [h.scheduler_connector.store, *(w.store for w in h.workers)]
    say(event="ready", local_hostname=h.workers[0].store.config.local_hostname)
    if role == "save":
        right = run_pass(h, "a")
        say(event="saved", right=right, puts=sum(w.stats.total("put_keys") for w in h.workers))
        sys.stdin.readline()  # the bytes live in this process's segment: keep it until B is done
        say(event="done", garbage=h.garbage, at_rest=h.check_at_rest())
    else:
        right1 = run_pass(h, "b1")
        loads1 = ss.num_loads
        say(event="loaded", right=right1, loads=loads1)
        sys.stdin.readline()  # the test cuts this host's link
        right2 = run_pass(h, "b2")
        trips = sum(s.num_trips for s in stores)
        say(event="cut-pass", right=right2, trips=trips)
        sys.stdin.readline()  # the test restores it
        deadline = time.monotonic() + 60
        while any(s.breaker_open for s in stores) and time.monotonic() < deadline:
            time.sleep(0.05)  # the stores' own probers close the breakers once the master answers
        closed = not any(s.breaker_open for s in stores)
        right3 = run_pass(h, "b3")
        say(event="done", right=right3, closed=closed, loads=ss.num_loads - loads1, garbage=h.garbage,
            at_rest=h.check_at_rest())
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Three namespaces on one bridge (in the master's namespace): m (master), a and b (engines)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {h: f"kvl-{h}-{tag}" for h in ("m", "a", "b")}
        self.addr = {"m": SUBNET.format(int(tag[:2], 16) % 250, 1), "a": SUBNET.format(int(tag[:2], 16) % 250, 2),
                     "b": SUBNET.format(int(tag[:2], 16) % 250, 3)}
        self.veth = {h: (f"v{h}{tag}", f"p{h}{tag}") for h in ("a", "b")}

    def up(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "add", ns)
        m = self.ns["m"]
        _ip("-n", m, "link", "add", "br0", "type", "bridge")
        _ip("-n", m, "addr", "add", f"{self.addr['m']}/24", "dev", "br0")
        _ip("-n", m, "link", "set", "br0", "up")
        for h in ("a", "b"):
            inner, outer = self.veth[h]
            _ip("link", "add", inner, "netns", self.ns[h], "type", "veth", "peer", "name", outer, "netns", m)
            _ip("-n", m, "link", "set", outer, "master", "br0")
            _ip("-n", m, "link", "set", outer, "up")
            _ip("-n", self.ns[h], "addr", "add", f"{self.addr[h]}/24", "dev", inner)
            _ip("-n", self.ns[h], "link", "set", inner, "up")
        for ns in self.ns.values():
            _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, h: str, state: str) -> None:
        _ip("-n", self.ns[h], "link", "set", self.veth[h][0], state)

    def down(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def run(self, h: str, cmd: list[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[h], *cmd], text=True, **kw)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    hs = Hosts()
    try:
        hs.up()
    except (subprocess.CalledProcessError, OSError) as e:
        hs.down()
        pytest.skip(f"network namespaces cannot be created here: {getattr(e, 'stderr', '') or e}")
    try:
        yield hs
    finally:
        hs.down()


def _event(p: subprocess.Popen[str], want: str) -> dict[str, Any]:
    assert p.stdout is not None
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"engine exited (rc {p.poll()}) before {want!r}")
        if line.startswith("{"):
            ev = json.loads(line)
            if ev.get("event") == want:
                print(f"engine: {ev}")
                return ev
    raise AssertionError(f"no {want!r} from the engine within {HANG_GUARD_S}s")


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def test_engine_b_loads_what_engine_a_saved_across_hosts_and_survives_a_cut_link(hosts: Hosts,
                                                                                   tmp_path: Path) -> None:
    rpc, meta, metrics = 50051, 50052, 50053  # inside the master's namespace: nothing else binds there
    m = hosts.addr["m"]
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    try:
        procs.append(hosts.run("m", _tool("mooncake_http_metadata_server") + [
            "--host", m, "--port", str(meta), "--log-level", "WARNING"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(hosts.run("m", _tool("mooncake_master") + [
            f"--rpc_address={m}", f"--rpc_port={rpc}", "--enable_http_metadata_server=false",
            f"--metrics_host={m}", f"--metrics_port={metrics}", "--default_kv_lease_ttl=2000",
            "--logtostderr", "--minloglevel=1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        script = tmp_path / "engine.py"
        script.write_text(ENGINE)
        workdir = str(tmp_path / "model")  # one model path: it is part of the keys
        args = [f"{m}:{rpc}", f"http://{m}:{meta}/metadata", workdir]
        a = hosts.run("a", [sys.executable, str(script), *args, "save"], env=env, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE)
        procs.append(a)
        assert _event(a, "ready")["local_hostname"] == hosts.addr["a"]  # derived from the route
        saved = _event(a, "saved")
        assert saved["right"] and saved["puts"] > 0, saved
        b = hosts.run("b", [sys.executable, str(script), *args, "load"], env=env, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE)
        procs.append(b)
        assert _event(b, "ready")["local_hostname"] == hosts.addr["b"]
        loaded = _event(b, "loaded")
        assert loaded["right"] and loaded["loads"] > 0, loaded  # B's forward checked every loaded position
        assert b.stdin is not None and a.stdin is not None
        hosts.link("b", "down")
        b.stdin.write("go\n")
        b.stdin.flush()
        cut = _event(b, "cut-pass")
        assert cut["right"] and cut["trips"] >= 1, cut  # no cache, never a wrong output
        hosts.link("b", "up")
        b.stdin.write("go\n")
        b.stdin.flush()
        done_b = _event(b, "done")
        assert done_b["right"] and done_b["closed"] and done_b["loads"] > 0, done_b
        assert done_b["garbage"] == [] and done_b["at_rest"] == [], done_b
        a.stdin.write("go\n")
        a.stdin.flush()
        done_a = _event(a, "done")
        assert done_a["garbage"] == [] and done_a["at_rest"] == [], done_a
    finally:
        _stop(procs)
