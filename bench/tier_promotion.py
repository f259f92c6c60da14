"""Mooncake's promotion on hit: does a key read from the disk tier come back to memory, and how fast are the
reads after it (docs/disk-tier.md)? At the store's API, one private master per way, nothing asserted.

A working set four times a 16 MiB segment of 1 MiB objects is put (a put finding the segment full is retried
while the tier writes objects out), then the first 8 objects, on disk only by then, are read `--reads` times,
`--gap-s` apart (promotions run at the owner's heartbeats, 1 s). Ways, by the master's flags:

  off              no promotion (Mooncake's default)
  default          --promotion_on_hit: Mooncake's gating (a key's second read; 1 promotion per heartbeat)
  second-touch-64  and --promotion_max_per_heartbeat=64
  first-touch-64   and --promotion_admission_threshold=1 (every read key)

Per read: keys read whole and exact, wall ms and MiB/s.

    python -m bench.tier_promotion [--reads 4] [--gap-s 2.5]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.store.embedded import EmbeddedMooncake

SEGMENT, OBJECT, MULT, READ_KEYS = 16 << 20, 1 << 20, 4, 8
PUT_BOUND_S = 120.0
WAYS: dict[str, tuple[str, ...]] = {
    "off": (),
    "default": ("--promotion_on_hit=true",),
    "second-touch-64": ("--promotion_on_hit=true", "--promotion_max_per_heartbeat=64"),
    "first-touch-64": ("--promotion_on_hit=true", "--promotion_max_per_heartbeat=64",
                       "--promotion_admission_threshold=1"),
}


def run_way(flags: tuple[str, ...], base: str, reads: int, gap_s: float) -> list[tuple[int, float]]:
    """(keys read whole and exact, seconds) of each read of the first READ_KEYS objects."""
    n = MULT * SEGMENT // OBJECT
    with EmbeddedMooncake(lease_ttl_ms=500, disk_offload=True, extra_master_flags=flags) as mc:
        cfg = StoreConfig(global_segment_size=SEGMENT, local_buffer_size=4 << 20, disk_offload=True,
                          disk_offload_dir=base)
        store = MooncakeStore.connect(cfg, embedded=mc)
        try:
            src = torch.randint(0, 256, (n, OBJECT), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
            dst = torch.zeros((READ_KEYS, OBJECT), dtype=torch.uint8)
            store.register_buffer(src.data_ptr(), src.nbytes)
            store.register_buffer(dst.data_ptr(), dst.nbytes)
            keys = [f"promotion-{i}" for i in range(n)]
            deadline = time.monotonic() + PUT_BOUND_S
            for i, key in enumerate(keys):
                while (store.batch_put([key], [[src[i].data_ptr()]], [[OBJECT]])[0] == StoreCode.NO_AVAILABLE_HANDLE
                       and time.monotonic() < deadline):
                    time.sleep(0.05)
            time.sleep(2.0)  # two heartbeats: the first objects are on disk and out of memory
            out: list[tuple[int, float]] = []
            for r in range(reads):
                dst.zero_()
                t0 = time.perf_counter()
                got = store.batch_get(keys[:READ_KEYS], [[dst[i].data_ptr()] for i in range(READ_KEYS)],
                                      [[OBJECT]] * READ_KEYS)
                s = time.perf_counter() - t0
                exact = sum(1 for i, g in enumerate(got) if g == OBJECT and torch.equal(dst[i], src[i]))
                out.append((exact, s))
                if r + 1 < reads:
                    time.sleep(gap_s)  # heartbeats, at which the owner runs the promotions it was given
            return out
        finally:
            store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tier_promotion", description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=2.5)
    args = ap.parse_args(argv)
    print("| way | " + " | ".join(f"read {r + 1}: exact, ms, MiB/s" for r in range(args.reads)) + " |")
    print("|---|" + "---|" * args.reads)
    for way, flags in WAYS.items():
        with tempfile.TemporaryDirectory(prefix="bench-promotion-") as base:
            res = run_way(flags, base, args.reads, args.gap_s)
        cells = [f"{k}/{READ_KEYS}, {s * 1000:.1f}, {READ_KEYS * OBJECT / (1 << 20) / s:.0f}" for k, s in res]
        print(f"| {way} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
