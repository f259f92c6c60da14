"""Mooncake's disk tier at the store's API: a working set several times the memory segment, put once and read
back, side by side (docs/disk-tier.md). Same-run figures only, nothing asserted.

One private master per way (offload on where the way needs it), one `MooncakeStore` owning a segment of
`--segment-mib`, objects of `--object-mib` with distinct random bytes; a working set of `--mult` segments. Ways:

  memory        tier off: puts evict from memory
  tier-once     tier on, each put tried once (what a worker does today: NO_AVAILABLE_HANDLE is a lost save)
  tier-retry    tier on, a put that finds the segment full retried every `--retry-ms` until stored (bounded)

Per way: puts stored / failed, put wall, pass-2 objects read whole and byte-exact, wrong bytes, pass-2 read wall,
reads the master counts as served from disk (`file_cache_hit_nums_`). Pass 2 reads `--read-batch` keys per
call: one call's disk-resident objects must fit the owner's staging buffer (`disk_offload_staging_size`). The floor: a plain sequential read of the
same number of bytes from a file in the same directory, its pages dropped from the page cache first
(`posix_fadvise(DONTNEED)` after `fsync`).

    python -m bench.tier [--quick] [--mult 4 8] [--segment-mib 16] [--object-mib 1] [--read-batch 32] [--dir DIR]

The tier through vLLM's real Scheduler, 2 ranks, ours and upstream side by side: bench/tier_harness.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.store.embedded import EmbeddedMooncake

PUT_BOUND_S = 120.0


@dataclass
class Row:
    way: str
    mult: int
    stored: int
    failed: int
    put_s: float
    read_whole: int
    wrong_bytes: int
    read_s: float
    from_disk: float


def _metric(mc: EmbeddedMooncake, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{mc.metrics_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def run_way(way: str, mult: int, segment: int, obj: int, retry_s: float, base: str, read_batch: int) -> Row:
    n = mult * segment // obj
    tier = way != "memory"
    with EmbeddedMooncake(lease_ttl_ms=500, disk_offload=tier) as mc:
        cfg = StoreConfig(global_segment_size=segment, local_buffer_size=4 << 20, disk_offload=tier,
                          disk_offload_dir=base if tier else None)
        store = MooncakeStore.connect(cfg, embedded=mc)
        try:
            src = torch.randint(0, 256, (n, obj), dtype=torch.uint8, generator=torch.Generator().manual_seed(mult))
            dst = torch.zeros_like(src)
            store.register_buffer(src.data_ptr(), src.nbytes)
            store.register_buffer(dst.data_ptr(), dst.nbytes)
            keys = [f"tier-bench-{i}" for i in range(n)]
            t0 = time.monotonic()
            deadline = t0 + PUT_BOUND_S
            stored = 0
            for i, key in enumerate(keys):
                while True:
                    code = store.batch_put([key], [[src[i].data_ptr()]], [[obj]])[0]
                    if (way != "tier-retry" or code != StoreCode.NO_AVAILABLE_HANDLE
                            or time.monotonic() > deadline):
                        break
                    time.sleep(retry_s)
                stored += code == 0
            put_s = time.monotonic() - t0
            disk0 = _metric(mc, "file_cache_hit_nums_")
            t0 = time.monotonic()
            got: list[int] = []
            for a in range(0, n, read_batch):  # a batch's disk reads must fit the owner's staging buffer
                b = min(a + read_batch, n)
                got += store.batch_get(keys[a:b], [[dst[i].data_ptr()] for i in range(a, b)], [[obj]] * (b - a))
            read_s = time.monotonic() - t0
            whole = [i for i, g in enumerate(got) if g == obj]
            wrong = sum(int((dst[i] != src[i]).sum()) for i in whole)
            exact = sum(1 for i in whole if torch.equal(dst[i], src[i]))
            return Row(way, mult, stored, n - stored, put_s, exact, wrong, read_s,
                       _metric(mc, "file_cache_hit_nums_") - disk0)
        finally:
            store.close()


def floor_read_s(nbytes: int, base: str) -> float:
    """Seconds for a plain sequential read of `nbytes` from a file in `base`, its pages dropped first."""
    fd, path = tempfile.mkstemp(dir=base)
    try:
        block = os.urandom(1 << 20)
        for _ in range(nbytes >> 20):
            os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.monotonic()
        while os.read(fd, 1 << 20):
            pass
        return time.monotonic() - t0
    finally:
        os.close(fd)
        os.remove(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tier", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 4x working set only")
    ap.add_argument("--mult", type=int, nargs="+", default=[4, 8], help="working set in segments")
    ap.add_argument("--segment-mib", type=int, default=16)
    ap.add_argument("--object-mib", type=int, default=1)
    ap.add_argument("--retry-ms", type=int, default=50)
    ap.add_argument("--read-batch", type=int, default=32, help="keys per pass-2 batch_get (staging: 64 MiB)")
    ap.add_argument("--dir", default=None, help="where the tier's directories go (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mult = [4]
    segment, obj = args.segment_mib << 20, args.object_mib << 20
    with tempfile.TemporaryDirectory(prefix="bench-tier-", dir=args.dir) as base:
        os.chmod(base, 0o700)
        print("| way | working set | stored | failed puts | put s | pass 2 read whole, exact | wrong bytes "
              "| read s | MiB/s | from disk |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mult in args.mult:
            for way in ("memory", "tier-once", "tier-retry"):
                r = run_way(way, mult, segment, obj, args.retry_ms / 1000, base, args.read_batch)
                n = r.stored + r.failed
                mib = r.read_whole * obj / (1 << 20)
                print(f"| {r.way} | {mult}x ({n} objects) | {r.stored} | {r.failed} | {r.put_s:.2f} | "
                      f"{r.read_whole}/{n} | {r.wrong_bytes} | {r.read_s:.3f} | {mib / max(r.read_s, 1e-9):.0f} | "
                      f"{r.from_disk:.0f} |", flush=True)
            nbytes = mult * segment
            s = floor_read_s(nbytes, base)
            print(f"| floor: sequential file read | {mult}x | | | | | | {s:.3f} | {nbytes / (1 << 20) / s:.0f} | |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
