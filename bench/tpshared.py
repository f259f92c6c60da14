"""The TP-shared store layout (`kv_heads_per_key`): what a TP 2 engine's saves cost and what they give
engines of other TP sizes, against the default keys per TP shard. Same run, same harness, same prompts;
nothing asserted.

testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, KV caches from vLLM's allocator, a Llama
config with 8 KV heads of 64, layouts LBNHC and LHBNC), 48 shared-prefix prompts (64-token prefixes, 16-token suffixes):
a TP 2 engine serves them once and stays up (its ranks' segments hold what it stored), then a TP 1 and a
TP 4 engine of the same model serve them, each on an empty local cache. Per way (`per_shard`: the default
keys; `heads/k`: `kv_heads_per_key` = k): the TP 2 engine's keys stored (the run's own master, from its HTTP
`/get_all_keys`), bytes put per prompt token, its puts' throughput per rank (put bytes over time inside the
store's batch put call, median over ranks), then for each other TP size the prompt tokens it found in the
store (`loaded_tokens`) and its wrong KV (S7).

    python -m bench.tpshared [--ways per_shard heads/1 heads/2] [--layouts LBNHC LHBNC]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

HEADS = 8
WAYS = ("per_shard", "heads/1", "heads/2")


@dataclass
class Row:
    layout: str
    way: str
    keys: int
    bytes_per_token: float
    put_mb_s: float
    loaded: dict[int, tuple[int, int]] = field(default_factory=dict)  # tp -> (loaded tokens, wrong KV)


def run_once(layout: str, way: str) -> Row:
    from bench.replicas import stored_keys
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.emu_model import shared_prefix_prompts
    from testbed.harness import Harness

    prompts = shared_prefix_prompts(48, num_prefixes=6, prefix_len=64, suffix_len=16, seed=5)
    extra: dict[str, Any] = {} if way == "per_shard" else {"kv_heads_per_key": int(way.split("/")[1])}
    with EmbeddedMooncake() as mc, tempfile.TemporaryDirectory(prefix="bench-tpshared-") as workdir:
        cfg = StoreConfig(global_segment_size=64 << 20).with_addresses(mc.master_address, mc.metadata_server)

        def harness(tp: int) -> Harness:
            return Harness(cfg, tp_size=tp, num_kv_heads=HEADS // tp, head_size=64, num_blocks=64,
                           workdir=workdir, kv_layout=layout, extra=extra)

        with harness(2) as h2:
            for i, p in enumerate(prompts):
                h2.add_request(f"a{i}", p, 4)
            h2.run()
            totals = [w.stats.totals.data for w in h2.workers]
            rates = [t.get("put_bytes", 0) / t["put_s"] / 1e6 for t in totals if t.get("put_s")]
            row = Row(layout, way, len(stored_keys(mc.metrics_port)),
                      sum(t.get("put_bytes", 0) for t in totals) / sum(len(p) for p in prompts),
                      statistics.median(rates) if rates else 0.0)
            for tp in (1, 4):
                with harness(tp) as h:
                    for i, p in enumerate(prompts):
                        h.add_request(f"b{i}", p, 4)
                    h.run()
                    row.loaded[tp] = (int(h.scheduler_connector.stats.total("loaded_tokens")), len(h.garbage))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tpshared", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--layouts", nargs="+", default=["LBNHC", "LHBNC"])
    args = ap.parse_args(argv)
    rows = []
    for layout in args.layouts:
        for way in args.ways:
            rows.append(run_once(layout, way))
            print(f"[bench.tpshared] {layout} {way}: done", flush=True)
    base = {r.layout: r for r in rows if r.way == "per_shard"}
    print(f"\n{'layout':<6} {'way':<10} {'keys':>5} {'put B/prompt tok':>16} {'put MB/s/rank':>13} {'vs per_shard':>12} "
          f"{'TP1 loaded tok':>14} {'TP4 loaded tok':>14} {'wrongKV':>7}")
    for r in rows:
        b = base.get(r.layout)
        ratio = r.put_mb_s / b.put_mb_s if b is not None and b.put_mb_s else float("nan")
        print(f"{r.layout:<6} {r.way:<10} {r.keys:>5} {r.bytes_per_token:>16.1f} {r.put_mb_s:>13.1f} {ratio:>12.2f} "
              f"{r.loaded[1][0]:>14} {r.loaded[4][0]:>14} {r.loaded[1][1] + r.loaded[4][1]:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
