"""Mooncake's disk tier through vLLM 0.32's real Scheduler (testbed.harness, 2 TP ranks): ours and upstream's
`MooncakeStoreConnector` side by side in one run (docs/disk-tier.md). Same-run figures only, nothing asserted.

The workload: `--prompts` prompts (16; `--quick` 8) of 8 full blocks and a 4-token tail, no block in common,
4 tokens generated; the stand-in model of tests/integration/test_disk_tier_connector.py, whose block is one
1 MiB object per rank, so pass 1 stores 128 MiB per rank (8x a 16 MiB segment; `--quick` 4x). Pass 1, a
prefix-cache reset once idle (every save ended), pass 2 with the same prompts under new request ids. vLLM's
kv_load_failure_policy "recompute" (the harness's default): a failed load is recomputed, never an error. Before
pass 2 the tier's files are fsynced and their pages dropped from the page cache, so pass 2 reads them from
the device, as the floor does. Rows:

  mem512      ours, the embedded default, memory only, 512 MiB segment per rank (holds it all: the reference)
  mem16       ours, memory only, 16 MiB per rank
  tier16      ours, 16 MiB per rank + `disk_offload` (the connectors start the master with the tier; each rank's
              client writes its own directory; a put that finds the segment full is retried,
              `full_put_retries` x `full_put_retry_ms`; keys per `batch_get` as many as the owner's staging
              buffer holds for both ranks, `load_batch_keys`). Ours runs at its defaults throughout
  upstream16  vLLM's MooncakeStoreConnector with `enable_offload`, in its standalone-store topology (its
              embedded mode never passes enable_ssd_offload to setup(), so only this one reaches disk): one
              `mooncake_client` holder of 16 MiB per rank with the tier on (`EmbeddedMooncake.start_holder`,
              `offload_environment`: the tier settings of tier16), the ranks requesters (segment 0), on a master
              the bench starts with --enable_offload
  upstream16-emb  upstream in its embedded mode (16 MiB per rank), `enable_offload` set as its docs say, on a
              master with the tier: its workers never pass enable_ssd_offload to setup(), so this is memory only
  ours16-ss   ours in the standalone-store topology, against holders of its own (`--no-ss` leaves it out)

Per row: tokens vLLM accepted from the connector in pass 2 (`update_state_after_alloc` at each request's first
admission, bench.scheduler's `Probe`) and as % of mem512's,
pass 1's distinct keys whose last put stored / failed (summed over ranks, counted under each rank's raw client:
retried keys once), ours' `full_put_retries`, MiB in the tier's files after pass 1, pass 2's reads the master
served from disk (`file_cache_hit_nums_`), bytes the processes (this one and the holders) read from the
device in pass 2 (/proc/<pid>/io read_bytes), pass 1 and pass 2 wall seconds, wrong KV (S7, `h.garbage`) and
outputs that differ from the model's, load-error blocks. Per rank: pass 2's bytes loaded, the seconds inside its
get calls, their rate against the floor: a plain sequential read of as many bytes from a file in the same
directory, its pages dropped first (bench.tier.floor_read_s). The master does not say which rank's reads
came from disk, so the rate is of all of a rank's loads; the row's from-disk share is beside it.

    python -m bench.tier_harness [--quick] [--prompts N] [--rows ROW ...] [--no-ss] [--forward-ms MS] [--dir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "2")

from bench.tier import _metric, floor_read_s  # noqa: E402
from kvledger_connector.config import StoreConfig  # noqa: E402
from kvledger_connector.store.contract import StoreCode  # noqa: E402
from kvledger_connector.store.tier import make_offload_dir, offload_environment  # noqa: E402
from kvledger_connector.store.embedded import EmbeddedMooncake  # noqa: E402

TP = 2
SEGMENT = 16 << 20
REFERENCE_SEGMENT = 512 << 20
BLOCKS_PER_PROMPT = 8
#: tests/integration/test_disk_tier_connector.py's stand-in: one block of one rank is a 1 MiB object
MODEL: dict[str, int] = dict(num_layers=4, num_kv_heads=8, head_size=256, num_blocks=40)
MAX_TOKENS = 4
ROWS = ("mem512", "mem16", "tier16", "upstream16", "upstream16-emb", "ours16-ss")
TARGET = 0.80  # tier16's pass-2 tokens / mem512's: printed, never asserted
UPSTREAM_MEASURED = "71-73% at TP 2"


class RawLog:
    """BENCH PROBE under one rank's raw Mooncake client (below testbed.faults' forwarding wrapper, so ours and
    upstream are counted alike): each key's last put code, and while `reading` the get calls' keys, bytes
    and seconds. Forwards every call unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.last_put: dict[str, int] = {}
        self.reading = False
        self.get_keys = self.get_bytes = 0
        self.get_s = 0.0

    def batch_put_from_multi_buffers(self, keys: Sequence[str], *args: Any) -> Any:
        res = self.inner.batch_put_from_multi_buffers(keys, *args)
        with self.lock:
            for k, c in zip(keys, res):
                self.last_put[k] = int(c)
        return res

    def batch_get_into_multi_buffers(self, keys: Sequence[str], *args: Any) -> Any:
        t0 = time.perf_counter()
        res = self.inner.batch_get_into_multi_buffers(keys, *args)
        dt = time.perf_counter() - t0
        if self.reading:
            with self.lock:
                self.get_s += dt
                self.get_keys += sum(1 for c in res if c > 0)
                self.get_bytes += sum(int(c) for c in res if c > 0)
        return res

    def puts(self) -> tuple[int, int]:
        """(keys stored, keys failed) by their last put (OBJECT_ALREADY_EXISTS: stored by another put)."""
        ok = sum(1 for c in self.last_put.values() if c in (0, StoreCode.OBJECT_ALREADY_EXISTS))
        return ok, len(self.last_put) - ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Row:
    name: str
    topology: str
    p2_tokens: int = 0
    stored: int = 0
    failed: int = 0
    retries: int | None = None
    disk_bytes: int | None = None  # None: no tier directory
    from_disk: float = 0.0
    dev_read: int = 0
    pass1_s: float = 0.0
    pass2_s: float = 0.0
    wrong_kv: int = 0
    wrong_out: int = 0
    load_errors: int = 0
    ranks: list[tuple[int, float]] = field(default_factory=list)  # per rank: pass-2 bytes loaded, get seconds
    failed_why: str = ""


@contextlib.contextmanager
def upstream_config_keys(**keys: Any) -> Iterator[None]:
    """BENCH DOUBLE: the harness writes upstream's MOONCAKE_CONFIG_PATH file with the fields every topology
    has (testbed.upstream.write_config); while open, `keys` (upstream's `mode`, `enable_offload`) are added to
    that file, as an operator writes them, before vLLM's MooncakeStoreConfig.from_file reads it."""
    from testbed import upstream
    plain = upstream.write_config

    def write(path: str, *a: Any, **kw: Any) -> str:
        plain(path, *a, **kw)
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(keys)
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path
    upstream.write_config = write  # type: ignore[assignment]
    try:
        yield
    finally:
        upstream.write_config = plain  # type: ignore[assignment]


def prompts_of(n: int, seed: int = 36) -> list[list[int]]:
    """n prompts with no block in common: BLOCKS_PER_PROMPT full blocks each and a 4-token tail."""
    from testbed.harness import shared_prefix_prompts
    return shared_prefix_prompts(n, num_prefixes=n, prefix_len=BLOCKS_PER_PROMPT * 16, suffix_len=4, seed=seed)


def _bucket_files(dirs: Sequence[str]) -> list[str]:
    return [os.path.join(d, n) for d in dirs if os.path.isdir(d) for n in os.listdir(d)]


def tier_bytes(dirs: Sequence[str]) -> int:
    return sum(os.path.getsize(p) for p in _bucket_files(dirs) if p.endswith(".bucket") and os.path.isfile(p))


def drop_pages(dirs: Sequence[str]) -> None:
    """Every file of the tier written back and its pages dropped from the page cache (contents unchanged), so
    pass 2 reads them from the device, as the floor does."""
    for p in _bucket_files(dirs):
        with contextlib.suppress(OSError):  # a file the tier replaces meanwhile
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def device_reads(pids: Sequence[int]) -> int:
    """Bytes these processes have read from the block layer (/proc/<pid>/io read_bytes: not page-cache hits)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return total


def _pass(h: Any, prompts: list[list[int]], tag: str) -> tuple[float, int]:
    """One pass (`<tag>-<i>` per prompt) to the end: wall seconds, outputs that differ from the model's."""
    from testbed.harness import expected_output
    for i, p in enumerate(prompts):
        h.add_request(f"{tag}-{i}", p, MAX_TOKENS)
    t0 = time.monotonic()
    h.run(max_steps=200_000, timeout_s=600)
    wall = time.monotonic() - t0
    outputs = h.stats.outputs
    return wall, sum(1 for i, p in enumerate(prompts) if outputs.get(f"{tag}-{i}") != expected_output(p, MAX_TOKENS))


def _point(raws: list[Any], inners: list[Any]) -> None:
    """Each rank's forwarding wrapper onto its new inner client (no reference left here: a tier client
    unmounts only when freed, which must happen while its master is up)."""
    for raw, inner in zip(raws, inners):
        raw.inner = inner


def _reading(logs: list[RawLog], on: bool) -> None:
    for log in logs:  # not in run_row: a loop variable there would keep a client alive past its master
        log.reading = on


def run_row(name: str, prompts: list[list[int]], base: str, forward_s: float = 0.0) -> Row:
    from bench.scheduler import Probe
    from testbed.faults import wrap_raw_clients
    from testbed.harness import Harness
    standalone = name in ("upstream16", "ours16-ss")
    connector = "upstream" if name.startswith("upstream") else "ours"
    where = os.path.join(base, name)  # the row's disk_offload_dir
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, where, True)  # last: after the holders that write there are stopped
        master: Any = None
        dirs: list[str] = []
        pids = [os.getpid()]
        if connector == "upstream" or standalone:  # upstream needs a running master (the harness's rule)
            master = stack.enter_context(EmbeddedMooncake(disk_offload=True))
        if standalone:
            holder = StoreConfig(global_segment_size=SEGMENT, disk_offload=True, disk_offload_dir=where)
            for _ in range(TP):  # one holder per rank: the memory and the tier directories of tier16
                dirs.append(make_offload_dir(holder))
                pids.append(master.start_holder(SEGMENT, offload_env=offload_environment(holder, dirs[-1])))
            cfg = StoreConfig(global_segment_size=0, local_buffer_size=4 << 20, rpc_timeout_ms=2000,
                              disk_offload=True).with_addresses(master.master_address, master.metadata_server)
            topology = f"standalone-store: {TP} holders x 16 MiB + tier, ranks segment 0"
            if connector == "upstream":
                stack.enter_context(upstream_config_keys(mode="standalone-store", enable_offload=True))
        elif connector == "upstream":  # its embedded mode: enable_offload set, setup() never told of it
            cfg = StoreConfig(global_segment_size=SEGMENT, local_buffer_size=4 << 20, rpc_timeout_ms=2000
                              ).with_addresses(master.master_address, master.metadata_server)
            topology = "embedded: 16 MiB per rank, enable_offload"
            stack.enter_context(upstream_config_keys(mode="embedded", enable_offload=True))
        else:
            tier = name == "tier16"
            seg = REFERENCE_SEGMENT if name == "mem512" else SEGMENT
            cfg = StoreConfig(global_segment_size=seg, local_buffer_size=4 << 20, rpc_timeout_ms=2000,
                              **({"disk_offload": True, "disk_offload_dir": where} if tier else {}))
            topology = f"embedded: {seg >> 20} MiB per rank" + (" + tier" if tier else "")
        h = stack.enter_context(Harness(cfg, tp_size=TP, connector=connector, workdir=stack.enter_context(
            tempfile.TemporaryDirectory(prefix=f"work-{name}-", dir=base)),
            stall_timeout_s=120, forward_s=forward_s, **MODEL))
        row = Row(name, topology)
        probe = Probe(h).install()  # the tokens vLLM accepts from the connector ("p2-*": pass 2's)
        raws = wrap_raw_clients(h)  # forwarding wrappers under each rank, no fault
        logs = [RawLog(raw.inner) for raw in raws]
        _point(raws, logs)
        try:
            if connector == "ours":
                row.topology += f", {h.workers[0].worker_side.steps.sub_batch} keys per get"
            if connector == "ours" and not standalone:
                master = h.workers[0]._embedded
                dirs = [d for w in h.workers if (d := w.worker_side.io.store.offload_dir) is not None]
            row.pass1_s, wrong1 = _pass(h, prompts, "p1")  # to the end of its saves (has_pending_push_work)
            h.reset_prefix_cache_when_idle()
            row.stored, row.failed = (sum(x) for x in zip(*(log.puts() for log in logs)))
            if connector == "ours":
                row.retries = sum(w.worker_side.steps.stats.total("full_put_retries") for w in h.workers)
            row.disk_bytes = tier_bytes(dirs) if dirs else None
            drop_pages(dirs)
            disk0, dev0, err0 = _metric(master, "file_cache_hit_nums_"), device_reads(pids), h.stats.load_error_blocks
            _reading(logs, True)
            row.pass2_s, wrong2 = _pass(h, prompts, "p2")
            _reading(logs, False)
            row.from_disk = _metric(master, "file_cache_hit_nums_") - disk0
            row.dev_read = device_reads(pids) - dev0
            row.p2_tokens = sum(probe.p2_first_tokens.values())  # at each request's first admission
            row.load_errors = h.stats.load_error_blocks - err0
            row.wrong_kv, row.wrong_out = len(h.garbage), wrong1 + wrong2
            row.ranks = [(log.get_bytes, log.get_s) for log in logs]
        finally:  # unwrapped: the real clients must go with their connectors (a tier client closes when freed)
            _point(raws, [log.inner for log in logs])
            del raws, logs
    return row


def _mib(n: float) -> float:
    return n / (1 << 20)


def print_table(rows: list[Row], base: str, n_prompts: int) -> None:
    ref = next((r for r in rows if r.name == "mem512" and not r.failed_why), None)
    keys = n_prompts * BLOCKS_PER_PROMPT
    print(f"\n{n_prompts} prompts x {BLOCKS_PER_PROMPT} full blocks (+ a 4-token tail) x {TP} ranks, 1 MiB per block "
          f"per rank: {keys} MiB per rank, {keys * 16} full-block tokens per pass ({keys * (1 << 20) // SEGMENT}x a "
          f"16 MiB segment); two passes, reset_prefix_cache between")
    print("| row | topology | pass 2 tokens loaded | % of mem512 | pass 1 keys stored / failed | full-put retries "
          "| tier files MiB | pass 2 reads from disk | pass 2 device reads MiB | pass 1 s | pass 2 s | wrong KV "
          "| wrong outputs | load-error blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.failed_why:
            print(f"| {r.name} | {r.topology} | failed: {r.failed_why} |")
            continue
        pct = f"{100 * r.p2_tokens / ref.p2_tokens:.0f}%" if ref and ref.p2_tokens else "-"
        disk = "-" if r.disk_bytes is None else f"{_mib(r.disk_bytes):.0f}"
        print(f"| {r.name} | {r.topology} | {r.p2_tokens} | {pct} | {r.stored} / {r.failed} | "
              f"{'-' if r.retries is None else r.retries} | {disk} | {r.from_disk:.0f} | "
              f"{_mib(r.dev_read):.0f} | {r.pass1_s:.1f} | {r.pass2_s:.1f} | {r.wrong_kv} | {r.wrong_out} | "
              f"{r.load_errors} |", flush=True)
    print("\nPer rank: all of its pass-2 loads (memory and disk: the master does not say which rank's reads came "
          "from disk); the floor reads as many bytes from a file beside the tier's, its pages dropped first.")
    print("| row | rank | pass 2 MiB loaded | s in get calls | MiB/s | floor MiB/s (same bytes, cold file) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for rank, (nbytes, secs) in enumerate(r.ranks):
            if nbytes < (1 << 20):
                print(f"| {r.name} | {rank} | {_mib(nbytes):.0f} | {secs:.2f} | - | - |")
                continue
            floor = _mib(nbytes & ~((1 << 20) - 1)) / floor_read_s(nbytes, base)
            print(f"| {r.name} | {rank} | {_mib(nbytes):.0f} | {secs:.2f} | {_mib(nbytes) / max(secs, 1e-9):.0f} "
                  f"| {floor:.0f} |", flush=True)
    tier = next((r for r in rows if r.name == "tier16" and not r.failed_why), None)
    if ref and tier and ref.p2_tokens:
        share = tier.p2_tokens / ref.p2_tokens
        print(f"\ntier16 pass 2: {100 * share:.0f}% of mem512's tokens (target >= {100 * TARGET:.0f}%: "
              f"{'met' if share >= TARGET else 'NOT met'}; upstream measured {UPSTREAM_MEASURED})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tier_harness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 prompts (4x the segment) instead of 16 (8x)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per pass (overrides --quick)")
    ap.add_argument("--rows", nargs="*", choices=ROWS, default=None, help="only these rows")
    ap.add_argument("--no-ss", action="store_true", help="leave out ours16-ss")
    ap.add_argument("--dir", default=None, help="where the tier's directories go (default: a temporary one)")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="the stand-in model's time per engine step (paces the saves; default 0, as the tests)")
    args = ap.parse_args(argv)
    n = args.prompts or (8 if args.quick else 16)
    names = [r for r in (args.rows or ROWS) if not (args.no_ss and r == "ours16-ss")]
    prompts = prompts_of(n)
    rc = 0
    rows: list[Row] = []
    old_runtime = os.environ.get("KVLEDGER_RUNTIME_DIR")
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-tier-harness-", dir=args.dir) as base:
        os.chmod(base, 0o700)
        run_dir = os.path.join(base, "run")  # the embedded default's rendezvous and secret: private to the run
        os.mkdir(run_dir, 0o700)
        os.environ["KVLEDGER_RUNTIME_DIR"] = run_dir
        try:
            for name in names:
                t0 = time.monotonic()
                try:
                    row = run_row(name, prompts, base, args.forward_ms / 1000)
                except Exception as e:  # a bench: say what failed and go on
                    row = Row(name, "", failed_why=f"{type(e).__name__}: {e}"[:400])
                    rc |= int(not name.startswith("upstream"))
                rows.append(row)
                rc |= int(row.wrong_kv + row.wrong_out > 0)
                print(f"[bench.tier_harness] {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
            print_table(rows, base, n)
        finally:
            if old_runtime is None:
                os.environ.pop("KVLEDGER_RUNTIME_DIR", None)
            else:
                os.environ["KVLEDGER_RUNTIME_DIR"] = old_runtime
    print(f"[bench.tier_harness] {time.monotonic() - t_all:.0f} s in all", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
