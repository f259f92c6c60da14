"""`make demo`: the main workload on the embedded default.

A few hundred requests with shared prefixes go through vLLM 0.32.0's real Scheduler (CPU, no weights) with
a block pool far smaller than the working set (preemption storms), our connector and a real Mooncake store
that the connector starts itself (no store configured: private master + metadata server on 127.0.0.1).
Then a second pass over the same prompts, with the same req_ids, hits the store; a few keys are evicted
between lookup and load (FaultyStore, seeded) so the load-failure recovery is exercised too
(`--no-faults` turns that off). The driver is testbed/harness.py.

The run's NDJSON log (connector `trace_path`; `--trace PATH`, default .tlc-out/traces/make-demo.ndjson,
`--no-trace` to skip) is then checked by TLC against the model's job lifecycle (conformance.runlog,
tla/TraceRuntime.tla): the default run's ~7,900 events in about 35 s here. `make verify` runs the same.

Exit status 1 if any key holds KV that is not its own, any block leaked, any request computed on wrong KV,
produced a wrong output, or the log is not a behaviour of the model.

    python -m testbed.demo [--requests 240] [--blocks 48] [--tp 2] [--no-faults] [--trace PATH | --no-trace]
                           [--result-json PATH]

`run()` returns the figures as a `DemoResult`; `--result-json` writes it (`make verify` runs the demo as a
child process and reads its figures from there, not from the printed table).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's C++ logs: errors only


@dataclass(frozen=True)
class DemoResult:
    """What one demo run found: the verdict, the figures, the printed table and the log's TLC verdict."""

    ok: bool
    requests: int  # per pass (each pass adds every prompt again, with the same req_ids)
    tp: int
    cap_jobs: int  # the connector's max_inflight_jobs: the log check's pin cap
    figures: dict[str, int | float]
    rows: tuple[tuple[str, str], ...]  # the printed table, (name, value)
    trace_path: str | None  # the NDJSON log (None: --no-trace)
    trace_accepted: bool | None  # None when no log was checked
    trace_verdict: str | None  # the checker's one line (ACCEPTED/REJECTED/ERROR ...)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DemoResult":
        d = json.loads(text)
        missing = [f for f in cls.__dataclass_fields__ if f not in d]
        if missing:
            raise ValueError(f"demo result: field {missing[0]!r} is missing (fields given: {sorted(d)})")
        d["rows"] = tuple((str(n), str(v)) for n, v in d["rows"])
        return cls(**d)


def main(argv: list[str] | None = None) -> int:
    return 0 if run(argv).ok else 1


def run(argv: list[str] | None = None) -> DemoResult:
    """Run the demo as `python -m testbed.demo ARGV` does (printing its table) and return its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--blocks", type=int, default=48, help="GPU blocks in vLLM's pool (block size 16)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (in-process workers)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--trace", default=".tlc-out/traces/make-demo.ndjson",
                    help="log the run here and check the log with TLC")
    ap.add_argument("--no-trace", action="store_true", help="do not log or check the run")
    ap.add_argument("--kv-layout", default="LBNHC", help="vLLM KVCacheLayout of the workers' KV caches")
    ap.add_argument("--result-json", type=Path, default=None, help="write the run's DemoResult here as JSON")
    args = ap.parse_args(argv)
    if args.no_trace:
        args.trace = None
    elif args.trace:
        os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
    logging.getLogger("vllm").setLevel(logging.ERROR)

    from tqdm import tqdm

    from kvledger_connector.config import StoreConfig
    from testbed.faults import FaultPlan, FaultRule, FaultyStore
    from testbed.harness import Harness, shared_prefix_prompts

    t0 = time.monotonic()
    prompts = shared_prefix_prompts(args.requests, num_prefixes=12, prefix_len=64, suffix_len=24, seed=2026)
    cfg = StoreConfig(global_segment_size=256 << 20, local_buffer_size=4 << 20)  # embedded: no master given
    cap_jobs, cap_blocks = 3, 24  # tight: the cap defers
    extra: dict[str, object] = {"max_inflight_jobs": cap_jobs, "max_pinned_blocks": cap_blocks}
    if args.trace:
        if os.path.exists(args.trace):
            os.remove(args.trace)  # the connector appends: one run per log
        extra["trace_path"] = args.trace
    bad_outputs = 0
    # the longest request must fit the pin cap (checked at start-up): 24 blocks of 16 = 384 tokens >= 88 + 24
    with Harness(cfg, tp_size=args.tp, num_blocks=args.blocks, max_num_seqs=16, max_num_batched_tokens=256,
                 policy="recompute", extra=extra, max_model_len=16 * cap_blocks, kv_layout=args.kv_layout) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        report: dict[str, object] = {}
        for pass_no in (1, 2):
            if pass_no == 2 and not args.no_faults:
                for r, w in enumerate(h.workers):
                    w.worker_side.io.store = FaultyStore(w.worker_side.io.store, FaultPlan(
                        [FaultRule("get", "evict", probability=0.03)], seed=7 + r))
            h.stats.outputs.clear()
            for i, p in enumerate(prompts):
                h.add_request(f"req-{i}", p, args.max_tokens)
            done_before = 0
            with tqdm(total=len(prompts), desc=f"pass {pass_no}", unit="req", file=sys.stdout) as bar:
                while h.step():
                    n = sum(1 for i in range(len(prompts)) if h.stats.outputs.get(f"req-{i}") is not None
                            and len(h.stats.outputs[f"req-{i}"]) >= args.max_tokens)
                    bar.update(n - done_before)
                    done_before = n
            for i, p in enumerate(prompts):
                if h.stats.outputs.get(f"req-{i}") != h.expected_output(p, args.max_tokens):
                    bad_outputs += 1
            report[f"pass{pass_no}_loads"] = ss.stats.total("loads_emitted")
        leaks = h.check_at_rest()
        checked, polluted = h.check_store()
        totals = h.scheduler_connector.stats.totals.data
        wtot: dict[str, float] = {}
        for w in h.workers:
            for k, v in w.stats.totals.data.items():
                wtot[k] = wtot.get(k, 0) + v
        leaked_blocks = args.blocks - 1 - h.block_pool.get_num_free_blocks()
        figures: dict[str, int | float] = {
            "requests": 2 * len(prompts), "engine_steps": h.stats.steps,
            "jobs_opened": ss.ledger.num_jobs_opened, "jobs_released": int(ss.ledger.counts.total("jobs_released")),
            "stale_jobs": int(wtot.get("stale_jobs", 0)), "put_keys": int(wtot.get("put_keys", 0)),
            "peak_jobs": ss.ledger.peak_inflight_jobs, "peak_block_pins": ss.ledger.peak_pinned_blocks,
            "preemptions": h.stats.preemptions, "deferrals": int(ss.stats.total("deferrals")),
            "saves_dropped": ss.stats.total("saves_dropped"), "loads": ss.stats.total("loads_emitted"),
            "load_error_blocks": h.stats.load_error_blocks, "wrong_kv": len(h.garbage),
            "wrong_outputs": bad_outputs, "polluted_keys": polluted, "checked_keys": checked,
            "leaked_blocks": leaked_blocks,
        }
        rows = [
            ("requests", f"{2 * len(prompts)} ({len(prompts)} per pass, req_ids reused), "
                         f"{h.stats.steps} engine steps, tp={args.tp}"),
            ("store jobs", f"{ss.ledger.num_jobs_opened} opened, "
                           f"{int(ss.ledger.counts.total('jobs_released'))} released, "
                           f"{int(wtot.get('stale_jobs', 0))} stale (preempted generation), "
                           f"{int(wtot.get('put_keys', 0))} keys put"),
            ("peak pins", f"{ss.ledger.peak_inflight_jobs} jobs / {ss.ledger.peak_pinned_blocks} block pins "
                          f"(cap {cap_jobs} / {cap_blocks})"),
            ("preemptions", f"{h.stats.preemptions} ({len(h.stats.preempted_req_ids)} distinct requests)"),
            ("deferrals", f"{int(ss.stats.total('deferrals'))} (cap reached; saves retried), "
                          f"{ss.stats.total('saves_dropped')} saves dropped at finish"),
            ("store hits", f"{ss.stats.total('loads_emitted')} loads ({report['pass1_loads']} in pass 1), "
                           f"{int(totals.get('loaded_tokens', 0))} tokens scheduled to load (before failures)"),
            ("load failures", f"{h.stats.load_error_blocks} blocks reported, recovered by recompute "
                              f"({'evictions injected in pass 2' if not args.no_faults else 'none injected'})"),
            ("wrong KV / outputs", f"{len(h.garbage)} computes on wrong KV, {bad_outputs} wrong outputs"),
            ("polluted keys", f"{polluted} of {checked} stored keys checked (must be 0)"),
            ("leaked blocks", f"{leaked_blocks} (must be 0){'; ' + '; '.join(leaks) if leaks else ''}"),
        ]
        print()
        print("kvledger demo: vLLM 0.32.0 Scheduler + KVLedgerConnector + embedded Mooncake")
        for name, value in rows:
            print(f"  {name:<20} {value}")
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(("wall time", f"{figures['wall_s']:.1f} s"))
        print(f"  {'wall time':<20} {figures['wall_s']:.1f} s")
        ok = polluted == 0 and leaked_blocks == 0 and not leaks and not h.garbage and bad_outputs == 0
    verdict: str | None = None
    accepted: bool | None = None
    if args.trace:  # after close: every connector flushed and closed the log
        # the checker is a layer above the drivers: run it as a program, not an import
        cmd = [sys.executable, "-m", "conformance.runlog", args.trace, "--pin-cap", str(cap_jobs)]
        res = subprocess.run(cmd + (["--no-rest"] if leaks else []), capture_output=True, text=True)
        verdict = next((ln for ln in res.stdout.splitlines() if ln.startswith(("ACCEPTED", "REJECTED", "ERROR"))),
                       f"no verdict (exit {res.returncode}): {res.stderr.strip()[-300:]}")
        accepted = res.returncode == 0
        rows.append(("trace validation", f"TLC: {verdict}"))
        print(f"  {'trace validation':<20} TLC: {verdict}")
        ok = ok and accepted
    print("OK" if ok else "FAILED")
    result = DemoResult(ok=ok, requests=len(prompts), tp=args.tp, cap_jobs=cap_jobs, figures=figures,
                        rows=tuple(rows), trace_path=args.trace, trace_accepted=accepted, trace_verdict=verdict)
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(result.to_json())
    return result


if __name__ == "__main__":
    sys.exit(main())
