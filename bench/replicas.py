"""Identical KV stored once: what an MLA engine (and one whose KV heads vLLM replicates) puts into the store,
with the connector's default (`store_replicated_kv_once`: shared keys, each put by one rank) against every
rank storing its own copy (the option off, the keys of earlier versions). Same run, same harness, same
prompts; nothing asserted.

testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, KV caches from vLLM's allocator with a
tiny DeepSeek-V2 config, `MLAAttentionSpec`; or a Llama config with one KV head), 60 shared-prefix prompts
(64-token prefixes, 16-token suffixes) asked twice with `reset_prefix_cache` in between, on a private
Mooncake master. Per (model, TP size, way): keys stored, bytes put per prompt token (all ranks), the puts'
throughput per rank (put bytes over time inside `batch_put`, median over ranks), blocks loaded in pass 2,
wrong KV (S7) and the ratio of bytes put to the per-rank way's.

    python -m bench.replicas [--tp 2 4] [--kinds mla replicated]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

WAYS = ("per_rank", "once")


@dataclass
class Row:
    kind: str
    tp: int
    way: str
    keys: int
    bytes_per_token: float
    put_mb_s: float
    loaded_blocks: int
    wrong_kv: int


def run_once(kind: str, tp: int, way: str) -> Row:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.embedded import EmbeddedMooncake
    from testbed.emu_model import shared_prefix_prompts
    from testbed.harness import Harness

    prompts = shared_prefix_prompts(60, num_prefixes=6, prefix_len=64, suffix_len=16, seed=5)
    with EmbeddedMooncake() as mc:
        cfg = StoreConfig(global_segment_size=64 << 20).with_addresses(mc.master_address, mc.metadata_server)
        with Harness(cfg, tp_size=tp, num_blocks=64, kv_kind=kind, head_size=64,
                     extra={"store_replicated_kv_once": way == "once"}) as h:
            for p, tag in ((0, "a"), (1, "b")):
                for i, prompt in enumerate(prompts):
                    h.add_request(f"{tag}{i}", prompt, 4)
                h.run()
                if p == 0:
                    h.scheduler.reset_prefix_cache()
            totals = [w.stats.totals.data for w in h.workers]
            put_bytes = sum(t.get("put_bytes", 0) for t in totals)
            rates = [t.get("put_bytes", 0) / t["put_s"] / 1e6 for t in totals if t.get("put_s")]
            keys = {kb.key(bh) for pr in prompts for bh in h.block_hashes_of(pr) for kb in h.key_builders}
            present = h.checker().batch_is_exist(sorted(keys))
            return Row(kind, tp, way, sum(1 for c in present if c == 1),
                       put_bytes / sum(len(p) for p in prompts), statistics.median(rates) if rates else 0.0,
                       int(sum(t.get("get_keys", 0) for t in totals)) // tp, len(h.garbage))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--kinds", nargs="+", default=["mla", "replicated"], choices=["mla", "replicated"])
    args = ap.parse_args(argv)
    rows: list[Row] = []
    for kind in args.kinds:
        for tp in args.tp:
            for way in WAYS:
                rows.append(run_once(kind, tp, way))
                print(f"[bench.replicas] {kind} tp{tp} {way}: done", flush=True)
    print(f"\n{'model':<11} {'tp':>2} {'way':<9} {'keys':>5} {'put B/prompt tok':>16} {'put MB/s/rank':>13} "
          f"{'loaded blocks':>13} {'wrongKV':>7} {'bytes vs per_rank':>17}")
    base = {(r.kind, r.tp): r.bytes_per_token for r in rows if r.way == "per_rank"}
    for r in rows:
        ratio = r.bytes_per_token / base[(r.kind, r.tp)] if base.get((r.kind, r.tp)) else float("nan")
        print(f"{r.kind:<11} {r.tp:>2} {r.way:<9} {r.keys:>5} {r.bytes_per_token:>16.1f} {r.put_mb_s:>13.1f} "
              f"{r.loaded_blocks:>13} {r.wrong_kv:>7} {ratio:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
