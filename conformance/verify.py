"""`make verify`: the project's main check, as a thin orchestrator with a summary.

Stage 1 runs the TLC model check (conformance.model_check: the fixed design passes, the legacy
design and the mutants fail as expected); stage 2 the witnesses (conformance.witness: TLC reaches the
hazard of every safety invariant and action property in some CI config, so none holds vacuously).
Then conformance, on a real Mooncake master on 127.0.0.1
(started here, stopped by pid):

  replay     TLC's full graph of tla/MC_conformance_2ranks.cfg (the CI graph: 2 requests, 2 ranks,
             1 block, one preemption, a load fault; 37,591 states) exported with seeded random
             behaviours + paths covering every edge, all replayed against the real parts; plus the
             whole graph of tests/conformance/kv/MC_replay_tiny.cfg (every store fault kind), and
             simulated behaviours (coverage not measured) of tla/MC_conformance.cfg (1 rank, both
             requests preempted), tla/MC_conformance_sim.cfg (2 ranks, 3 blocks, 2 chunks with a
             partial tail, faults) and tla/MC_conformance_stripe.cfg (the same, each key put by one
             rank: identical KV stored once); the line coverage of the connector's step functions is
             reported. The behaviours are dealt to `REPLAY_SHARDS` processes (one per core), each on its
             own master; their reports and line coverage are merged
  trace      NDJSON logs written by kvledger during replays, checked by TLC (tla/TraceKVLedger.tla)
  real run   the whole demo (vLLM's real Scheduler, 2 ranks, embedded Mooncake, 240 requests twice,
             ~7,000 events) with the connector's `trace_path` log checked by TLC against the job
             lifecycle (tla/TraceRuntime.tla, conformance.runlog), and a copy corrupted at one event
             rejected at that event; `make test` checks every integration and engine test's log
  mutants    the runtime mutants' kill table (conformance.mutants), the mutants dealt to one process per core

The TLC runs of the model check, the witnesses and the replay's exports run side by side, one per core.

Each stage is a function returning a `StageResult` (name, ok, figures, detail); the orchestrator passes
a stage what it needs from earlier ones (the trace stage: the logs the replay stage recorded) and builds
the summary from the results: one line per stage, then one line of the conformance figures (behaviours
replayed, edge coverage of the CI graph, logs validated, mutants killed). Gates: >= 1000 behaviours,
coverage >= 95%, every behaviour conforms, every log accepted, every mutant killed.  Exit 0 only when
every stage passes.  `--skip-model-check` runs the conformance stages only (without the model check and
the witnesses); `--only NAME` (repeatable: model-check, witnesses, replay, trace, real-run, mutants) runs
those stages only (`trace` needs `replay`).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from conformance import model_check, witness
from conformance.engine.tlc import PARALLEL_RUNS

ROOT = Path(__file__).resolve().parent.parent
# the coverage-gated graph has 2 ranks like the CI model-check configs; the 1-rank graph it replaced
# (both requests preempted, which OnePreemption excludes here) is kept as cheap simulated behaviours
CI_CFG = ROOT / "tla" / "MC_conformance_2ranks.cfg"
ONE_RANK_CFG = ROOT / "tla" / "MC_conformance.cfg"
FAULTS_CFG = ROOT / "tests" / "conformance" / "kv" / "MC_replay_tiny.cfg"
SIM_CFG = ROOT / "tla" / "MC_conformance_sim.cfg"
STRIPE_CFG = ROOT / "tla" / "MC_conformance_stripe.cfg"  # SIM_CFG with identical KV stored once
MIN_BEHAVIOURS, MIN_COVERAGE = 1000, 0.95


class StageResultError(ValueError):
    """A stage built an inconsistent result (passing with a failing exit code, or the reverse)."""


@dataclass(frozen=True)
class StageResult:
    """What one stage found. `figures`: its numbers by name; `detail`: those figures in words for the
    summary's conformance line ("" for the model-check stages, whose tables are printed as they run);
    `exit_code`: the stage's own (a program's) exit status, 0 exactly when ok; `logs`: files it wrote
    that a later stage reads."""

    name: str
    ok: bool
    figures: Mapping[str, Any] = field(default_factory=dict)
    detail: str = ""
    exit_code: int | None = None  # None: 0 when ok, else 1
    logs: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if self.exit_code is not None and (self.exit_code == 0) != self.ok:
            raise StageResultError(f"stage {self.name!r}: ok={self.ok} with exit_code={self.exit_code}")

    @property
    def code(self) -> int:
        if self.exit_code is not None:
            return self.exit_code
        return 0 if self.ok else 1


Done = Mapping[str, StageResult]  # the results of the stages run so far, by stage key


@dataclass(frozen=True)
class Stage:
    key: str  # for --only and for later stages' look-ups
    name: str  # as printed
    run: Callable[[Done], StageResult]
    model: bool = False  # a model-check stage (skipped by --skip-model-check)


def model_check_stage(_done: Done) -> StageResult:
    name = "model check (TLC)"
    t0 = time.monotonic()
    rows = model_check.run_set(model_check.CI, out=lambda s: print(s, flush=True))
    ok = model_check.report(rows, time.monotonic() - t0, out=lambda s: print(s, flush=True))
    as_expected = sum(r.as_expected for r in rows)
    distinct = sum((r.result.distinct or 0) for r in rows if r.result)
    setup_errors = sum(1 for r in rows if r.error)
    code = 2 if rows and setup_errors == len(rows) else (0 if ok else 1)
    return StageResult(name, code == 0, {"rows": len(rows), "as_expected": as_expected, "distinct": distinct,
                                         "setup_errors": setup_errors},
                       exit_code=code)


def witness_stage(_done: Done) -> StageResult:
    code = witness.main([])
    return StageResult("witnesses (TLC)", code == 0, {}, exit_code=code)


@contextlib.contextmanager
def _mooncake() -> Iterator[Any]:
    """A loopback master and the driver's backend on it (the connector's MooncakeStore over a fault client)."""
    from conformance.kvdriver import MooncakeBackend
    from kvledger_connector.store.embedded import EmbeddedMooncake

    mc = EmbeddedMooncake(rpc_timeout_ms=2000)
    try:
        with MooncakeBackend.on_master(mc) as backend:
            yield backend
    finally:
        mc.stop()


#: the connector's step functions the replay drives (and the adapter it does not: vLLM's objects)
COVERED = ("kvledger_connector/scheduler/steps.py", "kvledger_connector/scheduler/lookup.py",
           "kvledger_connector/scheduler/saves.py", "kvledger_connector/scheduler/collect.py",
           "kvledger_connector/scheduler/held.py", "kvledger_connector/scheduler/requests.py",
           "kvledger_connector/scheduler/plan.py", "kvledger_connector/worker/saves.py",
           "kvledger_connector/worker/loads.py", "kvledger_connector/worker/sent.py",
           "kvledger_connector/scheduler/side.py")
#: processes replaying side by side, each on its own loopback master (a behaviour's replay is independent
#: of the others': each starts from the model's initial state on a fresh driver state)
REPLAY_SHARDS = PARALLEL_RUNS


def _coverage(data_file: str | None) -> Any:
    import coverage

    return coverage.Coverage(include=[str(ROOT / p) for p in COVERED], data_file=data_file, config_file=False)


def line_coverage(data_files: Sequence[str]) -> dict[str, float]:
    """The share of each of `COVERED`'s statements run by any of the recorded shards."""
    import coverage

    cov = _coverage(None)
    data = cov.get_data()
    for f in data_files:
        part = coverage.CoverageData(basename=f)
        part.read()
        data.update(part)
    out: dict[str, float] = {}
    for p in COVERED:
        _, stmts, _, missing, _ = cov.analysis2(str(ROOT / p))
        out[p] = (len(stmts) - len(missing)) / max(len(stmts), 1)
    return out


def replay_shard(exps: Sequence[Any], shard: tuple[int, int], cov_file: str) -> list[Any]:
    """One shard of every export replayed on its own master (`replay_export`'s `shard`), the lines of
    `COVERED` it ran recorded in `cov_file` (this process's main thread: the replay is single-threaded)."""
    from conformance.engine import replay as rp
    from conformance.kvdriver import KVDriver
    from kvledger.errors import LedgerInvariantError

    reps = []
    with _mooncake() as backend:
        cov = _coverage(cov_file)
        cov.start()
        try:
            for e in exps:
                reps.append(rp.replay_export(e, KVDriver(backend, e.consts), stop_after=3, progress=print,
                                             checks=(LedgerInvariantError,), shard=shard))  # a named invariant
        finally:
            cov.stop()
            cov.save()
    return reps


def replay_stage(_done: Done) -> StageResult:
    from conformance import kvtrace
    from conformance.engine import export as ex
    from conformance.engine import replay as rp
    from conformance.engine.tlc import in_parallel

    made = in_parallel(lambda f: f(), [
        lambda: ex.export(CI_CFG.parent, "KVLedger", CI_CFG.name, num=1000, depth=40, seed=1),
        lambda: ex.export(ROOT / "tla", "KVLedger", str(FAULTS_CFG), num=200, depth=40, seed=1),
        lambda: ex.simulated_export(SIM_CFG.parent, "KVLedger", SIM_CFG.name, num=300, depth=60, seed=1),
        lambda: ex.simulated_export(ONE_RANK_CFG.parent, "KVLedger", ONE_RANK_CFG.name, num=300, depth=40,
                                    seed=1),
        lambda: ex.simulated_export(STRIPE_CFG.parent, "KVLedger", STRIPE_CFG.name, num=300, depth=60, seed=1)])
    ci, faults, sim, one_rank, stripe = made
    exps = (ci, faults, sim, one_rank, stripe)
    taken, total = ex.coverage(ci.graph, (b for _, b in ci.behaviours))
    n_shards = REPLAY_SHARDS
    with tempfile.TemporaryDirectory(prefix="kvledger-replay-") as tmp:
        cov_files = [os.path.join(tmp, f"lines.{k}") for k in range(n_shards)]
        if n_shards == 1:
            parts = [replay_shard(exps, (0, 1), cov_files[0])]
        else:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that runs torch's threads
            with concurrent.futures.ProcessPoolExecutor(n_shards, mp_context=ctx) as pool:
                futures = [pool.submit(replay_shard, exps, (k, n_shards), cov_files[k]) for k in range(n_shards)]
                parts = [f.result() for f in futures]
        covered = line_coverage(cov_files)
    reps = [rp.ReplayReport.merged(shards) for shards in zip(*parts)]
    for e, r in zip(exps, reps):
        print(f"{r.line()} [{Path(e.cfg).name}, {n_shards} shards]", flush=True)
    with _mooncake() as backend:
        logs = kvtrace.record_logs(sim, backend, kvtrace.LOG_DIR, kvtrace.interesting(sim, 4))
        logs += kvtrace.record_logs(faults, backend, kvtrace.LOG_DIR, kvtrace.interesting(faults, 2))
    n = sum(r.behaviours for r in reps)
    good = sum(r.conforming for r in reps)
    cov = taken / max(total, 1)
    figures = {"behaviours": n, "conforming": good, "edges_taken": taken, "edges_total": total,
               "coverage": cov, "ci_states": len(ci.graph.states), "ci_edges": len(ci.graph.edges),
               "ci_initial": len(ci.graph.init), **{f"lines {p}": v for p, v in covered.items()}}
    lines = ", ".join(f"{Path(p).relative_to('kvledger_connector')} {100 * v:.0f}%"
                      for p, v in covered.items())
    detail = (f"{good}/{n} behaviours replayed and conforming; edge coverage {taken}/{total} = "
              f"{100 * cov:.1f}% of the CI graph ({CI_CFG.name}: {len(ci.graph.states)} states, "
              f"{len(ci.graph.edges)} edges, {len(ci.graph.init)} initial); line coverage of the "
              f"connector's steps under the replay: {lines}")
    ok = good == n and n >= MIN_BEHAVIOURS and cov >= MIN_COVERAGE
    return StageResult("replay (real Mooncake)", ok, figures, detail, logs=tuple(Path(p) for p in logs))


def trace_stage(done: Done) -> StageResult:
    """TLC's verdict on each log the replay stage recorded."""
    from conformance import kvtrace

    name = "trace validation (TLC)"
    logs = done["replay"].logs if "replay" in done else ()
    if not logs:
        print("verify: no log was recorded (the replay stage failed or did not run)")
        return StageResult(name, False, {"logs": 0, "accepted": 0})
    good = 0
    for log in logs:
        cfg = SIM_CFG if log.name.startswith(SIM_CFG.stem) else FAULTS_CFG
        v = kvtrace.check_log(log, cfg)
        print(v.line(log.name), flush=True)
        good += v.accepted
    return StageResult(name, good == len(logs), {"logs": len(logs), "accepted": good},
                       f"{good}/{len(logs)} runtime logs validated by TLC")


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


def real_run_stage(_done: Done) -> StageResult:
    """The whole demo (240 requests twice, 2 ranks, preemption storms, evictions) logs its run and checks
    the log with TLC; then a copy corrupted at one event must be rejected at that event. The demo runs as
    a child process (a crash in it is its own, not this orchestrator's) and hands back its `DemoResult`
    as JSON."""
    from conformance import runlog
    from testbed.demo import DemoResult

    name = "real-run log (TLC)"
    log = ROOT / ".tlc-out" / "traces" / "demo.ndjson"
    result_path = log.with_name("demo-result.json")
    log.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "testbed.demo", "--trace", str(log), "--result-json", str(result_path)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)
    if not result_path.exists():
        print(proc.stdout[-3000:], flush=True)
        print(f"verify: the demo wrote no result (exit {proc.returncode})", flush=True)
        return StageResult(name, False, {"demo_exit": proc.returncode})
    demo = DemoResult.from_json(result_path.read_text())
    for row, value in demo.rows:
        print(f"  {row:<20} {value}")
    print("OK" if demo.ok else "FAILED", flush=True)
    tv = demo.trace_verdict or "no verdict"
    bad = log.with_name("demo-corrupted.ndjson")
    at = _corrupt_copy(log, bad) if log.exists() else -1
    v = runlog.check_log(bad, pin_cap=demo.cap_jobs) if at > 0 else None
    caught = v is not None and not v.accepted and v.first_unmatched_seq == at
    print(f"  {'corrupted copy':<20} line {at} altered: "
          f"{v.line(bad.name) if v is not None and not v.accepted else 'NOT REJECTED'}", flush=True)
    figures = {**demo.figures, "demo_exit": proc.returncode, "log_accepted": bool(demo.trace_accepted),
               "corrupted_line": at, "corrupted_rejected_at": v.first_unmatched_seq if v else None}
    detail = (f"demo log ({demo.requests} requests x 2, tp={demo.tp}) {tv}; corrupted copy "
              f"{'rejected at the altered line' if caught else 'NOT rejected where altered'}")
    ok = proc.returncode == 0 and demo.ok and bool(demo.trace_accepted) and caught
    return StageResult(name, ok, figures, detail)


def mutants_stage(_done: Done) -> StageResult:
    from conformance import mutants

    res = mutants.kill_table_sharded(mutants.exports([str(c) for c in mutants.DEFAULT_CFGS], 100), REPLAY_SHARDS)
    killed = sum(res.values())
    crashed, unshown = len(res.crashed), len(res.unshown)
    return StageResult("mutant kill table", res.ok, {"killed": killed, "mutants": len(res), "crashed": crashed,
                                                     "unshown": unshown},
                       f"{killed}/{len(res)} mutants killed by a named check ({crashed} only crashed, {unshown} "
                       f"not shown by their shows-probe)")


STAGES: list[Stage] = [
    Stage("model-check", "model check (TLC)", model_check_stage, model=True),
    Stage("witnesses", "witnesses (TLC)", witness_stage, model=True),
    Stage("replay", "replay (real Mooncake)", replay_stage),
    Stage("trace", "trace validation (TLC)", trace_stage),
    Stage("real-run", "real-run log (TLC)", real_run_stage),
    Stage("mutants", "mutant kill table", mutants_stage),
]


def run_stages(stages: Sequence[Stage]) -> list[tuple[StageResult, float]]:
    """Run each stage in order, handing it the earlier results; a stage that crashes is a failed stage
    (exit 2), reported in one line on stderr, and the later stages still run."""
    done: dict[str, StageResult] = {}
    out: list[tuple[StageResult, float]] = []
    for st in stages:
        print(f"== verify: {st.name}", flush=True)
        t0 = time.monotonic()
        try:
            res = st.run(done)
        except Exception as e:
            print(f"verify: stage {st.name!r} crashed: {type(e).__name__}: {e}", file=sys.stderr)
            res = StageResult(st.name, False, exit_code=2)
        done[st.key] = res
        out.append((res, time.monotonic() - t0))
    return out


def summary(results: Sequence[tuple[StageResult, float]]) -> list[str]:
    """The summary's lines: one per stage, the conformance figures, the total and the verdict."""
    lines = ["", "== verify summary"]
    for res, secs in results:
        lines.append(f"  {'PASS' if res.ok else 'FAIL'}  {res.name:<28} exit {res.code}  {secs:6.1f}s")
    details = [res.detail for res, _ in results if res.detail]
    if details:
        lines.append("  conformance: " + "; ".join(details))
    total = sum(s for _, s in results)
    lines.append(f"  total {total:.1f}s -> {'PASS' if all(r.ok for r, _ in results) else 'FAIL'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.verify", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-model-check", action="store_true",
                    help="run the conformance stages only (not the model check and the witnesses)")
    ap.add_argument("--only", action="append", default=[], metavar="STAGE",
                    choices=[st.key for st in STAGES],
                    help="run only these stages (repeatable): " + ", ".join(st.key for st in STAGES))
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    stages = [st for st in STAGES if not (args.skip_model_check and st.model)]
    if args.only:
        stages = [st for st in stages if st.key in args.only]
    results = run_stages(stages)
    for line in summary(results):
        print(line)
    return max((r.code for r, _ in results), default=0)


if __name__ == "__main__":
    sys.exit(main())
