"""`make verify`: the project's main check, as a thin orchestrator with a summary.

Stage 1 runs the TLC model check (conformance.model_check: the fixed design passes, the legacy
design and the mutants fail as expected); stage 2 the witnesses (conformance.witness: TLC reaches the
hazard of every safety invariant and action property in some CI config, so none holds vacuously).
Then conformance, on a real Mooncake master on 127.0.0.1
(started here, stopped by pid):

  replay     TLC's full graph of tla/MC_conformance_2ranks.cfg (the CI graph: 2 requests, 2 ranks,
             1 block, one preemption, a load fault; 34,091 states) exported with seeded random
             behaviours + paths covering every edge, all replayed against the real parts; plus the
             whole graph of tests/conformance/kv/MC_replay_tiny.cfg (every store fault kind), and
             simulated behaviours (coverage not measured) of tla/MC_conformance.cfg (1 rank, both
             requests preempted) and tla/MC_conformance_sim.cfg (2 ranks, 2 blocks, faults)
  trace      NDJSON logs written by kvledger during replays, checked by TLC (tla/TraceKVLedger.tla)
  real run   the whole demo (vLLM's real Scheduler, 2 ranks, embedded Mooncake, 240 requests twice,
             ~8,000 events) with the connector's `trace_path` log checked by TLC against the job
             lifecycle (tla/TraceRuntime.tla, conformance.runlog), and a copy corrupted at one event
             rejected at that event; `make test` checks every integration and engine test's log
  mutants    the runtime mutants' kill table (conformance.mutants)

One summary line: behaviours replayed, edge coverage of the CI graph, logs validated, mutants killed.
Gates: >= 1000 behaviours, coverage >= 95%, every behaviour conforms, every log accepted, every mutant
killed.  Exit 0 only when every stage does.  `--skip-model-check` runs the conformance stages only
(without the model check and the witnesses).
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from pathlib import Path

from conformance import model_check, witness

ROOT = Path(__file__).resolve().parent.parent
# the coverage-gated graph has 2 ranks like the CI model-check configs; the 1-rank graph it replaced
# (both requests preempted, which OnePreemption excludes here) is kept as cheap simulated behaviours
CI_CFG = ROOT / "tla" / "MC_conformance_2ranks.cfg"
ONE_RANK_CFG = ROOT / "tla" / "MC_conformance.cfg"
FAULTS_CFG = ROOT / "tests" / "conformance" / "kv" / "MC_replay_tiny.cfg"
SIM_CFG = ROOT / "tla" / "MC_conformance_sim.cfg"
MIN_BEHAVIOURS, MIN_COVERAGE = 1000, 0.95

# filled by the conformance stages, printed in the summary
FIGURES: dict[str, str] = {}


def _mooncake():
    from conformance.kvdriver import MooncakeBackend
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.embedded import EmbeddedMooncake
    from kvledger_connector.store import MooncakeStore

    mc = EmbeddedMooncake(rpc_timeout_ms=2000)
    try:
        store = MooncakeStore.connect(StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20,
                                                  rpc_timeout_ms=2000), embedded=mc)
    except BaseException:
        mc.stop()
        raise
    return mc, store, MooncakeBackend(store)


def replay_stage(_argv: list[str]) -> int:
    from conformance import export as ex
    from conformance import kvtrace
    from conformance import replay as rp
    from conformance.kvdriver import KVDriver

    ci = ex.export(CI_CFG.parent, "KVLedger", CI_CFG.name, num=1000, depth=40, seed=1)
    taken, total = ex.coverage(ci.graph, (b for _, b in ci.behaviours))
    faults = ex.export(ROOT / "tla", "KVLedger", str(FAULTS_CFG), num=200, depth=40, seed=1)
    sim = ex.simulated_export(SIM_CFG.parent, "KVLedger", SIM_CFG.name, num=300, depth=60, seed=1)
    one_rank = ex.simulated_export(ONE_RANK_CFG.parent, "KVLedger", ONE_RANK_CFG.name, num=300, depth=40, seed=1)
    mc, store, backend = _mooncake()
    try:
        reps = []
        for e in (ci, faults, sim, one_rank):
            r = rp.replay_export(e, KVDriver(backend, e.consts), stop_after=3, progress=print)
            print(f"{r.line()} [{Path(e.cfg).name}]", flush=True)
            reps.append(r)
        logs = kvtrace.record_logs(sim, backend, kvtrace.LOG_DIR, kvtrace.interesting(sim, 4))
        logs += kvtrace.record_logs(faults, backend, kvtrace.LOG_DIR, kvtrace.interesting(faults, 2))
    finally:
        store.close()
        mc.stop()
    n = sum(r.behaviours for r in reps)
    ok = sum(r.conforming for r in reps)
    cov = taken / max(total, 1)
    FIGURES["replay"] = (f"{ok}/{n} behaviours replayed and conforming; edge coverage {taken}/{total} = "
                         f"{100 * cov:.1f}% of the CI graph ({CI_CFG.name}: {len(ci.graph.states)} states, "
                         f"{len(ci.graph.edges)} edges, {len(ci.graph.init)} initial)")
    FIGURES["_logs"] = "\n".join(str(p) for p in logs)
    return 0 if ok == n and n >= MIN_BEHAVIOURS and cov >= MIN_COVERAGE else 1


def trace_stage(_argv: list[str]) -> int:
    from conformance import kvtrace

    logs = [Path(p) for p in FIGURES.get("_logs", "").split("\n") if p]
    if not logs:
        print("verify: no log was recorded (the replay stage failed)")
        return 1
    good = 0
    for log in logs:
        cfg = SIM_CFG if log.name.startswith(SIM_CFG.stem) else FAULTS_CFG
        v = kvtrace.check_log(log, cfg)
        print(v.line(log.name), flush=True)
        good += v.accepted
    FIGURES["trace"] = f"{good}/{len(logs)} runtime logs validated by TLC"
    return 0 if good == len(logs) else 1


def _corrupt_copy(log: Path, out: Path) -> int:
    """A copy of `log` with one Report in the middle claiming another outcome: the checker must reject
    exactly that line. Returns its 1-based line number."""
    lines = log.read_text().splitlines()
    reports = [i for i, ln in enumerate(lines) if '"action":"Report"' in ln and '"from":"stored"' in ln]
    if not reports:
        raise RuntimeError(f"{log}: no Report of a stored job to corrupt")
    i = reports[len(reports) // 2]
    lines[i] = lines[i].replace('"from":"stored"', '"from":"failed"')
    out.write_text("\n".join(lines) + "\n")
    return i + 1


def real_run_stage(_argv: list[str]) -> int:
    """The whole demo (240 requests twice, 2 ranks, preemption storms, evictions) logs its run and checks
    the log with TLC; then a copy corrupted at one event must be rejected at that event."""
    import subprocess

    log = ROOT / ".tlc-out" / "traces" / "demo.ndjson"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "testbed.demo", "--trace", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ") or ln in ("OK", "FAILED")]
    print("\n".join(lines), flush=True)
    tv = next((ln.split("TLC:", 1)[1].strip() for ln in lines if "trace validation" in ln), "no verdict")
    ok = proc.returncode == 0 and tv.startswith("ACCEPTED")
    bad = log.with_name("demo-corrupted.ndjson")
    at = _corrupt_copy(log, bad) if log.exists() else -1
    res = subprocess.run([sys.executable, "-m", "conformance.runlog", str(bad), "--pin-cap", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200) if at > 0 else None
    rej = next((ln for ln in (res.stdout if res else "").splitlines() if ln.startswith("REJECTED")), "")
    caught = res is not None and res.returncode != 0 and f"(line {at} of the log)" in rej
    print(f"  {'corrupted copy':<20} line {at} altered: {rej or 'NOT REJECTED'}", flush=True)
    FIGURES["real run"] = (f"demo log (240 requests x 2, tp=2) {tv}; corrupted copy "
                           f"{'rejected at the altered line' if caught else 'NOT rejected where altered'}")
    return 0 if ok and caught else 1


def mutants_stage(_argv: list[str]) -> int:
    from conformance import mutants

    res = mutants.kill_table(mutants.exports([str(c) for c in mutants.DEFAULT_CFGS], 100))
    FIGURES["mutants"] = f"{sum(res.values())}/{len(res)} mutants killed"
    return 0 if all(res.values()) else 1


Stage = tuple[str, Callable[[list[str]], int]]
STAGES: list[Stage] = [
    ("model check (TLC)", model_check.main),
    ("witnesses (TLC)", witness.main),
    ("replay (real Mooncake)", replay_stage),
    ("trace validation (TLC)", trace_stage),
    ("real-run log (TLC)", real_run_stage),
    ("mutant kill table", mutants_stage),
]

MODEL_STAGES = {"model check (TLC)", "witnesses (TLC)"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    results: list[tuple[str, int, float]] = []
    stages = [s for s in STAGES if s[0] not in MODEL_STAGES] if "--skip-model-check" in argv else STAGES
    for name, run in stages:
        print(f"== verify: {name}", flush=True)
        t0 = time.monotonic()
        try:
            code = run([])
        except Exception as e:  # a stage that crashes is a failed stage, reported in one line
            print(f"verify: stage {name!r} crashed: {type(e).__name__}: {e}", file=sys.stderr)
            code = 2
        results.append((name, code, time.monotonic() - t0))
    print("\n== verify summary")
    for name, code, secs in results:
        print(f"  {'PASS' if code == 0 else 'FAIL'}  {name:<28} exit {code}  {secs:6.1f}s")
    figs = [v for k, v in FIGURES.items() if not k.startswith("_")]
    if figs:
        print("  conformance: " + "; ".join(figs))
    total = sum(s for _, _, s in results)
    worst = max((c for _, c, _ in results), default=0)
    print(f"  total {total:.1f}s -> {'PASS' if worst == 0 else 'FAIL'}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
