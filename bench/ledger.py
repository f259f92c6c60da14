"""Benchmark of the kvledger core against vLLM 0.32.0's upstream path, a plain-dict version and the pool.

Per engine step, N saving requests (tables of B blocks, allocated from a real vLLM ``BlockPool``) each emit
one store job that pins all B blocks; the same step collects the reports of earlier jobs:
  ws=1: the jobs of step k-1 are reported with count 1;
  ws=2: each rank reports separately, one step apart (count 1 for the jobs of step k-1 and count 1 for
        those of step k-2), so every job takes the partial path once and the release path once.
Timed per step, alternating the order of the three ledgers every step (same machine state for all):
  (a) ours      SchedulerLedger.open_job per request + collect(completed)
  (b) upstream  MooncakeStoreScheduler._reference_save_blocks(meta) + update_connector_output(output),
                vLLM 0.32.0's code, on a scheduler built with object.__new__ + the attributes it reads
  (c) plain     a dict written here: id, non-null ids, touch, decrement, free reversed (no dedupe,
                no cap, no checks: the floor of a dict ledger)
  (d) pool      the touch/free_blocks calls alone
Each on its own identical pool; at the end the pools' ref counts must agree and drain back to 1.
Also: the worker ledger per job (register, begin, record_saved, finish, take) against a plain
dict-of-sets worker, the definition machine (transitions) against the compiled table per trigger, and
the memory of one request state.

Run: ``make bench`` (or ``python -m bench.ledger [--quick]``). Prints µs per job and same-run ratios.
Targets: ours <= 0.75x upstream and <= 1.15x plain at every size.
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


# ----------------------------------------------------------------------------- upstream, built as its tests do
def _upstream_scheduler(pool: Any, world_size: int) -> Any:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator)
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
        MooncakeStoreScheduler)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.float16)
    sched = object.__new__(MooncakeStoreScheduler)
    sched._store_coord = MooncakeStoreCoordinator(
        [KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)], BLOCK, BLOCK)
    sched._boundary_state_group_ids = frozenset()
    sched._num_workers = world_size
    sched._next_store_job_id = 0
    sched._pinned_saves = {}
    sched._gpu_block_pool = None
    sched.bind_gpu_block_pool(pool)
    return sched


def _upstream_meta(tables: list[list[int]], B: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeStoreConnectorMetadata, ReqMeta)
    meta = MooncakeStoreConnectorMetadata(set(), set())
    n = B * BLOCK
    for i, t in enumerate(tables):
        meta.add_request(ReqMeta(req_id=f"req-{i}", token_len_chunk=n, block_ids=(list(t),),
                                 block_hashes=[], can_save=True, num_prompt_tokens=n,
                                 prefill_end_tokens=n, completed_token_len=n,
                                 publish_partial_tail=False))
    return meta


def _upstream_output(completed: dict[int, int]) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeStoreWorkerMetadata)
    from vllm.v1.outputs import KVConnectorOutput
    return KVConnectorOutput(kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves=completed))


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
    pools = {k: _new_pool(npool) for k in ("ours", "upstream", "plain", "pool")}
    tables = {k: [[b.block_id for b in p.get_new_blocks(B)] for _ in range(N)] for k, p in pools.items()}
    if len({repr(t) for t in tables.values()}) != 1:
        raise BenchError("pools allocated different tables")
    table = tables["ours"]
    req_ids = [f"req-{i}" for i in range(N)]
    ours = SchedulerLedger(pools["ours"], world_size=ws, max_inflight_jobs=4 * N,
                           max_pinned_blocks=4 * N * B)
    up = _upstream_scheduler(pools["upstream"], ws)
    plain = PlainLedger(pools["plain"], ws)
    ppool = pools["pool"]
    pblocks = ppool.blocks
    history: list[list[int]] = []
    times: dict[str, list[int]] = {"ours": [], "upstream": [], "plain": [], "pool": []}

    def step_ours(comp: dict[int, int]) -> None:
        open_job = ours.open_job
        for i in range(N):
            open_job(req_ids[i], table[i])
        ours.collect(comp)

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
        meta = _upstream_meta(table, B)
        out = _upstream_output(dict(comp))
        comp_ours, comp_plain = dict(comp), dict(comp)
        runners = {
            "ours": lambda: step_ours(comp_ours),
            "upstream": lambda: (up._reference_save_blocks(meta), up.update_connector_output(out)),
            "plain": lambda: ([plain.open_job(req_ids[i], table[i]) for i in range(N)],
                              plain.collect(comp_plain)),
        }
        order = ["ours", "upstream", "plain"]
        order = order[k % 3:] + order[:k % 3]
        dt: dict[str, int] = {}
        for name in order:
            t0 = time.perf_counter_ns()
            runners[name]()
            dt[name] = time.perf_counter_ns() - t0
        # (d) the pool calls alone, as many touches and frees as the ledgers did this step
        n_free = sum(1 for c in comp.values() if c) if ws == 1 else (N if len(history) >= 2 else 0)
        t0 = time.perf_counter_ns()
        for t in table:
            ppool.touch([pblocks[b] for b in t])
        for t in table[:n_free]:
            ppool.free_blocks(pblocks[b] for b in reversed(t))
        dt["pool"] = time.perf_counter_ns() - t0
        first = k * N
        jobs = list(range(first, first + N))
        if [m.store_job_id for m in meta.requests] != jobs or ours.next_job_id != first + N:
            raise BenchError(f"job ids diverged at step {k}")
        history.append(jobs)
        if k >= warmup:
            for name, v in dt.items():
                times[name].append(v)
    # correctness: identical ref counts, then drain to 1
    rc = {k: [b.ref_cnt for b in p.blocks] for k, p in pools.items() if k != "pool"}
    if not rc["ours"] == rc["upstream"] == rc["plain"]:
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
            "vs_upstream": paired("ours", "upstream"), "vs_plain": paired("ours", "plain"),
            "upstream_vs_plain": paired("upstream", "plain")}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger")
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    a = ap.parse_args(argv)
    budget = 20_000 if a.quick else 400_000
    gc_was = gc.isenabled()
    gc.disable()
    rows = []
    try:
        print("scheduler ledger: µs per job (emit + collect), medians over steps; ratios: median of per-step "
              "ratios (same step, alternating order)")
        print(f"{'N':>5} {'B':>3} {'ws':>2} {'steps':>5} | {'ours':>6} {'upstream':>8} {'plain':>6} "
              f"{'pool':>6} | {'ours/up':>7} {'ours/plain':>10} {'up/plain':>8} | targets")
        for B in (8, 32):
            for N in (64, 256, 1024):
                for ws in (1, 2):
                    steps = max(24 if a.quick else 60, min(400, budget // (N * B)))
                    r = run_scheduler_config(N, B, ws, steps, warmup=max(3, steps // 10))
                    rows.append(r)
                    ok = r["vs_upstream"] <= TARGET_VS_UPSTREAM and r["vs_plain"] <= TARGET_VS_PLAIN
                    print(f"{N:5d} {B:3d} {ws:2d} {steps:5d} | {r['ours_us_job']:6.2f} "
                          f"{r['upstream_us_job']:8.2f} {r['plain_us_job']:6.2f} {r['pool_us_job']:6.2f} | "
                          f"{r['vs_upstream']:7.3f} {r['vs_plain']:10.3f} {r['upstream_vs_plain']:8.3f} | "
                          f"{'ok' if ok else 'MISS'}", flush=True)
        worst_up = max(r["vs_upstream"] for r in rows)
        worst_plain = max(r["vs_plain"] for r in rows)
        print(f"worst ratio ours/upstream = {worst_up:.3f} (target <= {TARGET_VS_UPSTREAM}), "
              f"ours/plain = {worst_plain:.3f} (target <= {TARGET_VS_PLAIN})")
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
