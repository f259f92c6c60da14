"""Across hosts: the master and metadata server in one network namespace, two engines (the harness: vLLM's real
Scheduler, two ranks each, integrity `mac` under one secret) in two others and an outsider host in a fourth,
all joined by veth pairs on a bridge the test creates and removes.

The transfer-port recipe: the outsider connects to each engine's Mooncake listeners (every one of them, on
the wildcard address) until the ruleset `python -m kvledger_connector.store.transfer_ports` prints for that
engine's pid is applied in its namespace (`nft -f -`); then it reaches none, while the engines still share
KV through them. Engine A saves pass 1 and keeps its store segment (the bytes live in its process); engine
B, on another "host", loads what A saved, through the master and A's segment, and its stand-in forward
checks every loaded position (S7); each engine's `local_hostname` is the address its route to the master
picks. B's link is then cut inside a pass, when its first load asks for its bytes: those loads fail (load
errors, the breaker opens, every request computes), within seconds, never a stall. Restored, the breakers
close; a client without the secret (in A's process, so on an allowed host) plants a value with a tag
made under another secret, and B's next pass refuses it (an integrity mismatch, a load error) while
loading the rest from A. Traffic stays between the test's namespaces; each is removed at the end. Skipped,
with the reason, where namespaces cannot be created (not root, no `ip`) or `nft` is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.store.embedded import _tool

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.{}.{}"
HANG_GUARD_S = 180.0

ENGINE = r"""
import json, os, sys, threading, time
import torch
from kvledger_connector.config import StoreConfig
from kvledger_connector.shape.integrity import NONCE_BYTES, TRAILER_BYTES, IntegrityKey, reference_trailer
from kvledger_connector.store.transfer_ports import listeners, store_ports
from testbed.harness import Harness
from testbed.emu_model import expected_output, shared_prefix_prompts

master, metadata, workdir, role, secret = sys.argv[1:6]
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


def plant(h):
    # a client without the secret: zeros under rank 0's key of prompt 0's block 1, tagged under another one
    key = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))[1]
    size = h.workers[0].worker_side.steps.key_bytes
    other = IntegrityKey("mac", os.urandom(32), h.workers[0].integrity.construction)
    value = bytearray(size)
    value[-TRAILER_BYTES:] = reference_trailer(bytes(size - TRAILER_BYTES), other, key, os.urandom(NONCE_BYTES))
    h._attack_buf = buf = torch.frombuffer(value, dtype=torch.uint8)  # Mooncake reads it: kept alive
    c = h.checker()
    c.register_buffer(buf.data_ptr(), size)
    return key, c.remove(key, True) == 0 and c.batch_put([key], [[buf.data_ptr()]], [[size]]) == [0]


def cut_at_the_first_load(h):
    # the first get of the next pass waits for the test to cut this host's link, the others for the cut
    first, cut = threading.Lock(), threading.Event()
    for w in h.workers:
        store = w.worker_side.io.store
        def get(keys, ptrs, sizes, real=store.batch_get):
            if first.acquire(blocking=False):
                say(event="loading")
                sys.stdin.readline()
                cut.set()
            cut.wait()
            return real(keys, ptrs, sizes)
        store.batch_get = get


with Harness(cfg, tp_size=2, num_blocks=40, policy="recompute", workdir=workdir,
             extra={"integrity": "mac", "integrity_secret_file": secret}) as h:
    ss = h.scheduler_connector.scheduler_side.steps
    stores = [h.scheduler_connector.store, *(w.store for w in h.workers)]
    mismatches = lambda: sum(w.stats.total("integrity_mismatches") for w in h.workers)
    say(event="ready", local_hostname=h.workers[0].store.config.local_hostname,
        advertised=[store_ports(s.raw).advertised for s in stores], listeners=[str(x) for x in listeners()])
    sys.stdin.readline()  # the test applies the transfer-port recipe to this host
    if role == "save":
        right = run_pass(h, "a")
        say(event="saved", right=right, puts=sum(w.stats.total("put_keys") for w in h.workers))
        sys.stdin.readline()  # B has loaded and survived the cut
        key, ok = plant(h)
        say(event="planted", key=key, ok=ok)
        sys.stdin.readline()  # the bytes live in this process's segment: keep it until B is done
        say(event="done", garbage=h.garbage, at_rest=h.check_at_rest())
    else:
        right1 = run_pass(h, "b1")
        loads1 = ss.stats.total("loads_emitted")
        say(event="loaded", right=right1, loads=loads1)
        sys.stdin.readline()
        cut_at_the_first_load(h)
        t0 = time.monotonic()
        right2 = run_pass(h, "b2")
        trips = sum(s.stats.total("breaker_trips") for s in stores)
        say(event="cut-pass", right=right2, trips=trips, load_errors=h.stats.load_error_blocks,
            seconds=round(time.monotonic() - t0, 1))
        sys.stdin.readline()  # the test restores the link and has A plant a forged value
        deadline = time.monotonic() + 60
        while any(s.breaker_open for s in stores) and time.monotonic() < deadline:
            time.sleep(0.05)  # the stores' own probers close the breakers once the master answers
        closed = not any(s.breaker_open for s in stores)
        loads2, errors2, mismatches2 = ss.stats.total("loads_emitted"), h.stats.load_error_blocks, mismatches()
        right3 = run_pass(h, "b3")
        say(event="done", right=right3, closed=closed, loads=ss.stats.total("loads_emitted") - loads2,
            load_errors=h.stats.load_error_blocks - errors2, mismatches=mismatches() - mismatches2,
            garbage=h.garbage, at_rest=h.check_at_rest())
"""

# the outsider's probe: a TCP connect to each port, all at once (a dropped SYN costs the timeout)
PROBE = r"""
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
host, ports = sys.argv[1], json.loads(sys.argv[2])
def reach(port):
    try:
        socket.create_connection((host, port), timeout=1.5).close()
        return True
    except OSError:
        return False
with ThreadPoolExecutor(len(ports)) as ex:
    print(json.dumps(list(ex.map(reach, ports))))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Four namespaces on one bridge (in the master's namespace): m (master), a and b (engines), x (a host
    outside the deployment)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = {h: f"kvl-{h}-{tag}" for h in ("m", "a", "b", "x")}
        self.addr = {h: SUBNET.format(int(tag[:2], 16) % 250, i) for i, h in enumerate(("m", "a", "b", "x"), 1)}
        self.veth = {h: (f"v{h}{tag}", f"p{h}{tag}") for h in ("a", "b", "x")}

    def up(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "add", ns)
        m = self.ns["m"]
        _ip("-n", m, "link", "add", "br0", "type", "bridge")
        _ip("-n", m, "addr", "add", f"{self.addr['m']}/24", "dev", "br0")
        _ip("-n", m, "link", "set", "br0", "up")
        for h in self.veth:
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
    if shutil.which("nft") is None:
        pytest.skip("the transfer-port recipe needs nftables' `nft` (scripts/setup.sh installs it as root)")
    hs = Hosts()
    try:
        hs.up()
        subprocess.run(["ip", "netns", "exec", hs.ns["a"], "nft", "list", "ruleset"], check=True,
                       capture_output=True, text=True, timeout=30)
    except (subprocess.CalledProcessError, OSError) as e:
        hs.down()
        pytest.skip(f"network namespaces or nftables unavailable here: {getattr(e, 'stderr', '') or e}")
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


def _reaches(hosts: Hosts, src: str, dst: str, ports: list[int]) -> list[bool]:
    out = subprocess.run(["ip", "netns", "exec", hosts.ns[src], sys.executable, "-c", PROBE, hosts.addr[dst],
                          json.dumps(ports)], check=True, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def _guard_ports(hosts: Hosts, h: str, p: subprocess.Popen[str], ready: dict[str, Any], env: dict[str, str]
                 ) -> None:
    """The recipe for engine `h`: its pid's ruleset, applied in its namespace; before it, the outsider reaches
    every port the ruleset covers, after it none."""
    assert ready["local_hostname"] == hosts.addr[h]  # derived from the route
    assert {a.split(":", 1)[0] for a in ready["advertised"]} == {hosts.addr[h]}, ready
    allow = [x for d in ("m", "a", "b") for x in ("--allow", hosts.addr[d])]
    ruleset = subprocess.run([sys.executable, "-m", "kvledger_connector.store.transfer_ports", *allow, "--pid", str(p.pid)],
                             env=env, check=True, capture_output=True, text=True, timeout=60).stdout
    [listed] = re.findall(r"tcp dport \{ ([0-9, ]+) \} drop", ruleset)
    ports = [int(x) for x in listed.split(", ")]
    # what Mooncake binds: each of the 3 clients (scheduler, 2 ranks) a handshake and a data listener, all on
    # the wildcard address whatever the client advertises; the engine's own list is the CLI's
    assert sorted(int(x.rsplit(":", 1)[1]) for x in ready["listeners"]) == ports and len(ports) == 6, ready
    assert {x.rsplit(":", 1)[0] for x in ready["listeners"]} <= {"0.0.0.0", "[::]"}, ready
    assert _reaches(hosts, "x", h, ports) == [True] * len(ports)
    subprocess.run(["ip", "netns", "exec", hosts.ns[h], "nft", "-f", "-"], input=ruleset, check=True,
                   capture_output=True, text=True, timeout=30)
    assert _reaches(hosts, "x", h, ports) == [False] * len(ports)
    _send(p)


def _send(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


def test_engines_on_two_hosts_share_kv_behind_the_transfer_port_recipe(hosts: Hosts, tmp_path: Path) -> None:
    """See the module doc: the recipe shuts the outsider out, B loads what A saved through it, a cut inside
    a pass costs load errors and no stall, a value tagged without the secret is never loaded."""
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
        secret = tmp_path / "secret"  # the deployment's one `mac` secret
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
        workdir = str(tmp_path / "model")  # one model path: it is part of the keys
        args = [f"{m}:{rpc}", f"http://{m}:{meta}/metadata", workdir]
        a = hosts.run("a", [sys.executable, str(script), *args, "save", str(secret)], env=env,
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(a)
        _guard_ports(hosts, "a", a, _event(a, "ready"), env)
        saved = _event(a, "saved")
        assert saved["right"] and saved["puts"] > 0, saved
        b = hosts.run("b", [sys.executable, str(script), *args, "load", str(secret)], env=env,
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(b)
        _guard_ports(hosts, "b", b, _event(b, "ready"), env)
        loaded = _event(b, "loaded")
        assert loaded["right"] and loaded["loads"] > 0, loaded  # B's forward checked every loaded position
        _send(b)
        _event(b, "loading")  # the pass's lookups hit; its first get waits for the cut
        hosts.link("b", "down")
        _send(b)
        cut = _event(b, "cut-pass")
        assert cut["right"] and cut["trips"] >= 1 and cut["load_errors"] > 0, cut  # no cache, never a wrong output
        assert cut["seconds"] < 30, cut  # RPC and transfer timeouts of 1-2 s bound it, not a stall
        hosts.link("b", "up")
        _send(a)
        assert _event(a, "planted")["ok"]
        _send(b)
        done_b = _event(b, "done")
        assert done_b["right"] and done_b["closed"] and done_b["loads"] > 0, done_b
        assert done_b["mismatches"] >= 1 and done_b["load_errors"] >= 1, done_b  # the planted value refused
        assert done_b["garbage"] == [] and done_b["at_rest"] == [], done_b
        _send(a)
        done_a = _event(a, "done")
        assert done_a["garbage"] == [] and done_a["at_rest"] == [], done_a
    finally:
        _stop(procs)
