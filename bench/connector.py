"""Connector benchmarks (issue 4 §Performance). Each suite prints same-run ratios only.

Suite `store`: store throughput through `MooncakeStore` (our wrapper: input checks, per-key codes, health
backoff, duplicate-key rounds) against the raw Mooncake batch calls it wraps
(`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` on the same client) and a memcpy
(torch ``copy_``) of the same bytes. Every KV block is one key made of two chunks (K and V from two
tensors, as in a real layer). Per iteration the three paths run in a rotating order; puts use fresh keys
each iteration (removed untimed afterwards, since put is first-writer-wins); gets read keys stored once.
Data is checked byte-exact once per path. Two placements, each on its own embedded master on 127.0.0.1:
"local" (the client owns the segment; Mooncake moves the bytes in-process with its TCP-only memcpy path)
and "remote" (the segment belongs to a separate `mooncake_client` holder process and the benchmarking
client contributes none, so every byte crosses a loopback TCP connection, as for workers that are pure
consumers).

Adding a suite (e.g. the connector's per-step scheduler overhead): write ``def my_suite(args) -> int``
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
    block_bytes: int  # per key: K chunk + V chunk

    @property
    def total(self) -> int:
        return self.num_keys * self.block_bytes

    def label(self) -> str:
        return f"{self.num_keys} keys x {self.block_bytes >> 10} KiB (2 chunks) = {self.total >> 20} MiB"


SHAPES = (Shape(256, 256 << 10), Shape(64, 16 << 10))
ITERS = {SHAPES[0]: 15, SHAPES[1]: 60}  # --quick divides by 3


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _store_shape(store, shape: Shape, iters: int) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    raw = store.raw
    half = shape.block_bytes // 2
    elems = half // 2  # float16
    g = torch.Generator().manual_seed(shape.num_keys)
    k = torch.randn(shape.num_keys, elems, generator=g).to(torch.float16)
    v = torch.randn(shape.num_keys, elems, generator=g).to(torch.float16)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for t in (k, v, dk, dv):
        store.register_buffer(t.data_ptr(), t.nbytes)
    src_ptrs = [[k[i].data_ptr(), v[i].data_ptr()] for i in range(shape.num_keys)]
    dst_ptrs = [[dk[i].data_ptr(), dv[i].data_ptr()] for i in range(shape.num_keys)]
    sizes = [[half, half]] * shape.num_keys
    run = uuid.uuid4().hex[:8]

    def fresh(tag: str, it: int) -> list[str]:
        return [f"bench/{run}/{tag}/{it}/{i}" for i in range(shape.num_keys)]

    # gets read one fixed key set
    get_keys = fresh("get", 0)
    if raw.batch_put_from_multi_buffers(get_keys, src_ptrs, sizes) != [0] * shape.num_keys:
        raise BenchError("initial put failed (segment too small?)")

    def check(path: str) -> None:
        if not (torch.equal(dk, k) and torch.equal(dv, v)):
            raise BenchError(f"{path}: data read back differs")
        dk.zero_()
        dv.zero_()

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
                dk.copy_(k)
                dv.copy_(v)
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
    for t in (k, v, dk, dv):
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
    from connector.config import StoreConfig
    from connector.embedded import EmbeddedMooncake
    from connector.store import MooncakeStore

    div = 3 if args.quick else 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the memcpy baseline must not fight Mooncake's threads for 2 cores
    print(f"[bench.connector] store throughput: MooncakeStore vs raw Mooncake batch calls vs torch copy_ "
          f"(medians; per-iteration paired ratios; rotating order)", flush=True)
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


SUITES: dict[str, Callable[[argparse.Namespace], int]] = {"store": store_suite}


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
