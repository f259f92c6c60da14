"""`make demo`: the main workload through vLLM 0.32's REAL engine, on the embedded default.

`LLM` -> EngineCore in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1) -> multiproc executor with 2
worker processes (TP=2, gloo), the model replaced by the emulating worker (testbed/emu_worker.py: it
writes the emulated model's KV into vLLM's real KV cache and checks every KV it reads against what the
model would have written). The kv-transfer-config is what a user pastes plus a trace log and pin caps:
kv_connector, kv_connector_module_path, kv_role, kv_load_failure_policy="recompute", and
kv_connector_extra_config = {trace_path, max_inflight_jobs, max_pinned_blocks}: no master address, so the
engine's first connector starts a private Mooncake master + metadata server and the others attach.

Workload: requests with shared prefixes, a block pool far smaller than the working set (vLLM preempts),
two passes over the same prompts with the same request ids, reset_prefix_cache() between them (pass 2
starts from an empty local cache: its prefix hits are the store's). With faults on (default), every rank's
store is wrapped in testbed.faults.FaultyStore (a FAULT-INJECTION TEST DOUBLE, `FaultyEmuWorker`) that
evicts a few keys between lookup and load, so vLLM's load-failure recovery runs too.

The engine runs in a subprocess (testbed/engine_run.py, its own session, killed by group on timeout);
this prints its progress, then the report, then TLC's verdict on the run's trace log
(`python -m conformance.runlog LOG --pin-cap N`, run as a program; the whole log is checked).
Exit 1 when any check fails.

    python -m testbed.engine_demo [--requests 48] [--blocks 32] [--max-tokens 24] [--no-faults]
                                  [--trace PATH | --no-trace] [--timeout 300]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testbed.procs import alive, kill_group

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "ENGINE_RUN_RESULT "  # testbed.engine_run's (not imported: it would load vLLM here)
PROGRESS_PREFIX = "ENGINE_RUN_PROGRESS "
BLOCK_SIZE = 16
CAP_JOBS, CAP_BLOCKS = 4, 16  # tight pin caps (max_inflight_jobs, max_pinned_blocks)


def run_engine(spec: dict[str, Any], *, env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any] | None:
    """Runs testbed.engine_run; echoes its progress lines; the rest of its output goes to `log`."""
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-m", "testbed.engine_run", json.dumps(spec)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            text=True, bufsize=1)
    result = None
    deadline = time.monotonic() + timeout_s
    tty = sys.stdout.isatty()
    with open(log, "w") as out:
        import threading
        timer = threading.Timer(timeout_s, kill_group, args=(proc.pid,), kwargs={"grace_s": 5.0})
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    msg = line[len(PROGRESS_PREFIX):].strip()  # "pass <n>: <done>/<total> requests" (n from 0)
                    head, tail = msg.split(": ", 1)
                    done, total = (int(x) for x in tail.split()[0].split("/"))
                    shown = f"pass {int(head.split()[1]) + 1}: {done}/{total} requests done"
                    if tty:  # one line rewritten in place
                        print(f"\r  {shown}", end="\n" if done == total else "", flush=True)
                    elif done == total or done % max(1, total // 4) == 0:
                        print(f"  {shown}", flush=True)
                elif line.startswith(RESULT_PREFIX):
                    result = json.loads(line[len(RESULT_PREFIX):])
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None or time.monotonic() > deadline:
                kill_group(proc.pid, grace_s=5.0, done=lambda: proc.poll() is not None)
    if proc.returncode != 0:
        print(f"\nengine exited {proc.returncode}; log {log}:\n" +
              "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per pass")
    ap.add_argument("--blocks", type=int, default=32, help="KV blocks in vLLM's pool (block size 16)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--no-faults", action="store_true", help="no evictions injected between lookup and load")
    ap.add_argument("--trace", default=".tlc-out/traces/engine-demo.ndjson",
                    help="the connector's trace log, checked with TLC afterwards")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--timeout", type=float, default=300, help="hard bound on the engine's run (s)")
    args = ap.parse_args(argv)
    trace = None if args.no_trace else os.path.abspath(args.trace)
    if trace:
        os.makedirs(os.path.dirname(trace), exist_ok=True)
        if os.path.exists(trace):
            os.remove(trace)  # the connector appends: one run per log

    from testbed.emu_model import expected_output, shared_prefix_prompts

    t0 = time.monotonic()
    prompts = shared_prefix_prompts(args.requests, num_prefixes=6, prefix_len=48, suffix_len=16, seed=2026)
    max_model_len = BLOCK_SIZE * CAP_BLOCKS // 2  # 128: the longest request fits the pin cap
    extra: dict[str, Any] = {"max_inflight_jobs": CAP_JOBS, "max_pinned_blocks": CAP_BLOCKS}
    if trace:
        extra["trace_path"] = trace
    work = Path(tempfile.mkdtemp(prefix="kvledger-engine-demo-"))
    runtime = work / "runtime"  # the embedded rendezvous files: private to this run
    runtime.mkdir(mode=0o700)
    spec = {"workdir": str(work), "prompts": prompts, "max_tokens": args.max_tokens, "passes": 2,
            "tp": 2, "mp": 1, "backend": "mp", "num_blocks": args.blocks, "block_size": BLOCK_SIZE,
            "max_model_len": max_model_len, "max_num_seqs": 8, "max_num_batched_tokens": 128,
            "connector": {"policy": "recompute", "role": "kv_both", "extra": extra},
            "worker_cls": "testbed.emu_worker.EmuWorker" if args.no_faults else "testbed.emu_worker.FaultyEmuWorker",
            "request_ids": "fixed", "progress": True, "stall_timeout_s": 45, "reset_between_passes": True,
            "settle_timeout_s": 60,
            "shutdown_timeout_s": 30}
    env = {"KVLEDGER_RUNTIME_DIR": str(runtime), "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "GLOG_minloglevel": "2"}
    if not args.no_faults:
        env["EMU_FAULT_PLAN"] = json.dumps({"seed": 7, "rules": [{"op": "get", "action": "evict",
                                                                   "probability": 0.03}]})
    log = work / "engine.log"
    print(f"kvledger engine demo: {args.requests} requests x 2 passes, TP=2 (mp executor, EngineCore in its own "
          f"process), {args.blocks}-block pool; starting vLLM (about 30 s) ...", flush=True)
    res = run_engine(spec, env=env, log=log, timeout_s=args.timeout)
    if res is None:
        print("FAILED")
        return 1
    wall = time.monotonic() - t0
    want = [expected_output(p, args.max_tokens) for p in prompts]
    bad_outputs = sum(o != w for ps in res["passes"] for o, w in zip(ps["outputs"], want))
    bad_finish = sum(r != "length" for ps in res["passes"] for r in ps["finish_reasons"])
    workers = res["workers"]
    wrong_kv = sum(w["wrong_kv"] for w in workers)
    conns = [w["connector"] or {} for w in workers]
    errors = [e for c in conns for e in c.get("errors", [])]
    failed_blocks = sum(c.get("num_load_blocks_failed") or 0 for c in conns)
    injected = sum(c.get("faults_injected") or 0 for c in conns)
    loads = [c.get("num_loads") or 0 for c in conns]
    m = res["metrics"]
    m1 = res["passes"][0]["metrics"]
    ext_hits = int(m.get("external_prefix_cache_hits", 0))
    ext_hits_p2 = ext_hits - int(m1.get("external_prefix_cache_hits", 0))
    preempt = int(m.get("num_preemptions", 0))
    worker_preempt = [w["counts"].get("preemptions", 0) for w in workers]
    resets_ok = all(ps["reset"]["done"] for ps in res["passes"][1:])
    at_rest = bool(res["at_rest"]["done"])
    log_text = log.read_text(errors="replace")
    recovered_mark = "Recovered from KV load failure" in log_text
    servers = {s["pid"]: s["cmdline"] for when in ("startup", "end") for s in res["engine_mooncake"][when]}
    servers_left = [p for p in servers if alive(p)]
    rendezvous_left = [p.name for p in runtime.iterdir() if p.name.startswith("embedded-")]
    stores = {(c.get("store") or {}).get("master_server_address") for c in conns}
    rows = [
        ("requests", f"{2 * len(prompts)} ({len(prompts)} per pass, request ids reused), TP=2, "
                     f"{res['passes'][0]['seconds']} s + {res['passes'][1]['seconds']} s"),
        ("preemptions", f"{preempt} (vLLM's counter; ranks saw {worker_preempt})"),
        ("store hits", f"pass 2: {ext_hits_p2} prompt tokens loaded from the store (vLLM's external prefix-cache "
                       f"hits; {ext_hits} over both passes), loads per rank {loads}"),
        ("failed loads", f"{failed_blocks} blocks reported by the ranks "
                         f"({injected} evictions injected{', none: --no-faults' if args.no_faults else ''}), "
                         + ("recomputed by vLLM, outputs right" if failed_blocks and recovered_mark and not bad_outputs
                            else "none to recover" if not failed_blocks else "NOT RECOVERED")),
        ("wrong KV", f"{wrong_kv} (every rank checks the KV it reads; per rank "
                     f"{[w['wrong_kv'] for w in workers]}), {bad_outputs} wrong outputs"),
        ("leaked blocks", "0 (reset_prefix_cache() succeeded at the end)" if at_rest
         else f"blocks still held: {res['at_rest']}"),
        ("polluted keys", "not checked here (the embedded store stops with the engine; the ranks' wrong-KV "
                          "check covers every key that was loaded)"),
        ("embedded store", f"master {', '.join(sorted(s for s in stores if s))}; after exit: "
                           f"{len(servers_left)} servers, {len(rendezvous_left)} rendezvous files left"),
        ("engine", f"start-up {res['startup_s']} s, shutdown {res['shutdown_s']} s"),
        ("wall time", f"{wall:.1f} s"),
    ]
    print()
    print("kvledger demo: vLLM 0.32.0 real engine (LLM -> EngineCore -> 2 workers) + KVLedgerConnector + "
          "embedded Mooncake")
    for name, value in rows:
        print(f"  {name:<16} {value}")
    ok = (bad_outputs == 0 and bad_finish == 0 and wrong_kv == 0 and not errors and at_rest and resets_ok
          and ext_hits_p2 > 0 and (not failed_blocks or recovered_mark) and not servers_left
          and not rendezvous_left)
    if errors:
        print(f"  {'handler errors':<16} {errors[:3]}")
    if trace:
        cmd = [sys.executable, "-m", "conformance.runlog", trace, "--pin-cap", str(CAP_JOBS)]
        if not at_rest:
            cmd.append("--no-rest")
        n_events = sum(1 for _ in open(trace)) if os.path.exists(trace) else 0
        t1 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        verdict = next((ln for ln in r.stdout.splitlines() if ln.startswith(("ACCEPTED", "REJECTED", "ERROR"))),
                       f"no verdict (exit {r.returncode}): {(r.stdout + r.stderr).strip()[-300:]}")
        print(f"  {'trace log':<16} {n_events} events (whole log) -> TLC: {verdict} "
              f"({time.monotonic() - t1:.0f} s)")
        ok = ok and r.returncode == 0
    print(f"  {'engine log':<16} {log}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
