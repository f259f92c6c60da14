"""A store that dies or freezes mid-run: the engine's step time and completions through vLLM 0.32's real
Scheduler, no connector vs ours, same harness, same run. Same-run ratios only, nothing asserted.

testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, two emulated TP ranks, KV caches from
vLLM's allocator, a 48-block pool, kv_load_failure_policy "recompute", the stand-in forward taking FORWARD_S
= 4 ms per step as in bench.scheduler, a stand-in for the model's time): 120 shared-prefix prompts, each
asked twice (240 requests, 8 tokens generated), on a private Mooncake master. After step 60 the master is

  kill         SIGKILLed and never restarted
  stop         SIGSTOPped (it accepts connections and never answers) for `--stop-s` seconds (default 30)
               or until the run ends, then continued

and the ways are

  none         no kv_transfer_config (the baseline: the same steps without a store)
  ours         the connector's defaults: the store's breaker (opened by the first master failure, closed by
               its own prober, `unhealthy_backoff_ms` 1 s doubling up to 30 s) and the scheduler's call
               deadline (`lookup_timeout_ms` 200)

Each (fault, way) runs `--repeat` times (default 3). Per run: requests finished and with the model's output,
engine steps, wall time, the mean and the longest step after the fault (ms), store calls still inside the
client at the end, save pins at the end, wrong KV (S7), and for ours the breaker trips and the lookups past
their deadline. The ratio printed is ours' mean step after the fault over none's mean step after step 60
(the issue's target: within 1.2x). A run is cut at `--window` seconds (default 200): a store call that
does not return holds its pins and its blocks until it does.

    python -m bench.outage [--repeat N] [--window S] [--stop-s S] [--faults kill stop]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

FAULT_AT_STEP = 60
FORWARD_S = 0.004  # the stand-in forward's time per step (bench.scheduler's)
WAYS = ("none", "ours")
FAULTS = ("kill", "stop")


@dataclass
class Run:
    fault: str
    way: str
    finished: int
    right: int
    steps: int
    wall_s: float
    ms_per_step_after: float
    max_step_ms_after: float
    calls_inside: int
    pinned_jobs: int
    wrong_kv: int
    trips: int
    deadline_missed: int


def run_once(fault: str, way: str, window_s: float, stop_s: float) -> Run:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.emu_model import expected_output, shared_prefix_prompts
    from testbed.harness import Harness

    prompts = shared_prefix_prompts(120, num_prefixes=12, prefix_len=64, suffix_len=16, seed=3) * 2
    ours = way == "ours"
    with EmbeddedMooncake(rpc_timeout_ms=2000) as mc:
        cfg = StoreConfig(global_segment_size=64 << 20, rpc_timeout_ms=2000).with_addresses(
            mc.master_address, mc.metadata_server)
        h = Harness(cfg, tp_size=2, num_blocks=48, policy="recompute", stall_timeout_s=window_s + 60,
                    connector="ours" if ours else "none", forward_s=FORWARD_S)
        frozen: int | None = None
        try:
            for i, p in enumerate(prompts):
                h.add_request(f"r-{i}", p, 8)
            t0 = time.monotonic()
            steps, fault_at = 0, None
            after: list[float] = []
            while time.monotonic() - t0 < window_s:
                if steps == FAULT_AT_STEP:
                    fault_at = time.monotonic()
                    if ours and fault == "kill":
                        mc.kill_master()
                    elif ours:
                        frozen = mc.master_pid
                        os.kill(frozen, signal.SIGSTOP)  # type: ignore[arg-type]
                if frozen is not None and fault_at is not None and time.monotonic() - fault_at >= stop_s:
                    os.kill(frozen, signal.SIGCONT)
                    frozen = None
                ts = time.monotonic()
                if not h.step():
                    break
                if fault_at is not None:
                    after.append(time.monotonic() - ts)
                steps += 1
            wall = time.monotonic() - t0
            ids = [f"r-{i}" for i in range(len(prompts))]
            done = [i for i, r in enumerate(ids) if r in h.stats.finished]
            right = sum(h.stats.outputs[ids[i]] == expected_output(prompts[i], 8) for i in done)
            inside = sum(w.store.calls_inside for w in h.workers) if ours else 0
            stores = [h.scheduler_connector.store, *(w.store for w in h.workers)] if ours else []
            return Run(fault, way, len(done), right, steps, wall,
                       1000 * statistics.mean(after) if after else 0.0, 1000 * max(after, default=0.0), inside,
                       h._num_pinned_jobs(), len(h.garbage), sum(s.stats.total("breaker_trips") for s in stores),
                       h.scheduler_connector.stats.total("lookups_past_deadline") if ours else 0)
        finally:
            if frozen is not None:
                os.kill(frozen, signal.SIGCONT)
            h.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window", type=float, default=200.0)
    ap.add_argument("--stop-s", type=float, default=30.0)
    ap.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    args = ap.parse_args(argv)
    for fault in args.faults:
        runs: dict[str, list[Run]] = {w: [] for w in WAYS}
        for k in range(args.repeat):
            for way in (WAYS if k % 2 == 0 else WAYS[::-1]):  # alternate: drift spreads over the ways
                r = run_once(fault, way, args.window, args.stop_s)
                runs[way].append(r)
                print(f"[outage] {fault} {way:5s} run {k + 1}: {r.finished}/240 finished ({r.right} right), "
                      f"{r.steps} steps, {r.wall_s:.1f} s, after the fault {r.ms_per_step_after:.1f} ms/step "
                      f"(longest {r.max_step_ms_after:.0f} ms), calls inside {r.calls_inside}, save pins "
                      f"{r.pinned_jobs}, wrong KV {r.wrong_kv}, breaker trips {r.trips}, lookups past their "
                      f"deadline {r.deadline_missed}", flush=True)
        base = statistics.median(r.ms_per_step_after for r in runs["none"])
        print(f"\n{fault}: way   finished(min)  wall s median (max)  steps median (max)  ms/step after, median "
              f"(longest step)  vs none")
        for way, rs in runs.items():
            ms = statistics.median(r.ms_per_step_after for r in rs)
            print(f"{way:5s}  {min(r.finished for r in rs):>13d}  {statistics.median(r.wall_s for r in rs):8.1f} "
                  f"({max(r.wall_s for r in rs):6.1f})  {statistics.median(r.steps for r in rs):8.0f} "
                  f"({max(r.steps for r in rs):6d})  {ms:8.2f} ({max(r.max_step_ms_after for r in rs):6.0f})  "
                  f"{ms / base:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
