"""A store that dies mid-run: the engine's step time and completions through vLLM 0.32's real Scheduler, no
connector vs ours, same harness, same run. Same-run ratios only, nothing asserted.

testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, two emulated TP ranks, KV caches from
vLLM's allocator, a 48-block pool, kv_load_failure_policy "recompute"): 120 shared-prefix prompts, each
asked twice (240 requests, 8 tokens generated). Ours runs on a private Mooncake master that is SIGKILLed
after step 60 and never restarted; the master-down backoff is measured at two caps:

  none         no kv_transfer_config (the baseline)
  ours-1s      `max_unhealthy_backoff_ms` 1000: every master failure skips the store for 1 s (a fixed backoff)
  ours-30s     the default 30,000: each failure in a row doubles the skip, 1 s up to 30 s

Each way runs `--repeat` times (default 3). Per run: requests finished and with the model's output, engine
steps, wall time, ms per step after the kill, store calls still inside the client at the end of the run's
window, save pins at the end, wrong KV (S7). A run is cut at `--window` seconds (default 200): a store call
that does not return holds its pins and its blocks until it does.

    python -m bench.outage [--repeat N] [--window S]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

KILL_AT_STEP = 60
WAYS: dict[str, int | None] = {"none": None, "ours-1s": 1000, "ours-30s": 30_000}


@dataclass
class Run:
    way: str
    finished: int
    right: int
    steps: int
    wall_s: float
    ms_per_step_after: float
    calls_inside: int
    pinned_jobs: int
    wrong_kv: int


def run_once(way: str, max_backoff_ms: int | None, window_s: float) -> Run:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.embedded import EmbeddedMooncake
    from testbed.emu_model import expected_output, shared_prefix_prompts
    from testbed.harness import Harness

    prompts = shared_prefix_prompts(120, num_prefixes=12, prefix_len=64, suffix_len=16, seed=3) * 2
    with EmbeddedMooncake(rpc_timeout_ms=2000) as mc:
        cfg = StoreConfig(global_segment_size=64 << 20, rpc_timeout_ms=2000,
                          max_unhealthy_backoff_ms=max_backoff_ms or 30_000).with_addresses(
                              mc.master_address, mc.metadata_server)
        h = Harness(cfg, tp_size=2, num_blocks=48, policy="recompute", stall_timeout_s=window_s + 60,
                    connector="none" if max_backoff_ms is None else "ours")
        try:
            for i, p in enumerate(prompts):
                h.add_request(f"r-{i}", p, 8)
            t0 = time.monotonic()
            steps, killed_at = 0, None
            while time.monotonic() - t0 < window_s:
                if steps == KILL_AT_STEP and max_backoff_ms is not None:
                    mc.kill_master()
                    killed_at = time.monotonic()
                if not h.step():
                    break
                steps += 1
            wall = time.monotonic() - t0
            after = wall - (killed_at - t0) if killed_at else wall
            ids = [f"r-{i}" for i in range(len(prompts))]
            done = [i for i, r in enumerate(ids) if r in h.stats.finished]
            right = sum(h.stats.outputs[ids[i]] == expected_output(prompts[i], 8) for i in done)
            inside = sum(w.store.calls_inside for w in h.workers) if max_backoff_ms is not None else 0
            return Run(way, len(done), right, steps, wall,
                       1000 * after / max(1, steps - (KILL_AT_STEP if killed_at else 0)), inside,
                       h._num_pinned_jobs(), len(h.garbage))
        finally:
            h.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window", type=float, default=200.0)
    args = ap.parse_args(argv)
    runs: dict[str, list[Run]] = {w: [] for w in WAYS}
    for k in range(args.repeat):
        for way, cap in WAYS.items():
            r = run_once(way, cap, args.window)
            runs[way].append(r)
            print(f"[outage] {way:9s} run {k + 1}: {r.finished}/240 finished ({r.right} right), {r.steps} steps, "
                  f"{r.wall_s:.1f} s, {r.ms_per_step_after:.1f} ms/step after the kill, calls inside "
                  f"{r.calls_inside}, save pins {r.pinned_jobs}, wrong KV {r.wrong_kv}", flush=True)
    base = statistics.median(r.wall_s for r in runs["none"])
    print("\nway        finished(min)  wall s median (max)  steps median (max)  wall vs none (median)")
    for way, rs in runs.items():
        wall = statistics.median(r.wall_s for r in rs)
        print(f"{way:9s}  {min(r.finished for r in rs):>13d}  {wall:8.1f} ({max(r.wall_s for r in rs):6.1f})  "
              f"{statistics.median(r.steps for r in rs):8.0f} ({max(r.steps for r in rs):6d})  {wall / base:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
