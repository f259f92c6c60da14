"""Connector overhead in vLLM 0.32's real engine. Same-run ratios only, nothing asserted.

The same workload (shared-prefix prompts, 2 passes, reset_prefix_cache() between them: pass 1 saves,
pass 2 loads from the store; each pass its own request ids, see below) and the same stand-in model worker
(testbed/emu_worker.py: it writes and checks KV in vLLM's real KV cache) go through the real engine
(`LLM` -> in-process EngineCore -> uni executor, TP=1, CPU) three ways in one run:

  none      no kv_transfer_config
  ours      KVLedgerConnector (kvledger_connector.connector) on the bench's Mooncake master
  upstream  vLLM 0.32's own MooncakeStoreConnector, configured as its docs say (MOONCAKE_CONFIG_PATH file
            with metadata_server, master_server_address, protocol "tcp", device_name "",
            global_segment_size, local_buffer_size) on the same master. Test double in its subprocess only:
            upstream's worker orders saves with ``torch.cuda.Event``, which a CPU-only torch cannot create,
            so testbed/cuda_event_stub.py replaces it there with a no-op event (record, wait, synchronize do
            nothing: on CPU there is no stream to order, the forward has written the KV when
            wait_for_save runs). Without it upstream cannot run on CPU

Both connectors use one EmbeddedMooncake (kvledger_connector.store.embedded) that the bench starts on 127.0.0.1. Each
engine runs in its own subprocess (testbed/engine_run.py with `request_ids: "per_pass"` and `step_times`):
every `llm_engine.step()` is timed (with mp=0 that is the whole EngineCore step: schedule, the connector's
scheduler hooks, the worker's execute_model with the connector's worker hooks, output processing). The
table shows per pass the number of steps, the mean and median step time, the sum of the step times and
the pass's wall time; the ratios are ours/none and ours/upstream of the mean step time (target: ours <=
upstream) and of the sum (a pass waiting for loads takes more, shorter steps, which lowers its mean).
Rounds run the three in a rotating order; a cell is the median over rounds.

Request ids: pass n adds "p<n>-req-<i>", so no id is seen twice (as with vLLM's own randomized ids).
With ids reused across passes ("req-<i>" each pass) upstream's run hangs in pass 2 in about half the
runs: when reset_prefix_cache() succeeds without a step, pass 1's last finish notices reach
MooncakeStoreScheduler.build_connector_meta in the step that admits pass 2's requests of the same ids,
and it drops those requests' pending loads (load_specs, _unfinished_requests), so they wait in
WAITING_FOR_REMOTE_KVS forever. Ours handles that reuse (tests cover it); the bench compares step
times, so every way gets fresh ids.

    python -m bench.engine [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "ENGINE_RUN_RESULT "
WAYS = ("none", "ours", "upstream")


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 1000) for _ in range(64)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(10, 1000) for _ in range(16)] for i in range(n)]


def _spec(workdir: Path, prompts: list[list[int]], connector: dict[str, Any] | None) -> dict[str, Any]:
    return {"workdir": str(workdir), "prompts": prompts, "max_tokens": 16, "passes": 2, "tp": 1, "mp": 0,
            "backend": "uni", "num_blocks": 128, "block_size": 16, "max_model_len": 256, "max_num_seqs": 8,
            "max_num_batched_tokens": 256, "num_layers": 2, "num_kv_heads": 2, "head_size": 8,
            "connector": connector, "request_ids": "per_pass", "step_times": True, "stall_timeout_s": 30,
            "reset_between_passes": True,
            "settle_timeout_s": 60}


def run_engine(spec: dict[str, Any], env: dict[str, str], log: Path, timeout_s: float = 240) -> dict[str, Any]:
    """testbed/engine_run.py in a subprocess of its own session (killed whole past `timeout_s`): its result."""
    full_env = {**os.environ, **env, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                "GLOG_minloglevel": "2"}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    spec_file = log.with_name(log.name + ".spec.json")  # a file: a long prompt list exceeds one argument's limit
    spec_file.write_text(json.dumps(spec))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "testbed.engine_run", str(spec_file)], cwd=ROOT,
                                env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"engine still running after {timeout_s}s (killed); log {log}")
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
    if rc != 0 or not lines:
        errs = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        raise RuntimeError(f"engine exited {rc}: {(errs or text.splitlines() or [''])[-1][:400]} (log {log})")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def _check(way: str, res: dict[str, Any]) -> str | None:
    """The run did what it should (else its timings mean nothing): no wrong KV, pass 2 hit the store."""
    bad = [w["wrong_kv"] for w in res["workers"] if w["wrong_kv"]]
    if bad:
        return f"wrong KV {bad}"
    if way != "none" and not res["metrics"].get("external_prefix_cache_hits", 0):
        return "pass 2 loaded nothing from the store"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, fewer requests")
    args = ap.parse_args([] if argv is None else argv)
    rounds, n = (1, 16) if args.quick else (2, 32)
    prompts = _prompts(n)

    from kvledger_connector.store.embedded import EmbeddedMooncake
    mc = EmbeddedMooncake(rpc_timeout_ms=5000)
    work = Path(tempfile.mkdtemp(prefix="kvledger-bench-engine-"))
    cfg = work / "mooncake.json"  # upstream's MooncakeStoreConfig.from_file
    cfg.write_text(json.dumps({"metadata_server": mc.metadata_server, "master_server_address": mc.master_address,
                               "protocol": "tcp", "device_name": "", "global_segment_size": "64MB",
                               "local_buffer_size": "16MB"}))
    connectors: dict[str, tuple[dict[str, Any] | None, dict[str, str]]] = {
        "none": (None, {}),
        "ours": ({"policy": "recompute", "extra": {"master_server_address": mc.master_address,
                                                   "metadata_server": mc.metadata_server,
                                                   "global_segment_size": "64MB", "local_buffer_size": "16MB"}}, {}),
        "upstream": ({"name": "MooncakeStoreConnector", "module_path": None, "policy": "recompute", "extra": {}},
                     {"MOONCAKE_CONFIG_PATH": str(cfg)}),
    }
    preload = {"upstream": ["testbed.cuda_event_stub:install"]}  # the test double, upstream's subprocess only
    results: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    failed: dict[str, str] = {}
    try:
        for r in range(rounds):
            order = WAYS[r % 3:] + WAYS[:r % 3]
            for way in order:
                if way in failed:
                    continue
                conn, env = connectors[way]
                # a fresh model dir per run: the model path is part of every key, so no run reads another's
                wd = work / f"{way}-{r}"
                t = time.monotonic()
                try:
                    spec = {**_spec(wd, prompts, conn), "preload": preload.get(way, [])}
                    res = run_engine(spec, env, work / f"{way}-{r}.log")
                except RuntimeError as e:
                    failed[way] = str(e)
                    print(f"[bench.engine] {way}: not run: {e}", flush=True)
                    continue
                if (why := _check(way, res)) is not None:
                    failed[way] = why
                    print(f"[bench.engine] {way}: run discarded: {why}", flush=True)
                    continue
                results[way].append(res)
                print(f"[bench.engine] round {r + 1}/{rounds} {way}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        mc.stop()

    def cell(way: str, pass_no: int, key: str) -> float | None:
        vals = []
        for res in results[way]:
            ps = res["passes"][pass_no]
            vals.append({"steps": ps.get("steps", 0), "mean": ps["step_s"]["mean"] * 1e3,
                         "median": ps["step_s"]["median"] * 1e3, "sum": ps["step_s"]["sum"] * 1e3,
                         "wall": ps["seconds"],
                         "hits": ps["metrics"].get("external_prefix_cache_hits", 0)}[key])
        return statistics.median(vals) if vals else None

    def fmt(v: float | None, spec: str) -> str:
        return f"{'n/a':>{int(spec.split('.')[0].rstrip('f'))}}" if v is None else format(v, spec)

    print(f"\nreal engine (LLM -> EngineCore in-process -> uni executor, TP=1, CPU, stand-in worker), "
          f"{n} requests x 2 passes (pass 1 saves, pass 2 loads), {rounds} round(s), median over rounds")
    for res in results["upstream"][:1]:
        doubles = "; ".join(str(v) for v in res.get("preloaded", {}).values())
        print(f"upstream's subprocess: {doubles or 'no test double'}")
    print(f"{'way':<9} {'pass':<5} {'steps':>6} {'mean step ms':>13} {'median step ms':>15} {'steps sum ms':>13} "
          f"{'pass s':>7} {'store hit tok':>14}")
    for way in WAYS:
        for p in (0, 1):
            print(f"{way:<9} {p + 1:<5} {fmt(cell(way, p, 'steps'), '6.0f')} {fmt(cell(way, p, 'mean'), '13.3f')} "
                  f"{fmt(cell(way, p, 'median'), '15.3f')} {fmt(cell(way, p, 'sum'), '13.1f')} "
                  f"{fmt(cell(way, p, 'wall'), '7.2f')} {fmt(cell(way, p, 'hits'), '14.0f')}")
    for p in (0, 1):
        for key, what in (("mean", "mean step time"), ("sum", "sum of step times")):
            ours = cell("ours", p, key)
            parts = []
            for other in ("none", "upstream"):
                o = cell(other, p, key)
                parts.append(f"ours/{other} {ours / o:.2f}" if ours and o else f"ours/{other} n/a")
            print(f"pass {p + 1} {what}: " + ", ".join(parts) + ("  (target ours/upstream <= 1.0)" if key == "mean"
                                                                 else ""))
    print("(a pass that waits for loads takes more, shorter steps: the sum compares the pass's engine time)")
    for way, why in failed.items():
        print(f"{way}: {why}")
    return 1 if "ours" in failed or "none" in failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
