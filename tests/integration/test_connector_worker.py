"""The worker side on a real Mooncake master: load-error reporting (every exit path, every sub-batch, the
two upstream vLLM 0.32.0 load-path failures), rotation, bounded queues, stale jobs.

`WorkerSide` is driven directly with the real store and a KV cache from vLLM's own allocator
(testbed.kvcache, read through `plan_block_copies`); its keys come from the engine config
(`kvledger_connector.connector.key_layout`). Two test doubles, each named where used: `_GatedStore` (holds calls
until released, to make a queue fill deterministically) and `testbed.faults.FaultyStore` (injects codes /
exceptions on chosen calls).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.config import ConnectorConfig, StoreConfig
from kvledger_connector.connector import key_layout
from testbed.faults import FaultPlan, FaultRule, FaultyStore
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.shape.kvlayout import plan_block_copies
from kvledger_connector.metadata import (
    DropNotice,
    KVLedgerConnectorMetadata,
    KVLedgerWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.worker.side import WorkerSide
from tests.reports import report_until
from testbed.kvcache import allocate, attention_specs, build_kv_cache_config
from testbed.harness import write_model_dir

BS, LAYERS, HEADS, HD, NBLOCKS, TP = 16, 2, 2, 8, 16, 4
LAYOUT = "LBNHC"
Caches = dict[str, torch.Tensor]


def _hash(i: int, salt: str) -> bytes:
    return hashlib.sha256(f"{salt}/{i}".encode()).digest()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmConfig, KVCacheConfig]:
    """A tiny Llama engine config (no weights) at TP 4 and its KV cache config, as the engine builds them."""
    model = write_model_dir(str(tmp_path_factory.mktemp("model")), num_layers=LAYERS, num_kv_heads=HEADS * TP,
                            head_size=HD)
    vc = VllmConfig(model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                             dtype="float32", seed=0, max_model_len=256),
                    cache_config=CacheConfig(block_size=BS), parallel_config=ParallelConfig(tensor_parallel_size=TP),
                    device_config=DeviceConfig("cpu"))
    specs = attention_specs(LAYERS, block_size=BS, num_kv_heads=HEADS, head_size=HD)
    return vc, build_kv_cache_config(vc, specs, NBLOCKS, LAYOUT)


def _caches(engine, fill: float = 0.0) -> Caches:
    """vLLM's per-layer [B, H, N, C] views of one fresh allocation, every element `fill`."""
    caches = allocate(engine[1], LAYOUT)
    for t in caches.values():
        t.fill_(fill)
    return caches


def _register(ws: WorkerSide, caches: Caches) -> None:
    ws.register_kv_caches(plan_block_copies(caches, layout=LAYOUT, block_size=BS, num_blocks=NBLOCKS))


def _value(layer: int, j: int) -> float:
    """What block j of a save holds in every element of layer `layer` (layers differ: a swap is caught)."""
    return float(1000 * (layer + 1) + j)


def _holds(caches: Caches, block: int, j: int) -> bool:
    """Block `block` holds save j's values in every layer, read through vLLM's views."""
    return all(torch.equal(t[block], torch.full_like(t[block], _value(li, j)))
               for li, t in enumerate(caches.values()))


def _worker(engine, store, cfg: StoreConfig, tp_rank: int = 0, salt: str = "", **cfg_changes) -> WorkerSide:
    vc, kv_cfg = engine
    # the shared master holds every test's keys: the test's name keeps them apart
    layout = dataclasses.replace(key_layout(vc, kv_cfg, tp_rank), model=f"test-{salt}")
    config = cfg.replace(**cfg_changes) if cfg_changes else cfg
    return WorkerSide(ConnectorConfig(store=config, block_size=BS), store=store,
                      shape=BlockShape.of_keys([KeyBuilder(layout, config.max_key_bytes)]), tp_rank=tp_rank,
                      max_requests=64)


def _wait(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def _save_blocks(ws: WorkerSide, caches, hashes: Sequence[bytes], block_ids: Sequence[int], job: int,
                 req_id: str = "writer") -> None:
    """Fill blocks with recognisable values and save them through a real store job."""
    for j, b in enumerate(block_ids):
        for li, t in enumerate(caches.values()):
            t[b] = _value(li, j)
    meta = KVLedgerConnectorMetadata(step=job + 1, saves=[SaveSpec(req_id, job, 0, 0, len(hashes), tuple(block_ids),
                                                                   tuple(hashes))])
    ws.end_step(meta)
    _wait(lambda: not ws.has_pending_work() or bool(ws.steps.ledger._completed))
    assert ws.take_report().worker_meta.completed_saves == {job: 1}


def _load(ws: WorkerSide, spec: LoadSpec, step: int) -> tuple[set[str], set[int]]:
    ws.start_step(KVLedgerConnectorMetadata(step=step, loads=[spec]))
    report = report_until(ws, lambda got: spec.req_id in got.finished_recving)
    return set(report.finished_recving), set(report.invalid_block_ids)


@pytest.fixture
def cfg(store_config: StoreConfig) -> StoreConfig:
    return store_config


@pytest.fixture
def writer(engine, store: MooncakeStore, cfg: StoreConfig, request) -> Iterator[tuple[WorkerSide, Caches, str]]:
    salt = request.node.name
    ws = _worker(engine, store, cfg, salt=salt)
    caches = _caches(engine)
    _register(ws, caches)
    yield ws, caches, salt
    ws.shutdown()


def test_save_then_load_roundtrip_is_byte_exact(engine, writer, store, cfg):
    ws, caches, salt = writer
    hashes = [_hash(i, salt) for i in range(4)]
    _save_blocks(ws, caches, hashes, [1, 2, 3, 4], job=0)
    reader = _worker(engine, store, cfg, salt=salt)
    rc = _caches(engine, -1.0)
    _register(reader, rc)
    try:
        finished, errors = _load(reader, LoadSpec("r", (5, 6, 7, 8), tuple(hashes)), 1)
        assert finished == {"r"} and errors == set()
        for j, b in enumerate((5, 6, 7, 8)):
            assert _holds(rc, b, j), f"block {b}"
        # blocks outside the load are untouched
        assert all(torch.equal(t[9], torch.full_like(t[9], -1.0)) for t in rc.values())
    finally:
        reader.shutdown()


def test_empty_key_list_load_is_finished_not_stuck(writer):
    """vLLM 0.32.0 computes `tp_rank % len(key_list)` first: ZeroDivisionError, the request waits forever."""
    ws, _, _ = writer
    finished, errors = _load(ws, LoadSpec("empty", (), ()), 1)
    assert finished == {"empty"} and errors == set()
    assert ws.steps.errors == []


@pytest.mark.parametrize("tp_rank", [1, 3])
def test_failing_first_sub_batch_at_rank_gt0_reports_every_unloaded_block(engine, store, cfg, tp_rank, request):
    """vLLM 0.32.0 stops at the first failed sub-batch: with rotation by tp_rank the request's *leading*
    blocks sit in a later sub-batch and stay neither loaded nor reported. Here the first get call fails
    (FaultyStore raises, a test double) and every block that is not loaded must be reported."""
    salt = request.node.name
    w = _worker(engine, store, cfg, tp_rank=tp_rank, salt=salt)
    caches = _caches(engine)
    _register(w, caches)
    hashes = [_hash(i, salt) for i in range(10)]
    blocks = tuple(range(1, 11))
    _save_blocks(w, caches, hashes, blocks, job=0)
    w.shutdown()
    faulty = FaultyStore(store, FaultPlan([FaultRule("get", "raise", calls=frozenset({0}))]))
    reader = _worker(engine, faulty, cfg, tp_rank=tp_rank, salt=salt, load_sub_batch_keys=3)
    rc = _caches(engine, -1.0)
    _register(reader, rc)
    try:
        _, errors = _load(reader, LoadSpec("r", blocks, tuple(hashes)), 1)
        # the first sub-batch in rotated order is blocks[rot:rot+3]; all others were loaded
        rot = tp_rank % 10
        first = {blocks[(rot + k) % 10] for k in range(3)}
        assert errors == first
        assert blocks[0] not in first  # the leading block sits in the last sub-batch ...
        assert _holds(rc, blocks[0], 0)  # ... and was loaded with its own KV
        for j, b in enumerate(blocks):  # every block is either loaded right or reported
            assert (b in errors) != _holds(rc, b, j), f"block {b}"
        assert len(faulty.injected) == 1
    finally:
        reader.shutdown()


def test_negative_codes_map_back_through_rotation(engine, store, cfg, request):
    """tp_rank=1 rotates keys; a missing key's block (not its rotated position) is reported."""
    salt = request.node.name
    w = _worker(engine, store, cfg, tp_rank=1, salt=salt)
    caches = _caches(engine)
    _register(w, caches)
    hashes = [_hash(i, salt) for i in range(3)]
    _save_blocks(w, caches, hashes[:2], (1, 2), job=0)  # block 3's key is never stored: -704
    try:
        _, errors = _load(w, LoadSpec("r", (7, 8, 9), tuple(hashes)), 2)
        assert errors == {9}
        assert _holds(caches, 7, 0) and _holds(caches, 8, 1)  # the keys that exist loaded, in order
    finally:
        w.shutdown()


def test_oversized_keys_are_reported_not_sent(engine, writer, store, cfg):
    ws, caches, salt = writer
    hashes = [_hash(i, salt) for i in range(2)]
    _save_blocks(ws, caches, hashes, (1, 2), job=0)
    long_hash = b"\x01" * 400  # 800 hex chars: longer than max_key_bytes
    reader = _worker(engine, store, cfg, salt=salt, max_key_bytes=256)
    rc = _caches(engine, -1.0)
    _register(reader, rc)
    try:
        _, errors = _load(reader, LoadSpec("r", (5, 6, 7), (hashes[0], long_hash, hashes[1])), 1)
        assert errors == {6}
        assert _holds(rc, 5, 0) and _holds(rc, 7, 1)
        assert all(torch.equal(t[6], torch.full_like(t[6], -1.0)) for t in rc.values())  # never written
        assert reader.steps.stats.total(f"fail_code.{int(StoreCode.KEY_TOO_LONG)}") == 1
    finally:
        reader.shutdown()


class _GatedStore:
    """TEST DOUBLE: forwards every call to the real store, but only once ``gate`` opens (holds the
    worker's store/load thread so a queue bound can be hit deterministically)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name):
        fn = getattr(self._inner, name)

        def call(*a, **k):
            self._gate.wait(10)
            return fn(*a, **k)
        return call


def test_stale_job_runs_nothing_and_is_still_reported(writer, store):
    ws, caches, salt = writer
    hashes = [_hash(i, salt) for i in range(2)]
    gate = threading.Event()

    blocker_hash = _hash(99, salt)
    ws.io.store = _GatedStore(ws.io.store, gate)
    ws.end_step(KVLedgerConnectorMetadata(step=1, saves=[SaveSpec("other", 0, 0, 0, 1, (3,), (blocker_hash,))]))
    ws.end_step(KVLedgerConnectorMetadata(step=2, saves=[SaveSpec("r", 1, 0, 0, 2, (1, 2), tuple(hashes))]))
    ws.start_step(KVLedgerConnectorMetadata(step=3, drops=[DropNotice("r", 0, False)]))  # DropGeneration before it ran
    gate.set()
    _wait(lambda: not ws.steps.ledger.has_pending_work() or len(ws.steps.ledger._completed) == 2)
    assert ws.take_report().worker_meta.completed_saves == {0: 1, 1: 1}
    assert ws.steps.stats.total("stale_jobs") == 1
    kb = ws.steps.block_shape().builders[0]
    assert store.batch_is_exist(kb.keys(hashes)) == [0, 0]  # the stale job stored nothing


def test_full_store_queue_reports_rejected_job_at_once(engine, store, cfg, request):
    """store_queue_size=1: while the store thread is held (GatedStore, a test double), the queue holds one
    job and the next is rejected: reported immediately (its pins can be released), nothing lost."""
    salt = request.node.name
    ws = _worker(engine, store, cfg, salt=salt, store_queue_size=1)
    _register(ws, _caches(engine))
    gate = threading.Event()
    ws.io.store = _GatedStore(store, gate)
    try:
        for job in range(3):  # job 0 is taken by the thread, job 1 fills the queue, job 2 is rejected
            ws.end_step(KVLedgerConnectorMetadata(step=job + 1, saves=[
                SaveSpec(f"r{job}", job, 0, 0, 1, (job + 1,), (_hash(job, salt),))]))
            if job == 0:
                _wait(lambda: ws._store_q.empty())
        assert ws.steps.stats.total("rejected_jobs") == 1
        assert ws.take_report().worker_meta.completed_saves == {2: 1}
        gate.set()
        _wait(lambda: len(ws.steps.ledger._completed) == 2)
        assert ws.take_report().worker_meta.completed_saves == {0: 1, 1: 1}
    finally:
        gate.set()
        ws.shutdown()


def test_full_load_queue_reports_every_block(engine, store, cfg, request):
    salt = request.node.name
    ws = _worker(engine, store, cfg, salt=salt, load_queue_size=1)
    _register(ws, _caches(engine))
    gate = threading.Event()
    ws.io.store = _GatedStore(store, gate)
    try:
        ws.start_step(KVLedgerConnectorMetadata(step=1, loads=[LoadSpec("a", (1,), (_hash(0, salt),))]))
        _wait(lambda: ws._load_q.empty())
        ws.start_step(KVLedgerConnectorMetadata(step=2, loads=[LoadSpec("b", (2,), (_hash(1, salt),)),
                                                               LoadSpec("c", (3, 4), (_hash(2, salt), _hash(3, salt)))]))
        report = ws.take_report()
        assert report.finished_recving == {"c"}
        assert report.invalid_block_ids == {3, 4}
    finally:
        gate.set()
        ws.shutdown()


def test_jobs_after_shutdown_are_reported_at_once_not_queued(engine, store, cfg, request):
    """A step that reaches a rank after its shutdown (the engine tearing down): no thread will drain the
    queues any more, so a save is reported at once (its pins can be released) and a load's blocks are
    reported failed, instead of sitting in a queue nobody reads."""
    salt = request.node.name
    ws = _worker(engine, store, cfg, salt=salt)
    _register(ws, _caches(engine))
    assert ws.shutdown()
    ws.end_step(KVLedgerConnectorMetadata(step=1, saves=[SaveSpec("r", 7, 0, 0, 1, (1,), (_hash(0, salt),))],
                                          loads=[LoadSpec("l", (2, 3), (_hash(1, salt), _hash(2, salt)))]))
    report = ws.take_report()
    assert report.worker_meta.completed_saves == {7: 1}
    assert ws.steps.stats.total("rejected_jobs") == 1
    assert report.finished_recving == {"l"} and report.invalid_block_ids == {2, 3}
    assert not ws.has_pending_work()
    assert store.batch_is_exist(ws.steps.block_shape().builders[0].keys([_hash(0, salt)])) == [0]  # nothing ran


def test_worker_metadata_aggregates_and_pickles():
    import pickle
    a = KVLedgerWorkerMetadata({1: 1})
    b = KVLedgerWorkerMetadata({1: 1, 2: 1})
    assert a.aggregate(b).completed_saves == {1: 2, 2: 1}
    assert pickle.loads(pickle.dumps(a)).completed_saves == {1: 2, 2: 1}
    with pytest.raises(ValueError, match="completed_saves"):
        KVLedgerWorkerMetadata({3: -1})


def test_shutdown_drains_queued_jobs_and_reports_them(engine, store, cfg, request):
    salt = request.node.name
    ws = _worker(engine, store, cfg, salt=salt)
    _register(ws, _caches(engine))
    for job in range(3):
        ws.end_step(KVLedgerConnectorMetadata(step=job + 1, saves=[
            SaveSpec(f"r{job}", job, 0, 0, 1, (job + 1,), (_hash(job, salt),))]))
    ws.shutdown()
    assert all(not t.is_alive() for t in ws._threads)
    assert ws.take_report().worker_meta.completed_saves == {0: 1, 1: 1, 2: 1}
    assert ws.steps.errors == []


def test_unannounced_preemption_newer_generation_makes_old_job_stale(writer, store):
    """No DropGeneration notice (a preemption outside schedule()): the job of generation 1 supersedes the
    queued job of generation 0, which runs nothing and is still reported. GatedStore is a test double that
    holds the store thread on an earlier job so the order is deterministic."""
    ws, caches, salt = writer
    gate = threading.Event()

    ws.io.store = _GatedStore(ws.io.store, gate)
    h_old, h_new = _hash(0, salt + "old"), _hash(0, salt + "new")
    ws.end_step(KVLedgerConnectorMetadata(step=1, saves=[SaveSpec("blocker", 0, 0, 0, 1, (3,), (_hash(9, salt),))]))
    ws.end_step(KVLedgerConnectorMetadata(step=2, saves=[SaveSpec("r", 1, 0, 0, 1, (1,), (h_old,))]))
    ws.end_step(KVLedgerConnectorMetadata(step=3, saves=[SaveSpec("r", 2, 1, 0, 1, (2,), (h_new,))]))
    gate.set()
    _wait(lambda: len(ws.steps.ledger._completed) == 3)
    assert ws.take_report().worker_meta.completed_saves == {0: 1, 1: 1, 2: 1}
    assert ws.steps.stats.total("stale_jobs") == 1
    assert store.batch_is_exist(ws.steps.block_shape().builders[0].keys([h_old, h_new])) == [0, 1]
