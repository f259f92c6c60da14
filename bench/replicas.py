"""Identical KV stored once: what an MLA engine (and one whose KV heads vLLM replicates) puts into the store,
with the connector's default (`store_replicated_kv_once`: shared keys, each put by one rank) against every
rank storing its own copy (the option off, the keys of earlier versions) and against upstream vLLM 0.32's
`MooncakeStoreConnector` (its worker handlers on the same allocator-built KV caches, testbed/upstream.py).
Same run, same harness, same prompts; nothing asserted.

testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, KV caches from vLLM's allocator with a
tiny DeepSeek-V2 config, `MLAAttentionSpec`; or a Llama config with one KV head), 60 shared-prefix prompts
(64-token prefixes, 16-token suffixes) asked twice with `reset_prefix_cache` in between, on a private
Mooncake master. Per (model, TP size, way): keys stored (every key on the run's own master, from its HTTP
`/get_all_keys`), bytes put per prompt token (all ranks), the puts' throughput per rank (put bytes over time
inside the store's batch put call, median over ranks), blocks loaded in pass 2, wrong KV (S7) and the ratio
of bytes put to the per-rank way's. Upstream's puts and gets are counted by a proxy in front of each worker
thread's store client that times and forwards every call (measurement only: no call is changed).

    python -m bench.replicas [--tp 2 4] [--kinds mla replicated] [--ways per_rank once once_off upstream]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

WAYS = ("per_rank", "once", "once_off", "upstream")  # once_off: the default without the integrity tag


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


class _TimedStore:
    """Forwards every call to upstream's store client; sums the bytes and seconds of its batch puts and the
    keys of its batch gets (what ours counts in its own stats)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.put_bytes = 0
        self.put_s = 0.0
        self.get_keys = 0

    def batch_put_from_multi_buffers(self, keys: Any, addrs: Any, sizes: Any, *rest: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._store.batch_put_from_multi_buffers(keys, addrs, sizes, *rest)
        finally:
            self.put_s += time.perf_counter() - t0
            self.put_bytes += sum(sum(s) for s in sizes)

    def batch_get_into_multi_buffers(self, keys: Any, *rest: Any) -> Any:
        self.get_keys += len(keys)
        return self._store.batch_get_into_multi_buffers(keys, *rest)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _timed_upstream(worker: Any) -> list[_TimedStore]:
    cw = worker.connector_worker
    threads = [cw.kv_send_thread, *cw.kv_recv_threads]
    proxies = []
    for t in threads:
        t.store = _TimedStore(t.store)
        proxies.append(t.store)
    return proxies


def stored_keys(metrics_port: int) -> set[str]:
    """Every key on the master (this run's own): its HTTP `/get_all_keys`, one key per line."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/get_all_keys", timeout=30) as r:
        return {line.strip() for line in r.read().decode().splitlines() if line.strip()}


def run_once(kind: str, tp: int, way: str) -> Row:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.emu_model import shared_prefix_prompts
    from testbed.harness import Harness

    prompts = shared_prefix_prompts(60, num_prefixes=6, prefix_len=64, suffix_len=16, seed=5)
    with EmbeddedMooncake() as mc:
        cfg = StoreConfig(global_segment_size=64 << 20).with_addresses(mc.master_address, mc.metadata_server)
        kw: dict[str, Any] = ({"connector": "upstream"} if way == "upstream" else
                              {"extra": {"store_replicated_kv_once": way != "per_rank",
                                         "integrity": "off" if way == "once_off" else "checksum"}})
        with Harness(cfg, tp_size=tp, num_blocks=64, kv_kind=kind, head_size=64, **kw) as h:
            proxies = [_timed_upstream(w) for w in h.workers] if way == "upstream" else []
            for p, tag in ((0, "a"), (1, "b")):
                for i, prompt in enumerate(prompts):
                    h.add_request(f"{tag}{i}", prompt, 4)
                h.run()
                if p == 0:
                    h.scheduler.reset_prefix_cache()
            if proxies:
                totals = [{"put_bytes": sum(x.put_bytes for x in ps), "put_s": sum(x.put_s for x in ps),
                           "get_keys": sum(x.get_keys for x in ps)} for ps in proxies]
            else:
                totals = [w.stats.totals.data for w in h.workers]
            put_bytes = sum(t.get("put_bytes", 0) for t in totals)
            rates = [t.get("put_bytes", 0) / t["put_s"] / 1e6 for t in totals if t.get("put_s")]
            return Row(kind, tp, way, len(stored_keys(mc.metrics_port)),
                       put_bytes / sum(len(p) for p in prompts), statistics.median(rates) if rates else 0.0,
                       int(sum(t.get("get_keys", 0) for t in totals)) // tp, len(h.garbage))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--kinds", nargs="+", default=["mla", "replicated"], choices=["mla", "replicated"])
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    args = ap.parse_args(argv)
    rows: list[Row] = []
    for kind in args.kinds:
        for tp in args.tp:
            for way in args.ways:
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
