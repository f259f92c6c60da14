"""Connector benchmarks. Each suite prints same-run ratios only.

Suite `store`: store throughput through `MooncakeStore` (our wrapper: input checks, per-key codes, health
backoff, duplicate-key rounds) against the raw Mooncake batch calls it wraps
(`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` on the same client) and a memcpy
(torch ``copy_``) of the same bytes. A plain byte-buffer benchmark of the store wrapper, not of a KV cache
(`bench.datapath` measures the worker path on allocator-built KV caches): every key is 2 segments, slot i
of two source byte buffers, read back into slot i of two destination byte buffers, so the wrapper sees
multi-segment keys. Per iteration the three paths run in a rotating order; puts use fresh keys
each iteration (removed untimed afterwards, since put is first-writer-wins); gets read keys stored once.
Data is checked byte-exact once per path. Two placements, each on its own embedded master on 127.0.0.1:
"local" (the client owns the segment; Mooncake moves the bytes in-process with its TCP-only memcpy path)
and "remote" (the segment belongs to a separate `mooncake_client` holder process and the benchmarking
client contributes none, so every byte crosses a loopback TCP connection, as for workers that are pure
consumers).

Suite `overhead`: the connector's per-step cost on the scheduler side, with saves (kv_both) and without
(kv_consumer), against the scheduler's own step time in the same run (see `overhead_suite`).

Adding a suite: write ``def my_suite(args) -> int``
printing its own table, and append it to `SUITES`; `main()` runs them in order.

Run: ``make bench`` or ``python -m bench.connector [--quick] [--suite store]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Shape:
    num_keys: int
    block_bytes: int  # per key: 2 segments of block_bytes / 2

    @property
    def total(self) -> int:
        return self.num_keys * self.block_bytes

    def label(self) -> str:
        return f"{self.num_keys} keys x {self.block_bytes >> 10} KiB (2 segs) = {self.total >> 20} MiB"


SHAPES = (Shape(256, 256 << 10), Shape(64, 16 << 10))
ITERS = {SHAPES[0]: 15, SHAPES[1]: 60}  # --quick divides by 3


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _store_shape(store, shape: Shape, iters: int) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    raw = store.raw
    seg = shape.block_bytes // 2
    g = torch.Generator().manual_seed(shape.num_keys)
    # byte buffers [num_keys, seg]: key i = (src_a[i], src_b[i]); gets land in (dst_a[i], dst_b[i])
    src_a, src_b = (torch.randint(0, 256, (shape.num_keys, seg), generator=g, dtype=torch.uint8) for _ in range(2))
    dst_a, dst_b = torch.zeros_like(src_a), torch.zeros_like(src_b)
    buffers = (src_a, src_b, dst_a, dst_b)
    for t in buffers:
        store.register_buffer(t.data_ptr(), t.nbytes)
    src_ptrs = [[src_a[i].data_ptr(), src_b[i].data_ptr()] for i in range(shape.num_keys)]
    dst_ptrs = [[dst_a[i].data_ptr(), dst_b[i].data_ptr()] for i in range(shape.num_keys)]
    sizes = [[seg, seg]] * shape.num_keys
    run = uuid.uuid4().hex[:8]

    def fresh(tag: str, it: int) -> list[str]:
        return [f"bench/{run}/{tag}/{it}/{i}" for i in range(shape.num_keys)]

    # gets read one fixed key set
    get_keys = fresh("get", 0)
    if raw.batch_put_from_multi_buffers(get_keys, src_ptrs, sizes) != [0] * shape.num_keys:
        raise BenchError("initial put failed (segment too small?)")

    def check(path: str) -> None:
        if not (torch.equal(dst_a, src_a) and torch.equal(dst_b, src_b)):
            raise BenchError(f"{path}: data read back differs")
        dst_a.zero_()
        dst_b.zero_()

    put_fns: dict[str, Callable[[list[str]], list[int]]] = {
        "raw": lambda keys: list(raw.batch_put_from_multi_buffers(keys, src_ptrs, sizes)),
        "ours": lambda keys: store.batch_put(keys, src_ptrs, sizes),
    }
    get_fns: dict[str, Callable[[], list[int]]] = {
        "raw": lambda: list(raw.batch_get_into_multi_buffers(get_keys, dst_ptrs, sizes)),
        "ours": lambda: store.batch_get(get_keys, dst_ptrs, sizes),
    }
    for name, fn in get_fns.items():  # warm-up + correctness, untimed
        if fn() != [shape.block_bytes] * shape.num_keys:
            raise BenchError(f"get via {name} failed")
        check(f"get via {name}")

    times: dict[str, dict[str, list[float]]] = {op: {"raw": [], "ours": [], "memcpy": []} for op in ("put", "get")}
    order = ["raw", "ours", "memcpy"]
    for it in range(iters):
        order = order[1:] + order[:1]  # rotate: no path always runs first (cold) or last
        for path in order:
            if path == "memcpy":
                t0 = time.perf_counter()
                dst_a.copy_(src_a)
                dst_b.copy_(src_b)
                times["put"]["memcpy"].append(time.perf_counter() - t0)
                times["get"]["memcpy"].append(times["put"]["memcpy"][-1])
                check("memcpy")
                continue
            keys = fresh(path, it)
            t0 = time.perf_counter()
            res = put_fns[path](keys)
            times["put"][path].append(time.perf_counter() - t0)
            if res != [0] * shape.num_keys:
                raise BenchError(f"put via {path} returned {sorted(set(res))}")
            raw.batch_remove(keys, True)
            t0 = time.perf_counter()
            res = get_fns[path]()
            times["get"][path].append(time.perf_counter() - t0)
            if res != [shape.block_bytes] * shape.num_keys:
                raise BenchError(f"get via {path} returned {sorted(set(res))}")
            if it == 0:
                check(f"get via {path}")
    raw.batch_remove(get_keys, True)
    for t in buffers:
        raw.unregister_buffer(t.data_ptr())
        store.registered.pop(t.data_ptr(), None)
    out: dict[str, dict[str, float]] = {}
    for op, paths in times.items():
        out[op] = {p: _gbps(shape.total, statistics.median(ts)) for p, ts in paths.items()}
        # paired per iteration: robust to load drifting over the run (other jobs share these cores)
        out[op]["ratio"] = statistics.median(r / o for r, o in zip(paths["raw"], paths["ours"]))
        out[op]["extra_us"] = statistics.median((o - r) * 1e6 for r, o in zip(paths["raw"], paths["ours"]))
    return out


def store_suite(args: argparse.Namespace) -> int:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.store.client import MooncakeStore

    div = 3 if args.quick else 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the memcpy baseline must not fight Mooncake's threads for 2 cores
    print(f"[bench.connector] store throughput on byte buffers (2 segments per key): MooncakeStore vs raw Mooncake "
          f"batch calls vs torch copy_ (medians; per-iteration paired ratios; rotating order)", flush=True)
    rows = []
    try:
        for placement in ("local", "remote"):
            with EmbeddedMooncake() as mc:
                if placement == "remote":  # the segment lives in another process: bytes cross loopback TCP
                    mc.start_holder(512 << 20)
                segment = 512 << 20 if placement == "local" else 0
                store = MooncakeStore.connect(StoreConfig(global_segment_size=segment, local_buffer_size=4 << 20),
                                              embedded=mc)
                try:
                    # remote is ~10x slower per byte: half the iterations keep the run short
                    per = 1 if placement == "local" else 2
                    rows += [(placement, shape, _store_shape(store, shape, max(3, ITERS[shape] // div // per)))
                             for shape in SHAPES]
                finally:
                    store.close()
    finally:
        torch.set_num_threads(threads)
    print(f"{'placement':<9} {'shape':<40} {'op':<4} {'ours GB/s':>10} {'raw GB/s':>9} {'memcpy GB/s':>12} "
          f"{'ours/raw':>9} {'ours-raw us':>12} {'memcpy/ours':>12}")
    for placement, shape, res in rows:
        for op in ("put", "get"):
            r = res[op]
            print(f"{placement:<9} {shape.label():<40} {op:<4} {r['ours']:>10.2f} {r['raw']:>9.2f} {r['memcpy']:>12.2f} "
                  f"{r['ratio']:>9.2f} {r['extra_us']:>12.0f} {r['memcpy'] / r['ours']:>12.1f}")
    print("ours/raw: median of per-iteration throughput ratios (1.0 = the wrapper costs nothing measurable);\n"
          "ours-raw us: median extra time per batch call; memcpy/ours: what Mooncake itself costs over a copy.")
    return 0


# ------------------------------------------------------------------ suite `overhead`
#: public connector methods vLLM's scheduler may call in a step; lifecycle ones (bind, shutdown) excluded
_NOT_STEP_HOOKS = frozenset({"bind_gpu_block_pool", "bind_kv_cache_manager", "shutdown", "build_kv_connector_stats",
                             "build_prom_metrics"})
_SCHEDULER_STEP = ("schedule", "update_from_output", "has_requests")  # what vLLM's engine loop calls per step


class _Accumulator:
    """perf_counter time of the outermost wrapped call (a hook calling another hook counts once). With
    `inside`, only calls made while `inside` is running count: connector hooks called by the scheduler,
    not the harness's own bookkeeping calls."""

    def __init__(self, inside: _Accumulator | None = None) -> None:
        self.inside = inside
        self.depth = 0
        self.total = 0.0
        self.by_name: dict[str, float] = {}

    def wrap(self, obj: object, name: str, before: Callable[[], None] | None = None) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            if self.depth or (self.inside is not None and not self.inside.depth):
                return fn(*args, **kwargs)
            if before is not None:
                before()  # untimed
            self.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.depth = 0
                self.total += dt
                self.by_name[name] = self.by_name.get(name, 0.0) + dt

        setattr(obj, name, timed)  # instance attribute: vLLM's `self.connector.<hook>(...)` finds it first


@dataclass
class _RoundResult:
    steps: int
    scheduler_s: float  # schedule + update_from_output + has_requests, connector hooks included
    connector_s: float  # inside the connector's hooks, called by the scheduler
    by_hook: dict[str, float]
    saves: int
    loads: int
    preemptions: int


def _wait_workers_idle(h, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Before each timed schedule(): the worker threads have drained, so they neither steal the scheduler's
    core nor hold the GIL while it is timed, and a save finishes in the step that emitted it (the same
    schedule whatever the threads' speed). Untimed; a benchmark device, said so."""
    deadline = time.monotonic() + timeout_s
    while any(w.worker_side.busy() for w in h.workers):
        if time.monotonic() > deadline:
            raise BenchError(f"worker threads still busy after {timeout_s}s")
        time.sleep(0.0002)


def _overhead_round(h, prompts: list[list[int]], max_tokens: int, tag: str) -> _RoundResult:  # type: ignore[no-untyped-def]
    sched_acc = _Accumulator()
    conn_acc = _Accumulator(inside=sched_acc)
    sched, conn = h.scheduler, h.scheduler_connector
    saved = dict(sched.__dict__), dict(conn.__dict__)
    hooks = [n for n in dir(type(conn)) if not n.startswith("_") and n not in _NOT_STEP_HOOKS
             and callable(getattr(type(conn), n, None))]
    for name in hooks:
        conn_acc.wrap(conn, name)
    for name in _SCHEDULER_STEP:
        sched_acc.wrap(sched, name, before=(lambda: _wait_workers_idle(h)) if name == "schedule" else None)
    ss = conn.scheduler_side.steps
    jobs0, loads0 = ss.ledger.num_jobs_opened, ss.stats.total("loads_emitted")
    steps0, pre0 = h.stats.steps, h.stats.preemptions
    try:
        for i, p in enumerate(prompts):
            h.add_request(f"{tag}-{i}", p, max_tokens)
        h.run(timeout_s=120.0)
    finally:
        for obj, d in ((sched, saved[0]), (conn, saved[1])):  # unwrap: instance attributes removed
            for name in list(obj.__dict__):
                if name not in d:
                    delattr(obj, name)
    problems = h.check_at_rest()
    if problems or h.garbage:
        raise BenchError(f"overhead round {tag}: not at rest or wrong KV: {problems} {h.garbage[:3]}")
    for i, p in enumerate(prompts):
        if h.stats.outputs.get(f"{tag}-{i}") != h.expected_output(p, max_tokens):
            raise BenchError(f"overhead round {tag}: request {i} produced a wrong output")
    return _RoundResult(h.stats.steps - steps0, sched_acc.total, conn_acc.total, dict(conn_acc.by_name),
                        ss.ledger.num_jobs_opened - jobs0, ss.stats.total("loads_emitted") - loads0, h.stats.preemptions - pre0)


def overhead_suite(args: argparse.Namespace) -> int:
    """The connector's per-step cost on the scheduler side, with saves (kv_both) and without (kv_consumer),
    as a share of the scheduler's own step time in the same run.

    Comparing whole engine steps of kv_both against kv_consumer means nothing (saves change the schedule:
    pins hold blocks, so preemptions and step counts differ). Instead, in each run, every public connector
    method is wrapped with a perf_counter accumulator that counts only calls made from inside the
    scheduler's step (`schedule`, `update_from_output`, `has_requests`), which are timed too. Worker ranks
    run in-process but outside those calls, and are drained before each `schedule()` (untimed), so worker
    time is excluded from both figures. Rounds alternate kv_both / kv_consumer on the same prompts."""
    import logging

    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.harness import Harness, shared_prefix_prompts

    logging.getLogger("vllm").setLevel(logging.ERROR)
    rounds = 2 if args.quick else 4
    n_req, max_tokens = 24, 16
    print(f"\n[bench.connector] scheduler-side overhead: time inside the connector's hooks per engine step vs "
          f"the scheduler's own step time (schedule + update_from_output + has_requests, minus the hooks); "
          f"{rounds} rounds x {n_req} requests per role, alternating", flush=True)
    results: dict[str, list[_RoundResult]] = {"kv_both": [], "kv_consumer": []}
    with EmbeddedMooncake() as mc:
        cfg = StoreConfig(global_segment_size=128 << 20, local_buffer_size=4 << 20).with_addresses(
            mc.master_address, mc.metadata_server)
        # a block pool far smaller than the working set (8 seqs x 5 blocks > 24): preemptions happen
        kw = dict(tp_size=1, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256)
        with Harness(cfg, kv_role="kv_both", **kw) as both, Harness(cfg, kv_role="kv_consumer", **kw) as cons:
            harnesses = {"kv_both": both, "kv_consumer": cons}
            for r in range(rounds):
                # fresh prompts per round (the keys of each harness's tiny model differ: no cross hits)
                prompts = shared_prefix_prompts(n_req, num_prefixes=3, prefix_len=48, suffix_len=16, seed=100 + r)
                order = list(harnesses) if r % 2 == 0 else list(reversed(harnesses))
                for role in order:
                    results[role].append(_overhead_round(harnesses[role], prompts, max_tokens, f"r{r}"))
    print(f"{'role':<12} {'steps':>6} {'saves':>6} {'loads':>6} {'preempt':>8} {'sched own us/step':>18} "
          f"{'connector us/step':>18} {'connector/sched':>16}")
    per_step: dict[str, list[float]] = {}
    for role, rs in results.items():
        steps = sum(x.steps for x in rs)
        conn = sum(x.connector_s for x in rs)
        own = sum(x.scheduler_s - x.connector_s for x in rs)
        per_step[role] = [x.connector_s / x.steps for x in rs]
        ratio = statistics.median(x.connector_s / (x.scheduler_s - x.connector_s) for x in rs)
        print(f"{role:<12} {steps:>6} {sum(x.saves for x in rs):>6} {sum(x.loads for x in rs):>6} "
              f"{sum(x.preemptions for x in rs):>8} {own / steps * 1e6:>18.1f} {conn / steps * 1e6:>18.1f} "
              f"{ratio:>16.3f}")
        hooks = {k: sum(x.by_hook.get(k, 0.0) for x in rs) for k in {k for x in rs for k in x.by_hook}}
        print("  " + ", ".join(f"{k} {v / steps * 1e6:.1f}" for k, v in sorted(hooks.items(), key=lambda kv: -kv[1])
                               if v / steps * 1e6 >= 0.05) + "  (us/step)")
    with_vs_without = statistics.median(b / c for b, c in zip(per_step["kv_both"], per_step["kv_consumer"]))
    print(f"connector us/step with saves / without: {with_vs_without:.2f} (median of per-round ratios)")
    print("connector/sched: median per-round ratio of hook time to the scheduler's own time (0.10 = the connector "
          "adds 10% to the scheduler's step).")
    return 0


SUITES: dict[str, Callable[[argparse.Namespace], int]] = {"store": store_suite, "overhead": overhead_suite}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.connector", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="run only these (repeatable)")
    args = ap.parse_args([] if argv is None else argv)
    rc = 0
    for name in args.suite or list(SUITES):
        try:
            rc |= int(SUITES[name](args) or 0)
        except BenchError as e:
            print(f"[bench.connector] {name}: FAILED: {e}", file=sys.stderr)
            rc |= 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
