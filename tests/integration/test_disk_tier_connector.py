"""Mooncake's disk tier through the connector: vLLM 0.32.0's real Scheduler (testbed.harness, 1 rank), the
connector's embedded default (it starts the master with ``--enable_offload=true`` and the worker's client owns a
16 MiB segment with the tier on, writing under ``disk_offload_dir``), real files (docs/disk-tier.md).

The stand-in model is sized so that one block of one rank is one 1 MiB object (4 layers x 8 KV heads x 256 x K|V
x 16 tokens x fp32, plus the integrity trailer): 8 prompts of 8 full blocks store 64 MiB, four times the
segment. A put that finds the segment full is retried (`full_put_retries`, `full_put_retry_ms`) while the tier
writes objects out; a load reads at most 63 keys per `batch_get`, as many as the owner's 64 MiB staging buffer
(`disk_offload_staging_size`) holds, so one batch's disk reads fit it (`load_batch_keys`).

- pass 2 after a prefix-cache reset loads blocks that memory no longer holds, read back from disk (the master's
  `file_cache_hit_nums_`), no KV read wrong (S7), outputs the model's; the same workload without the tier
  loads only what memory kept;
- an object corrupted in its file on disk is a load error, never loaded, and is removed.
"""
from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts
from testbed.procs import wait_until

SEGMENT = 16 << 20
BLOCKS_PER_PROMPT = 8
MODEL = dict(num_layers=4, num_kv_heads=8, head_size=256, num_blocks=40)  # one block: a 1 MiB object per rank
KEY_BYTES = 1 << 20
#: the defaults: full-segment retries 20 x 250 ms; 64 keys per batch get, which the connector shrinks to what
#: the 64 MiB staging buffer holds of this model's keys (`load_batch_keys`: 63 of 1 MiB + the trailer)
TIER_EXTRA: dict[str, Any] = {}
MAX_TOKENS = 4


def _prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts with no block in common: BLOCKS_PER_PROMPT full blocks each and a 4-token tail."""
    return shared_prefix_prompts(n, num_prefixes=n, prefix_len=BLOCKS_PER_PROMPT * 16, suffix_len=4, seed=seed)


def _config(tmp_path: Path, tier: bool) -> StoreConfig:
    kw: dict[str, Any] = {"disk_offload": True, "disk_offload_dir": str(tmp_path / "tier")} if tier else {}
    return StoreConfig(global_segment_size=SEGMENT, local_buffer_size=4 << 20, rpc_timeout_ms=2000, **kw)


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The embedded default publishes its servers and secret here, not in the user's runtime directory."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("KVLEDGER_RUNTIME_DIR", str(d))
    return d


def _master_metric(h: Harness, name: str) -> float:
    """A counter of the engine's embedded master (the one the connectors started), from its /metrics."""
    port = h.workers[0]._embedded.metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the master's /metrics")


def _bucket_of(directory: str, key: str) -> str | None:
    """The bucket file holding ``key`` (one object per bucket: its .meta names the key after the tenant,
    "default\\0<key>"; measured on 0.3.13), or None while not written."""
    want = b"\x00" + key.encode()
    for name in os.listdir(directory):
        if name.endswith(".meta"):
            with open(os.path.join(directory, name), "rb") as f:
                if want in f.read():
                    bucket = os.path.join(directory, name[:-len(".meta")] + ".bucket")
                    return bucket if os.path.exists(bucket) else None
    return None


def _flip(path: str, nbytes: int = 16) -> None:
    """Flip ``nbytes`` bytes in the middle of a file, in place (its object's KV bytes, not its header)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(nbytes)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())


class _RemoveSpy:
    """TEST SPY: the worker's store with every `remove` call recorded (key, force, code); changes nothing."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.removed: list[tuple[str, bool, int]] = []

    def remove(self, key: str, force: bool = False) -> int:
        code = self._store.remove(key, force)
        self.removed.append((key, force, code))
        return code

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _two_passes(tmp_path: Path, tier: bool, prompts: Sequence[list[int]]) -> dict[str, float]:
    """Pass 1, a prefix-cache reset, pass 2 (each checked: outputs, no KV read wrong, at rest); the figures."""
    with Harness(_config(tmp_path, tier), workdir=str(tmp_path / ("m-tier" if tier else "m-mem")),
                 extra=TIER_EXTRA if tier else {"load_sub_batch_keys": 16}, **MODEL) as h:
        w = h.workers[0].worker_side.steps
        ss = h.scheduler_connector.scheduler_side.steps
        assert w.key_bytes >= KEY_BYTES
        assert w.sub_batch == (63 if tier else 16)  # one batch's disk reads fit the owner's staging buffer
        t0 = time.monotonic()
        h.run_pass(list(prompts), MAX_TOKENS, tag="p1")
        pass1_s = time.monotonic() - t0
        stored1, failed1 = w.stats.total("put_keys"), w.stats.total("put_failed_keys")
        disk_files = disk_bytes = 0
        mine = h.workers[0].worker_side.io.store.offload_dir
        if tier:
            assert mine is not None and os.path.dirname(mine) == str(tmp_path / "tier")
            assert os.stat(mine).st_mode & 0o777 == 0o700
        if mine is not None:
            for name in os.listdir(mine):
                if name.endswith(".bucket"):
                    disk_files += 1
                    disk_bytes += os.path.getsize(os.path.join(mine, name))
        disk_reads = _master_metric(h, "file_cache_hit_nums_")
        gets, loaded = w.stats.total("get_keys"), ss.stats.total("loaded_tokens")
        h.reset_prefix_cache_when_idle()
        t0 = time.monotonic()
        h.run_pass(list(prompts), MAX_TOKENS, tag="p2")  # outputs the model's, no KV read wrong (S7), at rest
        pass2_s = time.monotonic() - t0
        from_disk = _master_metric(h, "file_cache_hit_nums_") - disk_reads
        checked, polluted = h.check_store()  # S1: every stored object (read back from disk too) is its block's KV
        assert polluted == 0
        return {
            "pass1_s": pass1_s, "pass2_s": pass2_s,
            "pass1_put_keys": stored1, "pass1_put_failed_keys": failed1,
            "full_put_retries": w.stats.total("full_put_retries"),
            "disk_files": disk_files, "disk_bytes": disk_bytes,
            "pass2_get_keys": w.stats.total("get_keys") - gets,
            "pass2_loaded_tokens": ss.stats.total("loaded_tokens") - loaded,
            "pass2_from_disk": from_disk,
            "load_errors": h.stats.load_error_blocks, "wrong_kv": len(h.garbage),
            "store_checked": checked,
        }


def test_pass_two_loads_blocks_evicted_from_memory_from_disk_and_memory_alone_loads_fewer(
        tmp_path: Path, runtime_dir: Path) -> None:
    prompts = _prompts(8, seed=36)
    n_keys = len(prompts) * BLOCKS_PER_PROMPT  # 64 x 1 MiB: four times the segment
    tier = _two_passes(tmp_path, True, prompts)
    memory = _two_passes(tmp_path, False, prompts)
    print(f"\n[disk tier] with the tier: {tier}\n[disk tier] memory alone: {memory}")
    assert tier["wrong_kv"] == memory["wrong_kv"] == 0 and tier["load_errors"] == 0
    # pass 1 wrote what memory cannot hold to disk
    assert tier["disk_bytes"] >= (n_keys - SEGMENT // KEY_BYTES) * KEY_BYTES
    # pass 2 loaded blocks that memory could not have held, read back from the tier's files
    assert tier["pass2_get_keys"] > SEGMENT // KEY_BYTES
    assert tier["pass2_from_disk"] >= tier["pass2_get_keys"] - SEGMENT // KEY_BYTES
    assert tier["pass2_loaded_tokens"] == tier["pass2_get_keys"] * 16
    # memory alone serves at most what its segment holds, and fewer than the tier
    assert memory["pass2_get_keys"] <= SEGMENT // KEY_BYTES
    assert memory["pass2_from_disk"] == 0 and memory["disk_files"] == 0
    assert memory["pass2_loaded_tokens"] < tier["pass2_loaded_tokens"]


def test_an_object_corrupted_on_disk_is_a_load_error_never_loaded_and_is_removed(
        tmp_path: Path, runtime_dir: Path) -> None:
    """Mooncake checks nothing it reads back from its files (docs/disk-tier.md): bytes flipped in the bucket
    file of a disk-resident object come back from `batch_get` as if whole. The connector's integrity trailer
    (the embedded default: 'mac') turns that into a load error; the block is recomputed, the object removed."""
    prompts = _prompts(4, seed=37)  # 32 x 1 MiB: the first prompt's blocks are on disk only by pass 2
    with Harness(_config(tmp_path, True), workdir=str(tmp_path / "m"), extra=TIER_EXTRA, **MODEL) as h:
        worker = h.workers[0]
        assert worker.integrity.mode == "mac"
        w = worker.worker_side.steps
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        mine = worker.worker_side.io.store.offload_dir
        assert mine is not None
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))[:BLOCKS_PER_PROMPT]
        assert h.workers[0].store.batch_is_exist(keys) == [1] * len(keys)
        # every block of the first prompt written to its file (bounded: the tier writes at each 1 s heartbeat)
        assert wait_until(lambda: all(_bucket_of(mine, k) is not None for k in keys), 15.0), \
            "the tier did not write the first prompt's objects to disk"
        buckets = {k: _bucket_of(mine, k) for k in keys}
        for path in buckets.values():
            assert path is not None
            _flip(path)
        spy = _RemoveSpy(worker.worker_side.io.store)
        worker.worker_side.io.store = spy
        disk_reads = _master_metric(h, "file_cache_hit_nums_")
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts[:1], MAX_TOKENS, tag="p2")  # outputs the model's, no KV read wrong (S7), at rest
        from_disk = _master_metric(h, "file_cache_hit_nums_") - disk_reads
        mismatches = w.stats.total("integrity_mismatches")
        print(f"\n[disk tier] corrupted {len(keys)} objects on disk: from disk {from_disk}, integrity mismatches "
              f"{mismatches}, load error blocks {h.stats.load_error_blocks}, removes {spy.removed}")
        assert from_disk >= 1, "the first prompt's load did not read from disk (its objects still in memory?)"
        assert mismatches >= 1 and h.stats.load_error_blocks >= 1 and h.garbage == []
        # each object that failed its tag was removed by force (the store answered 0), the first block's among
        # them; nothing else was removed
        removed = {k for k, force, code in spy.removed if force and code == 0}
        assert keys[0] in removed and len(removed) == mismatches
        assert {k for k, _, _ in spy.removed} <= set(keys)
        left = sorted(os.path.basename(p) for p in buckets.values() if p is not None and os.path.exists(p))
        print(f"[disk tier] corrupted bucket files still on disk after the removes: {len(left)} of {len(buckets)}")
        # what the store holds under those keys now (re-saved by the recompute, or nothing) is the block's KV
        checked, polluted = h.check_store()
        assert polluted == 0
