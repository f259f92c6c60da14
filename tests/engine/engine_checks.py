"""Checks every engine test makes of a run's result (testbed/engine_run.py), whatever runs the model: the
stand-in worker (test_engine.py) or vLLM's own CPU worker with a real architecture (test_real_model.py)."""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

from conformance import runlog
from conformance.engine import tracecheck
from kvledger.trace import validate_events
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.store.listeners import port_accepts
from testbed.procs import alive, processes_matching

PIN_CAP = 16  # max_inflight_jobs: the trace check's BoundedPins bound


#: what Mooncake's client logs when the master did not answer within `rpc_timeout_ms` (2 s)
MASTER_TIMEOUT_MARKS = ("RPC call timed out", "Batch RPC call failed: Connection timed out")


def master_timeouts(res: dict[str, Any]) -> int:
    text = Path(res["log"]).read_text(errors="replace")
    return sum(text.count(m) for m in MASTER_TIMEOUT_MARKS)


#: what vLLM logs when it recomputes blocks a connector reported as failed loads (block-level reports only)
RECOVERED_MARK = "Recovered from KV load failure"


def check_at_rest(res: dict[str, Any]) -> None:
    assert res["at_rest"]["done"], f"blocks still held at the end (reset_prefix_cache failed): {res['at_rest']}"
    eng = res["engine"]
    if eng is not None:  # EngineCore in the driver's process: its pool and pins are readable
        assert eng["free_blocks"] == eng["num_blocks"] - 1 and not eng["held_blocks"], eng
        assert not eng["pinned_jobs"] and eng["load_pins"] == 0, eng
        assert eng["jobs_opened"] == eng["jobs_released"] > 0, eng


def check_trace(trace: Path) -> list[dict[str, Any]]:
    events = tracecheck.read_log(trace)
    validate_events(events, runtime=True)  # kvledger.trace's schema, only events a real run logs
    v = runlog.check_events(events, pin_cap=PIN_CAP, expect_rest=True)
    assert v.accepted, f"{v.line(trace.name)} [log kept: {trace}]"
    return events


def check_nothing_left(res: dict[str, Any]) -> None:
    """After the engine exited: no process of its session or group (EngineCore, workers), no Mooncake server
    any of its processes started still running, and (EngineCore in the driver's process) no store job and no
    load pin held by the scheduler-side connector after shutdown."""
    assert not res["stragglers"], f"engine processes left after exit: {res['stragglers']} (log {res['log']})"
    servers = {s["pid"]: s["cmdline"] for when in ("startup", "end") for s in res["engine_mooncake"][when]}
    left = [f"{pid}: {cmd}" for pid, cmd in servers.items() if alive(pid)]
    assert not left, f"Mooncake servers started by the engine still run after it exited: {left}"
    after = res["engine_after_shutdown"]
    if after is not None:
        assert not after.get("pinned_jobs") and after.get("load_pins", 0) == 0, f"pins after shutdown: {after}"
        assert after.get("jobs_opened") == after.get("jobs_released"), after


def master_capacity(mc: EmbeddedMooncake) -> int:
    """Bytes of client segments mounted on the master (its metrics endpoint): 0 right after a restart, until
    the clients notice (failed pings) and remount."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mc.metrics_port}/metrics", timeout=2) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
    return 0


def wait_remounted(mc: EmbeddedMooncake, timeout_s: float = 30.0) -> str:
    """After a master restart: wait until the engine's segments are mounted on the new master, then for a
    store client's unhealthy backoff to pass (a call that failed just before the remount can hold it)."""
    t0 = time.monotonic()
    while (cap := master_capacity(mc)) == 0 and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
    note = f"segments remounted on the new master after {time.monotonic() - t0:.1f}s ({cap} bytes)"
    time.sleep(3.0)  # rpc_timeout_ms 2 s + unhealthy_backoff_ms 1 s
    return note


def check_one_embedded_master(res: dict[str, Any], runtime_dir: Path) -> None:
    """The embedded default across an engine's processes (TP 2, EngineCore in its own process): one master
    for all of them, started by one rank's connector, the others attached through the rendezvous file in
    `runtime_dir`; after shutdown no server, no engine process and no rendezvous file is left."""
    rt = runtime_dir
    # every rank's store joined one master; one rank started it, the other attached
    stores = [w["connector"]["store"] for w in res["workers"]]
    assert len({(s["master_server_address"], s["metadata_server"]) for s in stores}) == 1, stores
    master, metadata = stores[0]["master_server_address"], stores[0]["metadata_server"]
    owners = [s for s in stores if s["embedded"] == "owner"]
    assert len(owners) == 1 and all(s["embedded"] == "attached" for s in stores if s not in owners), stores
    owner = int(owners[0]["owner_pid"])
    assert all(int(s["owner_pid"]) == owner for s in stores), stores
    # the rendezvous file the engine published names that master and that owner
    for when in ("startup", "end"):
        files = res["rendezvous"][when]
        assert [(f["pid"], f["master_address"], f["metadata_server"]) for f in files] == [(owner, master, metadata)], \
            f"{when}: rendezvous files {files}"
    # the engine's processes started exactly one master, a child of the owner, and no metadata server: the
    # clients use Mooncake's peer-to-peer handshake (nothing another local user could redirect)
    assert metadata == "P2PHANDSHAKE", stores
    port = int(master.rsplit(":", 1)[1])
    for when in ("startup", "end"):
        servers = res["engine_mooncake"][when]
        kinds = sorted("master" if "mooncake_master" in s["cmdline"] else "metadata" for s in servers)
        assert kinds == ["master"] and {s["ppid"] for s in servers} == {owner}, f"{when}: {servers}"
        assert any(f"--rpc_port={port}" in s["cmdline"] for s in servers), servers
    # EngineCore (the workers' parent) holds a connection to that master: its scheduler-side connector is a
    # client of it. (Its lookups also found the keys only the workers wrote: pass 2's store hits above.)
    procs = {p["pid"]: p for p in res["session"]}
    worker_pids = {w["pid"] for w in res["workers"]}
    core = {procs[p]["ppid"] for p in worker_pids}
    assert len(core) == 1 and (core_pid := core.pop()) != res["driver_pid"], f"EngineCore not found: {procs}"
    assert port in procs[core_pid]["peer_ports"], f"EngineCore {core_pid} is not connected to {master}: {procs[core_pid]}"
    for p in worker_pids:
        assert port in procs[p]["peer_ports"], f"worker {p} is not connected to {master}: {procs[p]}"

    # after shutdown: nothing of it left
    check_nothing_left(res)
    assert not port_accepts(port), "the embedded master still listens"
    left = processes_matching("mooncake_master", f"--rpc_port={port}")
    assert not left, f"embedded servers left after shutdown: {left}"
    assert sorted(p.name for p in rt.iterdir() if p.name.startswith("embedded-")) == [], \
        f"rendezvous file left in {rt}: {list(rt.iterdir())}"
