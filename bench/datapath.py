"""Worker data-path benchmark, side by side in one run: save and load GB/s of a
batch of KV blocks, six paths measured in one run on the same Mooncake client, rotating order.

Caches come from vLLM's own allocator (testbed.kvcache: `build_kv_cache_config` + `allocate`) for a
realistic model shape, 32 layers x 8 KV heads x head size 128, block size 16, bf16 (2 MiB per block),
one cache per `KVCacheLayout` in `LAYOUTS`; a batch is 64 blocks (block ids 1..64; 0 is vLLM's null
block; ``--blocks`` sets another count), one key per block.

  ours      our worker path: a `KVLedgerConnector` (WORKER role, given the benchmark's store) registers
            vLLM's views (`register_kv_caches`: spec check + copy plan), then the timed call is
            `WorkerSide._handle_save(spec)` / `_handle_load(spec)`, the very handlers the store and load
            threads run, called on the benchmark thread (the worker threads stay idle). A save includes
            its `batch_is_exist` check, the ledger's begin/record/finish and the copy plan's per-block
            buffers; a load its sub-batching and ledger accounting. With the connector's default
            integrity: no master is configured here, so "mac" under a secret generated for the engine,
            with the tag construction for host KV (keyed BLAKE3, computed off the GIL): each put computes
            its blocks' tags and sends the trailers, each get checks them (kvledger_connector/shape/integrity.py).
            The header line says what the connector resolved.
  ours-ck   the same worker with an integrity "checksum" seal (the default beside a configured master: on host
            KV XXH3-128, no key); "ck/off" is its ratio to ours-off, as "ours/off" is the default's.
  ours-mm8  the same worker with ours's mode in the construction GPU KV gets (an int8 matmul in torch;
            what host KV got before BLAKE3): what the change bought, in the same run.
  ours-off  the same worker with no seal (integrity "off"): no tag, the objects of earlier versions. Its
            ratios to raw and upstream are like for like (neither tags anything). "ours/off" is what the
            default keeps of the untagged rate (throughput ratio, paired per iteration; target >= 0.6);
            "cost" what a tag adds: time(way) / time(ours-off) - 1, paired per iteration.
  floor     not a path: one keyed BLAKE3 call per block over raw's contiguous buffer (no copy plan, no
            gather), timed once per iteration. The floor of ours/off is time(off) / (time(off) + that):
            the tag's unavoidable cost, one more read of the bytes at the hash's rate on one core.
  upstream  vLLM 0.32's `MooncakeStoreConnector` worker path on the same tensors. `MooncakeStoreWorker`
            cannot be constructed here: its `__init__` needs vLLM's distributed groups (TP/PCP/DCP) and
            starts its own Mooncake client, whose segment would make the placement of puts differ from
            the other paths. So its `__init__` is skipped and the attributes it would set for TP=1,
            PP=1, no PCP/DCP are set on the instance; then its own code runs: `_select_store_layout`,
            `_compute_group_tp_replication_factors`, `_build_token_databases`,
            `MooncakeStoreCoordinator.from_kv_cache_config` and `MooncakeStoreWorker.register_kv_caches`
            (buffer registration + its `RankLocalStoreLayout` addresses; no thread started). The timed call
            is `KVCacheStoreSendingThread._handle_request` / `KVCacheStoreRecvingThread._handle_request`
            on thread objects built as `register_kv_caches` builds them, never started: the request is put
            on the thread's queue and taken off untimed, as its `run()` loop does. A save includes its
            `batch_is_exist` check and `prepare_values` (numpy address computation); a load its masks,
            `prepare_values` and rotation.
  raw       the bare Mooncake batch calls (`batch_put_from_multi_buffers` /
            `batch_get_into_multi_buffers` on `store.raw`) over one contiguous byte buffer (not a KV
            cache): the same key count and bytes per key, one segment per key, pointers precomputed.

Puts use fresh keys every iteration (put is first-writer-wins; removed untimed afterwards and checked
stored first); gets read the keys each path stored once. Data is checked byte-exact once per path: the
cache is filled through vLLM's views with torch ops, put by the path, zeroed, read back by the path and
compared view by view. Ratios are medians of per-iteration ratios (robust to load drifting over the run;
other jobs share these cores). Placement is "local" (the client owns the segment; Mooncake's TCP-only
path moves the bytes in-process with memcpy). Targets are printed, never asserted.

Run: ``make bench`` or ``python -m bench.datapath [--quick] [--blocks N] [--layout LBNHC ...]``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import itertools
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

LAYOUTS = ("LBNHC", "LHBNC", "BLNHC")
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
BATCH_BLOCKS = 64
ITERS = 20  # --quick: 5
# get keys of three paths + one batch of fresh put keys, with room for the allocator's slack
SEGMENT_BYTES = 1 << 30
TARGETS = {"off/raw": 0.8, "off/upstream": 1.0, "ours/off": 0.6}
PATHS = ("ours", "ours-ck", "ours-mm8", "ours-off", "raw", "upstream")
COSTS = ("ours", "ours-ck", "ours-mm8")  # the tagged ways, each against ours-off


class BenchError(RuntimeError):
    pass


class _Unsupported(Exception):
    """Upstream cannot serve this layout; the message says why (the layout is measured without it)."""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _hashes(tag: str, n: int) -> list[bytes]:
    """Fresh block hashes (hence fresh keys) per tag."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


@dataclass
class _Env:
    """One layout's allocator-built cache and the configs it came from."""

    layout: str
    vllm_config: Any
    kv_cache_config: Any
    caches: dict[str, torch.Tensor]
    block_ids: list[int]
    block_bytes: int


def _build_env(layout: str, workdir: str, blocks: int) -> _Env:
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    from testbed.kvcache import allocate, attention_specs, build_kv_cache_config
    from testbed.harness import write_model_dir

    num_blocks = blocks + 1  # + vLLM's null block 0
    max_len = 4096
    model_dir = write_model_dir(os.path.join(workdir, f"model-{layout}"), num_layers=NUM_LAYERS,
                                num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                     max_model_len=max_len)
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_len, max_model_len=max_len,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        kv_transfer_config=KVTransferConfig(kv_connector="KVLedgerConnector",
                                            kv_connector_module_path="kvledger_connector.connector", kv_role="kv_both",
                                            kv_connector_extra_config={"tp_rank": 0}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = num_blocks
    specs = attention_specs(NUM_LAYERS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                            dtype=DTYPE)
    cfg = build_kv_cache_config(vc, specs, num_blocks, layout)
    caches = allocate(cfg, layout)
    block_bytes = sum(s.page_size_bytes for s in specs.values())
    return _Env(layout, vc, cfg, caches, list(range(1, num_blocks)), block_bytes)


# ------------------------------------------------------------------ the three paths
class _Path:
    """One path: `put_call(tag)` / `get_call()` prepare untimed and return the timed call;
    `settle_put` / `settle_get` check the outcome and clean up, untimed."""

    name: str
    segments_per_key: int

    def put_call(self, tag: str) -> tuple[list[str], Callable[[], None]]:
        raise NotImplementedError

    def settle_put(self) -> None:
        raise NotImplementedError

    def get_call(self) -> Callable[[], None]:
        raise NotImplementedError

    def settle_get(self) -> None:
        raise NotImplementedError

    def store_get_keys(self) -> list[str]:
        """Stores the batch the gets read (tag "get": the same keys every call), untimed."""
        keys, call = self.put_call("get")
        call()
        self.settle_put()
        return keys

    def close(self) -> None:
        pass


class _Ours(_Path):
    """Ours as configured by default (its integrity: `integrity`); `variant` gives the same worker with
    another integrity seal (the registration of the cache is the worker's: one connector serves every
    variant)."""

    name = "ours"

    def variant(self, name: str, seal: Any) -> _Ours:
        v = copy.copy(self)
        v.name, v._rank_steps = name, self._steps_with(seal)
        v._get_hashes = tuple(_hashes(f"{self.run}/{name}/get", len(self.block_ids)))
        v.close = lambda: None  # type: ignore[method-assign]  # the base path shuts the connector down
        return v

    def _steps_with(self, seal: Any) -> Any:
        """The worker's steps over the same ledgers and counters, their registered cache sealed by ``seal``."""
        from kvledger_connector.worker.steps import WorkerSteps

        base = self._rank_steps
        cache = dataclasses.replace(base.cache, seal=seal, key_bytes=self.ws._plans[0].block_bytes
                                    + (seal.trailer_bytes if seal is not None else 0))
        return WorkerSteps(self.ws.connector_config, cache, ledger=base.ledger, loads=base.loads,
                           tp_rank=base.tp_rank, shape=base.shape, stats=base.stats)

    def _apply(self) -> None:
        self.ws._steps = self._rank_steps  # this variant's steps (its seal) run the worker's next job

    def __init__(self, env: _Env, store: Any, run: str) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvledger_connector.connector import KVLedgerConnector

        self.conn = KVLedgerConnector(env.vllm_config, KVConnectorRole.WORKER, env.kv_cache_config, store=store)
        self.conn.register_kv_caches(env.caches)
        ws = self.conn.worker_side
        assert ws is not None and ws._plans
        self.ws = ws
        self.segments_per_key = len(ws._plans[0].segments)
        self.run = run
        self.block_ids = tuple(env.block_ids)
        self.job = 0
        self._job_ids = itertools.count(1)  # shared with the variants: one worker ledger, one step counter
        self._steps = itertools.count(1)
        self._req = ""
        self._get_hashes = tuple(_hashes(f"{run}/ours/get", len(self.block_ids)))
        self._rank_steps = ws.steps

    def _drop(self, req_id: str) -> None:
        """DropGeneration (finished) through the worker's step hook, and take the reports: keeps the ledger
        bounded over many jobs."""
        from kvledger_connector.metadata import DropNotice, KVLedgerConnectorMetadata

        self.ws.start_step(KVLedgerConnectorMetadata(step=next(self._steps), drops=[DropNotice(req_id, 0, True)]))
        self.ws.take_report()

    def put_call(self, tag: str) -> tuple[list[str], Callable[[], None]]:
        from kvledger_connector.metadata import SaveSpec

        self._apply()
        hashes = tuple(_hashes(f"{self.run}/{self.name}/{tag}", len(self.block_ids)))
        self.job = next(self._job_ids)
        self._req = f"{self.name}-{tag}"
        spec = SaveSpec(req_id=self._req, store_job_id=self.job, generation=0, start_block=0,
                        end_block=len(self.block_ids), block_ids=self.block_ids, block_hashes=hashes)
        job = self.ws.steps.receive_save(spec)  # Receive (model runner side)
        if job is None:
            raise BenchError(f"the worker refused {spec}: {self.ws.steps.errors[-1:]}")
        self._failed0 = self.ws.steps.stats.total("failed_jobs")
        return self.ws.steps.block_shape().builders[0].keys(hashes), lambda: self.ws._handle_save(job, None)

    def settle_put(self) -> None:
        self._drop(self._req)
        if self.ws.steps.stats.total("failed_jobs") != self._failed0 or self.ws.steps.errors:
            raise BenchError(f"{self.name}: save failed: {self.ws.steps.errors[-1:]}")

    def get_call(self) -> Callable[[], None]:
        from kvledger_connector.metadata import LoadSpec

        self._apply()
        spec = LoadSpec(req_id="ours-load", block_ids=self.block_ids, block_hashes=self._get_hashes)
        return lambda: self.ws._handle_load(spec)

    def settle_get(self) -> None:
        report = self.ws.take_report()
        errors, done = report.invalid_block_ids, report.finished_recving
        if errors or done != {"ours-load"} or self.ws.steps.errors:
            raise BenchError(f"{self.name}: load failed: blocks {sorted(errors)[:4]}, finished {done}, "
                             f"{self.ws.steps.errors[-1:]}")

    def close(self) -> None:
        self.conn.shutdown()


class _Upstream(_Path):
    name = "upstream"

    def __init__(self, env: _Env, store: Any, run: str, ours_plan: Any) -> None:
        from mooncake.store import ReplicateConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
            MooncakeStoreCoordinator,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
            KVCacheStoreRecvingThread,
            KVCacheStoreSendingThread,
            MooncakeStoreWorker,
        )
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        vc, kcc = env.vllm_config, env.kv_cache_config
        # what MooncakeStoreWorker.__init__ sets for TP=1, PP=1, no PCP/DCP, kv_both, with our client
        w = MooncakeStoreWorker.__new__(MooncakeStoreWorker)
        w.tp_rank, w.tp_size, w.pp_size, w.pp_rank = 0, 1, 1, 0
        w.pcp_size, w.pcp_rank, w.dcp_size, w.dcp_rank = 1, 0, 1, 0
        w.kv_role, w.can_put, w._capacity_only = "kv_both", True, False
        w.cache_config = vc.cache_config
        w._is_hma_required = len(kcc.kv_cache_groups) > 1
        w.block_size, w.hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
        w.num_kv_head = vc.model_config.get_total_num_kv_heads()
        w.store = store.raw
        w._kv_cache_config = kcc
        w.coord = MooncakeStoreCoordinator.from_kv_cache_config(kcc, vc, w.block_size, w.hash_block_size)
        w._kv_cache_groups = w.coord.kv_cache_groups
        w.store_tp_size, namespace, layout_cls = w._select_store_layout({})
        meta = KeyMetadata(model_name=f"bench-{run}", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0,
                           store_namespace=namespace)
        w._group_tp_replication_factors = w._compute_group_tp_replication_factors()
        w.token_dbs = w._build_token_databases(meta, layout_cls)
        # register_kv_caches starts the send thread when can_put and num_recv_threads load threads:
        # none here, they are built below and never started
        w.can_put, w.num_recv_threads = False, 0
        # one client serves every path and Mooncake refuses an overlapping region (-600): hand the cache's
        # region over from ours so upstream's registration runs as on its own client (close() frees it)
        for ptr, _ in ours_plan.storages:
            store.raw.unregister_buffer(ptr)
        w.register_kv_caches(env.caches)
        participates = [g.kv_cache_spec.prefix_cacheable for g in w._kv_cache_groups]
        self.ops: list[tuple[str, str]] = []  # (operation, status) recorded by upstream's own callbacks

        def record(*, operation: str, status: str, **_: Any) -> None:
            self.ops.append((operation, status))

        self.send = KVCacheStoreSendingThread(
            w.store, w.coord, w.token_dbs, w.block_size, w.tp_rank, w._group_tp_replication_factors, w.kv_role,
            threading.Event(), False, ReplicateConfig(), record_operation=record, group_participates=participates)
        self.recv = KVCacheStoreRecvingThread(
            w.store, w.coord, w.token_dbs, w.block_size, w.tp_rank, threading.Event(),
            disk_offload_buffer_budget_bytes=None, record_operation=record, group_participates=participates,
            is_hma_required=w._is_hma_required)
        self.worker = w
        lay = w.token_dbs[0].store_layout
        self.segments_per_key = len(lay.kv_caches_base_addr)
        per_key = sum(lay.block_len[i % len(lay.block_len)] for i in range(self.segments_per_key))
        if per_key != env.block_bytes:  # its put would read past this block (and past the cache): not run
            raise _Unsupported(f"its RankLocalStoreLayout reads {self.segments_per_key} segments of "
                               f"{sorted(set(lay.block_len))} bytes = {per_key} bytes per key for a "
                               f"{env.block_bytes}-byte block ({env.layout})")
        self.run = run
        self.block_ids = list(env.block_ids)
        self.token_len = len(self.block_ids) * BLOCK_SIZE
        self.job = 0
        self._req = ""
        self._get_hashes = _hashes(f"{run}/upstream/get", len(self.block_ids))

    def _meta(self, req_id: str, hashes: list[bytes], **kw: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ReqMeta

        return ReqMeta(req_id=req_id, token_len_chunk=self.token_len, block_ids=(list(self.block_ids),),
                       block_hashes=list(hashes), num_prompt_tokens=self.token_len,
                       prefill_end_tokens=self.token_len, **kw)

    def _keys(self, hashes: list[bytes]) -> list[str]:
        db = self.worker.token_dbs[0]
        return [db.store_layout.key_for(0, h) for h in hashes]

    def put_call(self, tag: str) -> tuple[list[str], Callable[[], None]]:
        hashes = _hashes(f"{self.run}/upstream/{tag}", len(self.block_ids))
        self.job += 1
        self._req = f"upstream-{tag}"
        self.send.add_request(self._meta(self._req, hashes, can_save=True, store_job_id=self.job))
        req = self.send.request_queue.get()  # what its run() loop does, untimed
        self.ops.clear()
        return self._keys(hashes), lambda: self.send._handle_request(req)

    def settle_put(self) -> None:
        self.send.delete_finished_stored_request(self._req)  # what request_finished leads to
        self.send.take_completed_saves()
        if self.ops != [("save_exists", "ok"), ("save_put", "ok")]:
            raise BenchError(f"upstream: save recorded {self.ops}")

    def get_call(self) -> Callable[[], None]:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import LoadSpec

        spec = LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=self.token_len, can_load=True,
                        token_len=self.token_len)
        self.recv.add_request(self._meta("upstream-load", self._get_hashes, load_spec=spec))
        req = self.recv.request_queue.get()
        self.ops.clear()
        return lambda: self.recv._handle_request(req)

    def settle_get(self) -> None:
        errors = self.recv.get_and_clear_block_ids_with_load_errors()
        done = self.recv.get_and_clear_finished_requests()
        if errors or done != {"upstream-load"} or self.ops != [("load_get", "ok")]:
            raise BenchError(f"upstream: load failed: blocks {sorted(errors)[:4]}, finished {done}, {self.ops}")


class _Raw(_Path):
    name = "raw"
    segments_per_key = 1

    def __init__(self, env: _Env, store: Any, run: str) -> None:
        self.raw = store.raw
        self.n, self.block_bytes = len(env.block_ids), env.block_bytes
        # the raw-bytes baseline: a plain byte buffer, not a KV cache (same keys x bytes per key)
        self.buf = torch.empty(self.n * self.block_bytes, dtype=torch.uint8)
        store.register_buffer(self.buf.data_ptr(), self.buf.nbytes)
        base = self.buf.data_ptr()
        self.ptrs = [[base + i * self.block_bytes] for i in range(self.n)]
        self.sizes = [[self.block_bytes]] * self.n
        self.run = run
        self._codes: list[int] = []
        self._get_keys = self._keys("get")

    def _keys(self, tag: str) -> list[str]:
        return [f"bench-dp/{self.run}/raw/{tag}/{i}" for i in range(self.n)]

    def put_call(self, tag: str) -> tuple[list[str], Callable[[], None]]:
        keys = self._keys(tag)

        def call() -> None:
            self._codes = list(self.raw.batch_put_from_multi_buffers(keys, self.ptrs, self.sizes))
        return keys, call

    def settle_put(self) -> None:
        if self._codes != [0] * self.n:
            raise BenchError(f"raw: put returned {sorted(set(self._codes))}")

    def get_call(self) -> Callable[[], None]:
        def call() -> None:
            self._codes = list(self.raw.batch_get_into_multi_buffers(self._get_keys, self.ptrs, self.sizes))
        return call

    def settle_get(self) -> None:
        if self._codes != [self.block_bytes] * self.n:
            raise BenchError(f"raw: get returned {sorted(set(self._codes))}")


# ------------------------------------------------------------------ one layout
def _fill_cache(env: _Env, seed: int) -> dict[str, torch.Tensor]:
    """Distinct data through vLLM's views (torch ops only); returns a copy to compare against."""
    g = torch.Generator().manual_seed(seed)
    ref = {}
    for name, t in env.caches.items():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        ref[name] = t.clone()
    return ref


def _check_cache(env: _Env, ref: dict[str, torch.Tensor], path: str) -> None:
    """Bit-exact over the batch's blocks (int16 views: -0.0 and NaN payloads count)."""
    lo, hi = env.block_ids[0], env.block_ids[-1] + 1
    for name, t in env.caches.items():
        if not torch.equal(t[lo:hi].view(torch.int16), ref[name][lo:hi].view(torch.int16)):
            raise BenchError(f"{path}: layer {name} read back differs ({env.layout})")


def _floor_call(raw: _Raw, ikey: Any) -> Callable[[], None]:
    """The floor (module doc): one keyed BLAKE3 call per block over raw's contiguous buffer, as the seal
    makes it (the key and nonce bound first, then the bytes in one update)."""
    from blake3 import blake3

    from kvledger_connector.shape.integrity import TAG_BYTES, IntegrityKey
    ik = ikey if ikey.enabled and ikey.construction == "b3" else IntegrityKey()
    k, bound = ik.b3_key, ik.bind("bench/floor", bytes(8))
    rows = raw.buf.numpy().reshape(raw.n, raw.block_bytes)

    def call() -> None:
        for row in rows:
            h = blake3(bound, key=k)
            h.update(row)
            h.digest(TAG_BYTES)
    return call


def _layout_run(mc: Any, layout: str, iters: int, workdir: str, blocks: int) -> dict[str, Any]:
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.client import MooncakeStore

    env = _build_env(layout, workdir, blocks)
    store = MooncakeStore.connect(StoreConfig(global_segment_size=SEGMENT_BYTES, local_buffer_size=4 << 20),
                                  embedded=mc)
    run = uuid.uuid4().hex[:8]
    paths: dict[str, _Path] = {}
    note = ""
    try:
        ours = paths["ours"] = _Ours(env, store, run)
        from kvledger_connector.shape.integrity import BlockSeal, IntegrityKey
        default = ours.conn.integrity
        mm8_mode = default.mode if default.enabled else "checksum"
        for name, ikey in (("ours-ck", IntegrityKey("checksum")),
                           ("ours-mm8", IntegrityKey(mm8_mode, default.secret if mm8_mode == "mac" else b"", "mm8"))):
            seal = BlockSeal(ikey, ours.ws._plans[0], env.caches, slots=1, max_keys=len(env.block_ids) + 1)
            for ptr, nbytes in seal.regions:
                store.register_buffer(ptr, nbytes)
            paths[name] = ours.variant(name, seal)
        paths["ours-off"] = ours.variant("ours-off", None)
        try:
            paths["upstream"] = _Upstream(env, store, run, ours.ws._plans[0])
        except _Unsupported as e:
            note = f"upstream not run: {e}"
        raw = paths["raw"] = _Raw(env, store, run)
        floor = _floor_call(raw, default)
        ref = _fill_cache(env, seed=sum(layout.encode()))
        raw.buf.copy_(torch.randint(0, 256, (raw.buf.numel(),), dtype=torch.uint8))
        raw_ref = raw.buf.clone()
        get_keys: list[str] = []
        for name, p in paths.items():  # each path stores its get keys, reads them back into zeroed memory
            get_keys += p.store_get_keys()
            if name == "raw":
                raw.buf.zero_()
            else:
                for t in env.caches.values():
                    t.zero_()
            p.get_call()()
            p.settle_get()
            if name == "raw":
                if not torch.equal(raw.buf, raw_ref):
                    raise BenchError("raw: read back differs")
            else:
                _check_cache(env, ref, name)
        # gets rewrite the same bytes, so puts keep reading the reference data from here on
        names = [n for n in PATHS if n in paths]
        times: dict[str, dict[str, list[float]]] = {op: {n: [] for n in names} for op in ("put", "get")}
        floor_ts: list[float] = []
        order = list(names)
        for it in range(iters):
            floor()  # warm, untimed (the raw buffer's pages were just read by raw's put)
            t0 = time.perf_counter()
            floor()
            floor_ts.append(time.perf_counter() - t0)
            order = order[1:] + order[:1]  # rotate: no path always runs first (cold) or last
            for name in order:
                p = paths[name]
                keys, call = p.put_call(f"it{it}")
                t0 = time.perf_counter()
                call()
                times["put"][name].append(time.perf_counter() - t0)
                p.settle_put()
                exist = store.batch_is_exist(keys)
                if exist != [1] * len(keys):
                    raise BenchError(f"{name}: {exist.count(1)}/{len(keys)} keys stored after put ({layout})")
                store.raw.batch_remove(keys, True)
                call = p.get_call()
                t0 = time.perf_counter()
                call()
                times["get"][name].append(time.perf_counter() - t0)
                p.settle_get()
        _check_cache(env, ref, "after the timed loop")
        store.raw.batch_remove(get_keys, True)
    finally:
        for p in paths.values():
            p.close()
        store.close()
    total = len(env.block_ids) * env.block_bytes
    out: dict[str, Any] = {"layout": layout, "keys": len(env.block_ids), "block_bytes": env.block_bytes,
                           "segs": {n: p.segments_per_key for n, p in paths.items()}, "note": note,
                           "integrity": f"{default.mode}, {default.construction}" if default.enabled else "off",
                           "floor GB/s": _gbps(total, statistics.median(floor_ts))}
    for op, ts in times.items():
        r: dict[str, float | None] = {n: _gbps(total, statistics.median(ts[n])) if n in ts else None for n in PATHS}
        for other in ("raw", "upstream"):  # paired per iteration: throughput ratio = inverse time ratio
            r[f"off/{other}"] = (statistics.median(b / a for a, b in zip(ts["ours-off"], ts[other]))
                                 if other in ts else None)
        for way in COSTS:  # integrity's cost, paired per iteration
            r[f"{way} cost"] = statistics.median(a / b - 1 for a, b in zip(ts[way], ts["ours-off"]))
        r["ours/off"] = statistics.median(b / a for a, b in zip(ts["ours"], ts["ours-off"]))
        r["ck/off"] = statistics.median(b / a for a, b in zip(ts["ours-ck"], ts["ours-off"]))
        r["floor"] = statistics.median(b / (b + f) for b, f in zip(ts["ours-off"], floor_ts))
        out[op] = r
    return out


def _cell(x: float | None, width: int, flag: str = "") -> str:
    return f"{'n/a' if x is None else format(x, '.2f')}{flag}".rjust(width)


def datapath_suite(args: argparse.Namespace) -> int:
    from kvledger_connector.store.embedded import EmbeddedMooncake

    logging.getLogger("vllm").setLevel(logging.ERROR)
    iters = 5 if args.quick else ITERS
    layouts = args.layout or list(LAYOUTS)
    print(f"[bench.datapath] worker data path on allocator-built caches ({NUM_LAYERS} layers x {NUM_KV_HEADS} KV "
          f"heads x {HEAD_SIZE}, block {BLOCK_SIZE}, {str(DTYPE).split('.')[-1]}): ours (WorkerSide handlers) vs raw "
          f"Mooncake batch calls on one byte buffer vs upstream vLLM MooncakeStoreConnector handlers; "
          f"{args.blocks} keys per batch, {iters} iterations, medians, rotating order", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-") as workdir, EmbeddedMooncake() as mc:
        for layout in layouts:
            rows.append(_layout_run(mc, layout, iters, workdir, args.blocks))
    below = []
    for r in rows:
        segs = r["segs"]
        print(f"\nlayout {r['layout']}: {r['keys']} keys x {r['block_bytes'] >> 10} KiB = "
              f"{r['keys'] * r['block_bytes'] >> 20} MiB per batch; segments per key: ours {segs['ours']}, "
              f"upstream {segs.get('upstream', 'n/a')}, raw {segs['raw']}; ours's integrity: {r['integrity']}; "
              f"floor hash {r['floor GB/s']:.2f} GB/s")
        if r["note"]:
            print(r["note"])
        print(f"{'op':<4} {'ours GB/s':>10} {'ck GB/s':>8} {'mm8 GB/s':>9} {'off GB/s':>9} {'raw GB/s':>9} "
              f"{'upstream GB/s':>14} {'ours/off':>9} {'ck/off':>7} {'floor':>6} {'off/raw':>8} {'off/upstream':>13} "
              f"{'ck cost':>8} {'mm8 cost':>9}")
        for op in ("put", "get"):
            x = r[op]
            # judged on the printed (rounded) value, so "1.00*" never shows
            flags = {k: "*" if x[k] is not None and round(x[k], 2) < t else " " for k, t in TARGETS.items()}
            below += [f"{r['layout']} {op} {k}" for k, f in flags.items() if f == "*"]
            print(f"{op:<4} {_cell(x['ours'], 10)} {_cell(x['ours-ck'], 8)} {_cell(x['ours-mm8'], 9)} "
                  f"{_cell(x['ours-off'], 9)} {_cell(x['raw'], 9)} {_cell(x['upstream'], 14)} "
                  f"{_cell(x['ours/off'], 9, flags['ours/off'])} {_cell(x['ck/off'], 7)} {_cell(x['floor'], 6)} "
                  f"{_cell(x['off/raw'], 8, flags['off/raw'])} "
                  f"{_cell(x['off/upstream'], 13, flags['off/upstream'])} "
                  f"{x['ours-ck cost']:>+8.0%} {x['ours-mm8 cost']:>+9.0%}")
    print("\nours: the connector's default integrity (as resolved, above); ck: integrity \"checksum\" (XXH3-128 on host KV); mm8: ours's "
          "mode in the construction GPU KV gets; off: integrity \"off\" (like raw and upstream, no tag). Ratios: "
          "median of per-iteration throughput ratios; floor: time(off) / (time(off) + one keyed BLAKE3 pass over "
          "the batch), the best ours/off a tag computed after the transfer can reach; cost: median of "
          "per-iteration time(way) / time(off) - 1. Targets (printed, not asserted): "
          + ", ".join(f"{k} >= {v:.1f}" for k, v in TARGETS.items())
          + f"; * = off target{': ' + ', '.join(below) if below else ' (none)'} (docs/bench.md: bench.datapath)")
    return 0


SUITES: dict[str, Callable[[argparse.Namespace], int]] = {"datapath": datapath_suite}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.datapath", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--blocks", type=int, default=BATCH_BLOCKS, help="keys per batch (default %(default)s)")
    ap.add_argument("--layout", action="append", choices=["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"],
                    help="only these KV cache layouts (repeatable; default: %s)" % ", ".join(LAYOUTS))
    args = ap.parse_args([] if argv is None else argv)
    if args.blocks < 1:
        ap.error(f"--blocks {args.blocks}: at least 1")
    rc = 0
    for name, suite in SUITES.items():
        try:
            rc |= int(suite(args) or 0)
        except BenchError as e:
            print(f"[bench.datapath] {name}: FAILED: {e}", file=sys.stderr)
            rc |= 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
