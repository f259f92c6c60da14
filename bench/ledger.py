"""Benchmark of the scheduler side against vLLM 0.32.0's upstream MooncakeStore connector, and of the kvledger core.

1. Scheduler-side work per engine step, same inputs (the headline; bench/sched_step.py): vLLM 0.32's real
   `Scheduler` (KVCacheManager, BlockPool, vLLM `Request`s, preemption) runs a workload with a tee connector
   that hands every scheduler-side hook vLLM calls, with the same `SchedulerOutput`/`Request` objects in the
   same step, to both sides and times each call (alternating which goes first):
     ours      `SchedulerSide` (kvledger_connector/scheduler/side.py, the vLLM adapter) over `SchedulerSteps`
               (kvledger_connector/scheduler/steps.py): on_new_request, get_num_new_matched_tokens,
               update_state_after_alloc, build_connector_meta (notices, take_loads, emit_stores: the save
               ranges, `open_job` pins, `SaveSpec`s), update_connector_output (collect_loads, collect),
               request_finished, has_pending_push_work
     upstream  `MooncakeStoreScheduler`, the component MooncakeStoreConnector's scheduler role delegates
               to: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta (request
               trackers, a `ReqMeta` per request, current block tables, `_reference_save_blocks` pins),
               update_connector_output, has_pending_push_work (its connector's request_finished returns
               (False, None) without it; it has no on_new_request)
   Lookups are off on both (kv_producer; upstream `enable_lookup: false`): a lookup is a store round trip,
   not scheduler CPU work. The bench plays the workers: rank r reports a job r + 1 steps after it was
   built. At the end both sides must hold no pin and every block must be free. Prompts are distinct
   random tokens (every block saved); outputs 1..2*out-1 tokens (seeded) or exactly `out` ("=").
   The workload runs 3 times (seeded: the same steps each time); a step's time per side and hook is its
   least over the runs (other processes only ever add time). Printed: µs per step (a side's hook time
   over the run / steps, admission included), ours/upstream of those totals, the median of per-step
   ratios, the split by hook, and vLLM's own scheduler time per step (schedule + update_from_output minus
   both sides' hooks) for scale.
2. The ledger core alone (no upstream here: upstream has no separate ledger to time, its pin bookkeeping
   is inside `_reference_save_blocks` with its tail planning and metadata edits). Per step, N saving
   requests (tables of B blocks from a real vLLM `BlockPool`) each open one job pinning all B blocks and
   the step collects the reports of earlier jobs (ws=1: jobs of step k-1, count 1; ws=2: each rank one
   step apart, so every job takes the partial path once and the release path once); alternating order:
     ours   `SchedulerLedger.open_job` per request + `collect(completed)`
     plain  a dict written here: id, non-null ids, touch, decrement, free reversed (no dedupe, no cap, no
            checks: the floor of a dict ledger)
     pool   the touch/free_blocks calls alone
   Each on its own identical pool; at the end the pools' ref counts must agree and drain back to 1.
3. The worker ledger per job (register, begin, record_saved, finish, take) against a plain dict-of-sets
   worker, the definition machine (transitions) against the compiled table per trigger, and the memory of
   one request state.

Run: ``make bench`` (or ``python -m bench.ledger [--quick]``). Same-run ratios only. Printed targets
(never asserted): ours <= 0.75x upstream per step, and the ledger core <= 1.15x plain at every size.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from typing import Any

BLOCK = 16
TARGET_VS_UPSTREAM = 0.75
TARGET_VS_PLAIN = 1.15


class BenchError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- plain dict version
class PlainLedger:
    def __init__(self, pool: Any, world_size: int) -> None:
        self.pool = pool
        self.world_size = world_size
        self.next_id = 0
        self.pinned: dict[int, tuple[list[int], int]] = {}

    def open_job(self, req_id: str, table: list[int]) -> int:
        job = self.next_id
        self.next_id += 1
        ids = [b for b in table if b != 0]
        self.pinned[job] = (ids, self.world_size)
        blocks = self.pool.blocks
        self.pool.touch([blocks[b] for b in ids])
        return job

    def collect(self, completed: dict[int, int]) -> None:
        blocks = self.pool.blocks
        for job, n in completed.items():
            rec = self.pinned.get(job)
            if rec is None:
                continue
            ids, left = rec
            left -= n
            if left > 0:
                self.pinned[job] = (ids, left)
                continue
            del self.pinned[job]
            self.pool.free_blocks(blocks[b] for b in reversed(ids))


def _new_pool(num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool
    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK)


def run_scheduler_config(N: int, B: int, ws: int, steps: int, warmup: int) -> dict[str, float]:
    from kvledger import SchedulerLedger

    npool = N * B + 16
    pools = {k: _new_pool(npool) for k in ("ours", "plain", "pool")}
    tables = {k: [[b.block_id for b in p.get_new_blocks(B)] for _ in range(N)] for k, p in pools.items()}
    if len({repr(t) for t in tables.values()}) != 1:
        raise BenchError("pools allocated different tables")
    table = tables["ours"]
    req_ids = [f"req-{i}" for i in range(N)]
    ours = SchedulerLedger(pools["ours"], world_size=ws, max_inflight_jobs=4 * N,
                           max_pinned_blocks=4 * N * B)
    plain = PlainLedger(pools["plain"], ws)
    ppool = pools["pool"]
    pblocks = ppool.blocks
    history: list[list[int]] = []
    times: dict[str, list[int]] = {"ours": [], "plain": [], "pool": []}

    def step_ours(comp: dict[int, int]) -> None:
        open_job = ours.open_job
        for i in range(N):
            open_job(req_ids[i], table[i])
        ours.collect(comp)

    def step_plain(comp: dict[int, int]) -> None:
        open_job = plain.open_job
        for i in range(N):
            open_job(req_ids[i], table[i])
        plain.collect(comp)

    for k in range(steps + warmup):
        comp: dict[int, int] = {}
        if ws == 1:
            if history:
                comp = {j: 1 for j in history[-1]}
        else:
            if len(history) >= 2:
                comp.update({j: 1 for j in history[-2]})
            if history:
                comp.update({j: 1 for j in history[-1]})
        comp_ours, comp_plain = dict(comp), dict(comp)
        runners = {"ours": lambda: step_ours(comp_ours), "plain": lambda: step_plain(comp_plain)}
        order = ["ours", "plain"] if k % 2 == 0 else ["plain", "ours"]
        dt: dict[str, int] = {}
        for name in order:
            t0 = time.perf_counter_ns()
            runners[name]()
            dt[name] = time.perf_counter_ns() - t0
        # the pool calls alone, as many touches and frees as the ledgers did this step
        n_free = sum(1 for c in comp.values() if c) if ws == 1 else (N if len(history) >= 2 else 0)
        t0 = time.perf_counter_ns()
        for t in table:
            ppool.touch([pblocks[b] for b in t])
        for t in table[:n_free]:
            ppool.free_blocks(pblocks[b] for b in reversed(t))
        dt["pool"] = time.perf_counter_ns() - t0
        first = k * N
        jobs = list(range(first, first + N))
        if ours.next_job_id != first + N or plain.next_id != first + N:
            raise BenchError(f"job ids diverged at step {k}")
        history.append(jobs)
        if k >= warmup:
            for name, v in dt.items():
                times[name].append(v)
    # correctness: identical ref counts, then drain to 1
    rc = {k: [b.ref_cnt for b in p.blocks] for k, p in pools.items()}
    if not rc["ours"] == rc["plain"] == rc["pool"]:
        raise BenchError(f"ref counts diverged (N={N} B={B} ws={ws})")
    rest = {j: ours.ranks_left(j) for j in ours.inflight_jobs()}
    ours.collect(rest)
    if ours.has_pending_work() or any(pools["ours"].blocks[b].ref_cnt != 1 for t in table for b in t):
        raise BenchError("ours did not drain to ref_cnt 1")
    med = {k: statistics.median(v) / 1e3 for k, v in times.items()}

    def paired(a: str, b: str) -> float:
        # median of per-step ratios: both ran in the same step, so a machine slow-down hits both
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    return {"N": N, "B": B, "ws": ws, "steps": steps, **{f"{k}_us_job": v / N for k, v in med.items()},
            "vs_plain": paired("ours", "plain"), "vs_pool": paired("ours", "pool")}


# ----------------------------------------------------------------------------- worker side
class PlainWorker:
    """Upstream's shape: req_id -> set(live job ids), offsets and completions in dicts."""

    def __init__(self) -> None:
        self.stored: dict[str, set[int]] = {}
        self.offset: dict[str, int] = {}
        self.completed: dict[int, int] = {}

    def register(self, req_id: str, job: int) -> None:
        self.stored.setdefault(req_id, set()).add(job)

    def run(self, req_id: str, job: int, tokens: int) -> None:
        live = job in self.stored.get(req_id, ())
        if live and job in self.stored.get(req_id, ()):
            self.offset[req_id] = tokens
        s = self.stored.get(req_id)
        if s is not None:
            s.discard(job)
        self.completed[job] = self.completed.get(job, 0) + 1

    def take(self) -> dict[int, int]:
        c, self.completed = self.completed, {}
        return c


def run_worker(N: int, steps: int) -> dict[str, float]:
    from kvledger import Verdict, WorkerLedger

    ours = WorkerLedger(0, max_live_jobs=2 * N, max_requests=2 * N)
    plain = PlainWorker()
    req_ids = [f"req-{i}" for i in range(N)]
    t_ours: list[int] = []
    t_plain: list[int] = []
    job = 0
    for k in range(steps):
        jobs = list(range(job, job + N))
        job += N
        tok = (k + 1) * BLOCK
        runs = []

        def ours_step() -> None:
            reg, begin, saved, finish = ours.register, ours.begin, ours.record_saved, ours.finish
            for i in range(N):
                reg(req_ids[i], jobs[i])
            for i in range(N):
                j = jobs[i]
                if begin(j) is Verdict.RUN:
                    saved(j, tok)
                finish(j)
            ours.take_completed()

        def plain_step() -> None:
            for i in range(N):
                plain.register(req_ids[i], jobs[i])
            for i in range(N):
                plain.run(req_ids[i], jobs[i], tok)
            plain.take()

        runs = [("ours", ours_step), ("plain", plain_step)]
        if k % 2:
            runs.reverse()
        for name, fn in runs:
            t0 = time.perf_counter_ns()
            fn()
            (t_ours if name == "ours" else t_plain).append(time.perf_counter_ns() - t0)
    mo, mp = statistics.median(t_ours) / 1e3 / N, statistics.median(t_plain) / 1e3 / N
    return {"N": N, "ours_us_job": mo, "plain_us_job": mp, "ratio": mo / mp}


def run_machine_cost(n: int = 2000) -> dict[str, float]:
    from kvledger.machines import SPECS, STORE_JOB, build_machine, step

    _, model = build_machine(SPECS["StoreJob"])
    path = [("Receive", "queued"), ("DmaRead", "running"), ("Put", "stored"), ("Report", "reported")]
    t0 = time.perf_counter_ns()
    for _ in range(n // 4):
        model.state = "emitted"
        for trig, dest in path:
            model.trigger(trig, dest=dest)
    t_def = (time.perf_counter_ns() - t0) / 1e3 / (n // 4 * 4)
    t0 = time.perf_counter_ns()
    for _ in range(n // 4):
        s = "emitted"
        for trig, dest in path:
            s = step(STORE_JOB, "StoreJob", s, trig, dest, 0)
    t_tab = (time.perf_counter_ns() - t0) / 1e3 / (n // 4 * 4)
    return {"transitions_us": t_def, "table_us": t_tab}


def run_memory(n: int = 10_000) -> float:
    """Bytes per request state on a rank: the StoreRequestState, its live set with one job, the job
    record and the ledger's dict entries (measured with tracemalloc)."""
    from kvledger import WorkerLedger
    led = WorkerLedger(0, max_live_jobs=n + 1, max_requests=n + 1)
    ids = [f"req-{i:08d}" for i in range(n)]  # the strings exist anyway (vLLM owns them)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(n):
        led.register(ids[i], i)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    total = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return total / n


# ----------------------------------------------------------------------------- 1. scheduler-side step, same inputs
HOOK_GROUPS = (("build_meta", ("build_connector_meta",)), ("update_out", ("update_connector_output",)),
               ("admit", ("get_num_new_matched_tokens", "update_state_after_alloc")),
               ("life", ("on_new_request", "request_finished", "has_pending_push_work")))


def step_workloads(quick: bool) -> list[Any]:
    from bench.sched_step import Workload
    k = 2 if quick else 8
    rows = [Workload(max_num_seqs=N, prompt_blocks=B, max_tokens=4, num_requests=k * N, world_size=ws)
            for N in (64, 256) for B in (8, 32) for ws in (1, 2)]
    rows += [Workload(max_num_seqs=64, prompt_blocks=8, max_tokens=64 if quick else 128, fixed_tokens=True,
                      num_requests=64 if quick else 128, save_decode=sd) for sd in (False, True)]
    return rows


def step_row(w: Any, runs: list[Any]) -> dict[str, Any]:
    """Runs of one workload (seeded: the same steps each run). A step's time per side and hook is the least
    over the runs (other processes on the machine only ever add time); every figure sums those."""
    shape = {(len(r.steps), r.jobs_total["ours"], r.jobs_total["upstream"], r.preemptions) for r in runs}
    if len(shape) != 1:
        raise BenchError(f"{w.label()}: the runs differ (steps, jobs ours, jobs upstream, preemptions): {shape}")
    r0 = runs[0]
    per_rec = list(zip(*([r.admission, *r.steps] for r in runs)))  # record index -> that record in each run
    best = [{k: min(x.hook_ns[k] for x in recs) for k in set().union(*(x.hook_ns for x in recs))}
            for recs in per_rec]
    n = len(r0.steps)

    def total(side: str, hooks: tuple[str, ...] | None = None) -> float:
        return sum(v for b in best for (sd, h), v in b.items() if sd == side and (hooks is None or h in hooks))

    def side(b: dict[tuple[str, str], int], name: str) -> int:
        return sum(v for (sd, _), v in b.items() if sd == name)

    tot = {sd: total(sd) for sd in ("ours", "upstream")}
    row = {"steps": n, "jobs_ours": r0.jobs_total["ours"], "jobs_up": r0.jobs_total["upstream"],
           "preempt": r0.preemptions, "deferrals": max(r.deferrals for r in runs),
           "ours_us": tot["ours"] / n / 1e3, "up_us": tot["upstream"] / n / 1e3,
           "ratio": tot["ours"] / tot["upstream"],
           "step_ratio": statistics.median(side(b, "ours") / side(b, "upstream") for b in best[1:]
                                           if side(b, "upstream") > 0),
           "sched_us": sum(min(x.sched_ns - x.ns["ours"] - x.ns["upstream"] for x in recs)
                           for recs in per_rec[1:]) / n / 1e3}
    for name, hooks in HOOK_GROUPS:
        for sd, short in (("ours", "o"), ("upstream", "u")):
            row[f"{name}_{short}"] = total(sd, hooks) / n / 1e3
    return row


def print_step_table(quick: bool) -> list[dict[str, Any]]:
    rounds = 3  # a step's time is its least over the runs: one slow step would sway a run's total
    print("scheduler-side connector work per engine step, same inputs: vLLM 0.32's Scheduler (real KVCacheManager, "
          "BlockPool, Requests) calls every scheduler-side hook on both, in the same step with the same objects "
          "(bench/sched_step.py):")
    print("  ours = SchedulerSide (vLLM adapter) over SchedulerSteps: lookup/alloc hooks, build_connector_meta "
          "(notices, emit_stores: save ranges, open_job pins, SaveSpecs), update_connector_output (collect), "
          "request_finished, on_new_request")
    print("  upstream = MooncakeStoreScheduler: lookup/alloc hooks, build_connector_meta (trackers, ReqMeta, "
          "block tables, _reference_save_blocks pins), update_connector_output; lookups off on both")
    print(f"  each step's time per side and hook: the least of {rounds} runs of the same seeded workload; µs/step = "
          f"a side's hook time over the run / steps; ratio = of those totals; step = median of per-step ratios; "
          f"split: build_connector_meta, update_connector_output, "
          f"admit = get_num_new_matched_tokens + update_state_after_alloc, life = on_new_request + "
          f"request_finished + has_pending_push_work; vLLM sched = schedule + update_from_output without the "
          f"hooks")
    print(f"{'N':>4} {'B':>3} {'ws':>2} {'out':>4} {'sd':>2} {'steps':>5} {'jobs':>5} | {'ours':>7} {'upstrm':>7} | "
          f"{'ours/up':>7} {'step':>5} | {'build_meta o/u':>15} {'update_out o/u':>15} {'admit o/u':>13} "
          f"{'life o/u':>11} | {'vLLM sched':>10} | target")
    from bench.sched_step import run
    loads = step_workloads(quick)
    runs: list[list[Any]] = [[] for _ in loads]
    for _ in range(rounds):  # round by round, so that a burst of load elsewhere hits one run of a workload
        for i, w in enumerate(loads):
            gc.collect()
            runs[i].append(run(w))
    rows = []
    for w, rs in zip(loads, runs):
        r = step_row(w, rs)
        r["label"] = w.label()
        rows.append(r)
        if r["jobs_ours"] != r["jobs_up"] or r["deferrals"]:
            note = f" (jobs ours {r['jobs_ours']:.0f} / upstream {r['jobs_up']:.0f}, deferrals {r['deferrals']:.0f})"
        else:
            note = ""
        out = f"{'=' if w.fixed_tokens else '~'}{w.max_tokens}"
        print(f"{w.max_num_seqs:4d} {w.prompt_blocks:3d} {w.world_size:2d} {out:>4} {int(w.save_decode):2d} "
              f"{r['steps']:5.0f} {r['jobs_ours']:5.0f} | {r['ours_us']:7.1f} {r['up_us']:7.1f} | "
              f"{r['ratio']:7.3f} {r['step_ratio']:5.2f} | {r['build_meta_o']:7.1f}/{r['build_meta_u']:<7.1f} "
              f"{r['update_out_o']:7.1f}/{r['update_out_u']:<7.1f} {r['admit_o']:6.1f}/{r['admit_u']:<6.1f} "
              f"{r['life_o']:5.1f}/{r['life_u']:<5.1f} | "
              f"{r['sched_us']:10.0f} | {'ok' if r['ratio'] <= TARGET_VS_UPSTREAM else 'MISS'}{note}", flush=True)
    lo, hi = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    print(f"ours/upstream per step: {lo:.3f}-{hi:.3f} (target <= {TARGET_VS_UPSTREAM}, printed, not asserted)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger")
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    a = ap.parse_args(argv)
    budget = 20_000 if a.quick else 400_000
    gc_was = gc.isenabled()
    gc.disable()
    rows = []
    try:
        print_step_table(a.quick)
        print("\nledger core alone (no upstream: its pin bookkeeping is inside _reference_save_blocks): µs per job, "
              "ours SchedulerLedger.open_job + collect vs a plain dict ledger vs the pool's touch/free calls alone, "
              "medians over steps; ratios: median of per-step ratios (same step, alternating order)")
        print(f"{'N':>5} {'B':>3} {'ws':>2} {'steps':>5} | {'ours':>6} {'plain':>6} {'pool':>6} | "
              f"{'ours/plain':>10} {'ours/pool':>9} | target")
        for B in (8, 32):
            for N in (64, 256, 1024):
                for ws in (1, 2):
                    steps = max(24 if a.quick else 60, min(400, budget // (N * B)))
                    r = run_scheduler_config(N, B, ws, steps, warmup=max(3, steps // 10))
                    rows.append(r)
                    print(f"{N:5d} {B:3d} {ws:2d} {steps:5d} | {r['ours_us_job']:6.2f} {r['plain_us_job']:6.2f} "
                          f"{r['pool_us_job']:6.2f} | {r['vs_plain']:10.3f} {r['vs_pool']:9.3f} | "
                          f"{'ok' if r['vs_plain'] <= TARGET_VS_PLAIN else 'MISS'}", flush=True)
        print(f"worst ratio ours/plain = {max(r['vs_plain'] for r in rows):.3f} (target <= {TARGET_VS_PLAIN})")
        print("\nworker ledger: µs per job (register + begin + record_saved + finish + take)")
        for N in (64, 256, 1024):
            w = run_worker(N, max(20, (budget // 4) // N))
            print(f"  N={N:5d}: ours {w['ours_us_job']:.2f} µs/job, plain dict-of-sets "
                  f"{w['plain_us_job']:.2f} µs/job, ratio {w['ratio']:.2f}")
        m = run_machine_cost()
        print(f"\nlifecycle trigger: transitions machine {m['transitions_us']:.2f} µs, compiled table "
              f"{m['table_us']:.3f} µs (x{m['transitions_us'] / m['table_us']:.0f})")
        print(f"memory: {run_memory():.0f} bytes per request state (state + live set + job record + dict "
              f"entries)")
    except BenchError as e:
        print(f"bench.ledger: FAILED consistency check: {e}")
        return 1
    finally:
        if gc_was:
            gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
