"""Probes: small deterministic scenarios on the connector's own step functions (kvledger_connector/worker/steps.py)
and the ledgers, for what the model's behaviours cannot show: a batch where only some keys fail, a short
read, a load rotated on rank 1, an exception outside a store call, a copy-on-write tail pin, reports of
two ranks merged in one step, the exact pin-cap boundary, an aborted request's blocks under its load, a
block of several keys (the TP-shared layout) cut short between them, a rank of two KV cache groups resuming
over blocks vLLM freed (`SentBlocks`' null_before), the removal of an object that failed its integrity tag.
Each probe raises :class:`ProbeFailed` naming what it saw; the mutant table (conformance/mutants.py) runs
them under every mutant, and tests/unit/test_jobs.py runs them unmutated. A probe that raises anything
else crashed: no named check failed (:func:`run_probes` tells the two apart).

The store here is a scripted in-memory one (:class:`ProbeStore`): it exists to inject per-key faults
(a failing key in a batch, a short read, a raising call) deterministically; the replay (conformance/kvdriver.py)
runs the same steps against Mooncake.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

from vllm.v1.core.block_pool import BlockPool

from conformance.engine.replay import raised
from kvledger.errors import LedgerInvariantError
from kvledger.scheduler import SchedulerLedger
from kvledger.load import LoadLedger
from kvledger.worker import Verdict, WorkerLedger
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.config import ConnectorConfig, StoreConfig
from kvledger_connector.store.io import StoreCall, StoreIO
from kvledger_connector.worker.cache import Buffers, RegisteredCache
from kvledger_connector.worker.effects import DeviceCall, JobEdge
from kvledger_connector.worker.steps import WorkerSteps
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.metadata import KVLedgerWorkerMetadata, SaveSpec
from testbed.store_double import StoreDouble

KEY_BYTES = 64  # one key's object in the probes
BLOCK_SIZE = 16  # tokens per block


class ProbeFailed(Exception):
    """A probe saw the runtime do something it must not."""


#: what a probe may raise when it finds a bug: its own check, or an invariant the runtime itself names
NAMED_CHECKS: tuple[type[Exception], ...] = (ProbeFailed, LedgerInvariantError)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ProbeFailed(what)


class ProbeStore(StoreDouble):
    """A key -> value store over "memory" `mem` (buffer handle -> value); `put_codes` / `get_codes` /
    `exist_codes`: scripted answers per key (the fault); `raises`: calls that raise."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self.mem: dict[int, int] = {}
        self.put_codes: dict[str, int] = {}
        self.get_codes: dict[str, int] = {}
        self.raises: set[str] = set()
        self.leased: set[str] = set()  # keys a reader holds a lease on (remove without force refused)
        self.calls: list[tuple[str, list[str]]] = []

    def _enter(self, fn: str, keys: Sequence[str]) -> None:
        self.calls.append((fn, list(keys)))
        if fn in self.raises:
            raise RuntimeError(f"injected: {fn} raised")

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._enter("batch_is_exist", keys)
        return [1 if k in self.data else 0 for k in keys]

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Any) -> list[int]:
        self._enter("batch_put", keys)
        out = []
        for k, p in zip(keys, ptrs):
            code = self.put_codes.get(k, 0)
            if code == 0:
                self.data.setdefault(k, self.mem[p[0]])
            out.append(code)
        return out

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 leased (a reader holds it: only ``force`` removes it)."""
        self._enter("remove", [key])
        if key not in self.data:
            return -704
        if key in self.leased and not force:
            return -706
        del self.data[key]
        return 0

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Any) -> list[int]:
        self._enter("batch_get", keys)
        out = []
        for k, p in zip(keys, ptrs):
            if k in self.get_codes:
                out.append(self.get_codes[k])
            elif k not in self.data:
                out.append(-704)
            else:
                self.mem[p[0]] = self.data[k]
                out.append(KEY_BYTES)
        return out


def _buffers(ids: list[int], parts: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    return [[i] for i in ids], [[KEY_BYTES]] * len(ids)


_R = TypeVar("_R")

# each driver rank's edge: the `StoreIO` its store calls go through (what `WorkerSide.io` is to the connector)
_EDGES: weakref.WeakKeyDictionary[WorkerSteps, StoreIO] = weakref.WeakKeyDictionary()


def with_edge(steps: WorkerSteps, store: Any) -> WorkerSteps:
    """``steps`` with ``store`` behind its edge (`io_of`), counting into the rank's one sink."""
    _EDGES[steps] = StoreIO(store, steps.stats)
    return steps


def io_of(steps: WorkerSteps) -> StoreIO:
    """The edge a driver rank's store calls go through (`with_edge`)."""
    return _EDGES[steps]


def drain(steps: WorkerSteps, gen: Generator[StoreCall | DeviceCall, Any, _R]) -> _R:
    """One sans-I/O part of a job (`WorkerSteps.put`, `load_batch`, `_verified`) run to its return value,
    each store call it yields made through the rank's edge, each device call here."""
    edge = JobEdge(io_of(steps))
    try:
        call = next(gen)
        while True:
            call = gen.send(edge.make(call))
    except StopIteration as done:
        return done.value


def worker_config(block_size: int = BLOCK_SIZE, sub_batch: int = 2) -> ConnectorConfig:
    """A driver rank's connector config, checked as the connector's is: its block and load sub-batch."""
    return ConnectorConfig(store=StoreConfig(load_sub_batch_keys=sub_batch), block_size=block_size)


def probe_cache(buffers: Buffers = _buffers, num_blocks: int | None = None) -> RegisteredCache:
    """A driver rank's KV cache: its own buffers, objects of KEY_BYTES; ids not bounded above unless
    ``num_blocks``."""
    return RegisteredCache(buffers, num_blocks, key_bytes=KEY_BYTES)


def rank(store: ProbeStore, tp_rank: int = 0, sub_batch: int = 2, cache: RegisteredCache | None = None
         ) -> WorkerSteps:
    keys = KeyBuilder(KeyLayout(model="probe", tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, dtype="torch.float32",
                                kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=8))
    return with_edge(WorkerSteps(worker_config(sub_batch=sub_batch), cache or probe_cache(),
                                 ledger=WorkerLedger(tp_rank, max_live_jobs=8),
                                 loads=LoadLedger(tp_rank, max_inflight_loads=4), tp_rank=tp_rank,
                                 shape=BlockShape.of_keys([keys])), store)


HASHES = [bytes([i + 1]) * 4 for i in range(6)]


def probe_partial_put_fails_the_job() -> None:
    """One key of a put batch fails (an error code, or a positive code: no put result): the job failed
    (offset unchanged), still reported once."""
    for code in (-800, 1):
        st = ProbeStore()
        w = rank(st)
        keys = w.block_shape().builders[0].keys(HASHES[:3])
        st.mem.update({1: 101, 2: 102, 3: 103})
        st.put_codes[keys[1]] = code
        w.receive("r", 1, 0)
        w.run_save(io_of(w), "r", 1, 3, [1, 2, 3], HASHES[:3])
        off = w.ledger.request("r").saved_offset  # type: ignore[union-attr]
        check(off == 0, f"a put whose key answered {code} moved the saved offset to {off}")
        failed = w.stats.total("failed_jobs")
        check(failed == 1, f"failed_jobs={failed} after a put code {code}")
        check(w.take_reports() == {1: 1}, "the job was not reported exactly once")


def probe_an_answer_of_the_wrong_length_fails_the_job() -> None:
    """A broken store answers one put code for two keys: the job fails (nothing counts as stored) and is
    reported."""
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    st.batch_put = lambda keys, ptrs, sizes: [0]  # type: ignore[method-assign]
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    off = w.ledger.request("r").saved_offset  # type: ignore[union-attr]
    check(off == 0, f"one put code for two keys moved the saved offset to {off}")
    check(w.take_reports() == {1: 1}, "the job was not reported exactly once")
    check(any("batch_put codes" in e for e in w.errors), f"the wrong-length answer is not named: {w.errors}")


def probe_pressure_anywhere_in_a_batch() -> None:
    """NO_AVAILABLE_HANDLE on any key of the batch (not only the first) puts the rank under pressure."""
    st = ProbeStore()
    w = rank(st)
    keys = w.block_shape().builders[0].keys(HASHES[:3])
    st.mem.update({1: 101, 2: 102, 3: 103})
    st.put_codes[keys[2]] = -200
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 3, [1, 2, 3], HASHES[:3])
    check(w.ledger.under_pressure, "a -200 on the batch's last key did not mark store pressure")
    check(w.take_reports() == {1: 1}, "the job was not reported")


def probe_short_read_is_a_load_error() -> None:
    """A get that read fewer bytes than the key's object is a failed block, reported (S8)."""
    st = ProbeStore()
    w = rank(st, sub_batch=4)
    keys = w.block_shape().builders[0].keys(HASHES[:3])
    st.data.update({keys[0]: 201, keys[1]: 202, keys[2]: 203})
    st.get_codes[keys[1]] = KEY_BYTES // 2
    res = w.run_load(io_of(w), "r", [4, 5, 6], HASHES[:3])
    check(res is not None, "the load ended without a result (never finished)")
    check(res.failed == {5}, f"short read: failed blocks {sorted(res.failed)}, expected [5]")
    check(w.take_load_errors() == {5}, "the short read's block was not reported to vLLM")


def probe_rotated_load_reports_the_right_block() -> None:
    """Rank 1 loads keys rotated (key 1 first); a missing key 0 fails block 10, and every loaded block holds
    its own key's value."""
    st = ProbeStore()
    w = rank(st, tp_rank=1, sub_batch=2)
    keys = w.block_shape().builders[0].keys(HASHES[:3])
    st.data.update({keys[1]: 302, keys[2]: 303})
    res = w.run_load(io_of(w), "r", [10, 11, 12], HASHES[:3])
    first = next(c for c in st.calls if c[0] == "batch_get")[1][0]
    check(first == keys[1], f"rank 1 did not start on key 1 (started on key {keys.index(first)})")
    check(res.failed == {10}, f"key 0 missing: failed blocks {sorted(res.failed)}, expected [10]")
    check(st.mem.get(11) == 302 and st.mem.get(12) == 303,
           f"blocks 11, 12 hold {st.mem.get(11)}, {st.mem.get(12)}: not their keys' values 302, 303")


def probe_exception_in_a_save_still_reports() -> None:
    """A save whose handler raises (a bad block hash; a store call that raises) is failed and reported."""
    st = ProbeStore()
    w = rank(st)
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], [HASHES[0], b""])  # an empty hash: the key builder raises
    check(w.ledger.job_state(1) == "reported", f"job 1 is {w.ledger.job_state(1)} after its handler raised")
    st.raises.add("batch_put")
    st.mem.update({1: 1, 2: 2})
    w.receive("r", 2, 0)
    w.run_save(io_of(w), "r", 2, 2, [1, 2], HASHES[:2])
    raised = w.stats.total("store_exceptions")
    check(raised == 1, f"store_exceptions={raised}")
    check(w.take_reports() == {1: 1, 2: 1}, "a job whose handler or store call raised was not reported")


def probe_exception_in_a_load_reports_every_block() -> None:
    """A load whose handler raises is still finished, every block reported failed."""
    st = ProbeStore()
    w = rank(st)
    w.run_load(io_of(w), "r", [4, 5], [HASHES[0], b""])
    check(w.take_finished_loads() == {"r"}, "a load whose handler raised never finished")
    check(w.take_load_errors() == {4, 5}, "a load whose handler raised did not report its blocks")


def probe_put_resumes_at_the_saved_offset() -> None:
    """A second job of the request puts from the rank's saved offset: every block ends in the store."""
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2, 3: 3, 4: 4})
    w.receive("r", 1, 0)
    w.run_save(io_of(w), "r", 1, 2, [1, 2], HASHES[:2])
    w.receive("r", 2, 0)
    w.run_save(io_of(w), "r", 2, 4, [1, 2, 3, 4], HASHES[:4])
    keys = w.block_shape().builders[0].keys(HASHES[:4])
    lost = [i for i, k in enumerate(keys) if k not in st.data]
    check(not lost, f"blocks {lost} never reached the store (the put resumed past the saved offset)")
    puts = [c[1] for c in st.calls if c[0] == "batch_is_exist"]
    check(puts[-1] == keys[2:], "the second job did not resume at the saved offset")


def probe_stale_and_skipped_jobs_put_nothing() -> None:
    """A job of a superseded generation (the register path's generation check) and a pressure-skipped
    job put nothing and are reported."""
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    w.receive("r", 1, 0)
    w.receive("r", 2, 1)  # generation 1 arrives: generation 0's job 1 is stale
    plan = w.begin_save(1, 2)
    check(plan.verdict is Verdict.STALE, f"a job of a superseded generation is {plan.verdict.value}")
    w.report_save(1)
    st.put_codes[w.block_shape().builders[0].key(HASHES[0])] = -200
    w.run_save(io_of(w), "r", 2, 1, [1], HASHES[:1])  # pressure: generation 1 is skipped until a put succeeds
    w.receive("r", 3, 1)
    w.run_save(io_of(w), "r", 3, 2, [1, 2], HASHES[:2])
    check(not st.data, f"a stale or skipped job put {sorted(st.data)}")
    check(w.take_reports() == {1: 1, 2: 1, 3: 1}, "stale / skipped jobs not reported")


def block_pool(n: int) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(num_gpu_blocks=n + 1, enable_caching=False, hash_block_size=16)
    return pool, [b.block_id for b in pool.get_new_blocks(n)]


def probe_copy_on_write_tail_is_pinned() -> None:
    """open_job with a tail (blocks outside the table) pins the tail too and releases it with the job."""
    pool, ids = block_pool(4)
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=2, max_pinned_blocks=8)
    before = [pool.blocks[b].ref_cnt for b in ids]
    j = led.open_job("r", ids[:2], tail_block_ids=[ids[3]])
    check(j is not None, "a job within the caps was deferred")
    pinned = led.pinned_block_ids(j)  # type: ignore[arg-type]
    check(pinned == [ids[0], ids[1], ids[3]], f"pinned {pinned}, expected the table then the tail")
    refs = [pool.blocks[b].ref_cnt - r0 for b, r0 in zip(ids, before)]
    check(refs == [1, 1, 0, 1], f"pins added refs {refs}, expected [1, 1, 0, 1]")
    led.collect({j: 1})  # type: ignore[dict-item]
    after = [pool.blocks[b].ref_cnt for b in ids]
    check(after == before, f"refs after the release {after}, before the job {before}")


def probe_pin_cap_boundary() -> None:
    """Exactly at each cap (jobs in flight; block pins), the job that reaches it is admitted and the next
    one is deferred (nothing pinned, no id used), whatever the other cap's room."""
    pool, ids = block_pool(6)
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=2, max_pinned_blocks=100)
    a = led.open_job("a", ids[0:2])
    b = led.open_job("b", ids[2:4])
    check(a is not None and b is not None, "a job reaching max_inflight_jobs exactly was deferred")
    nxt = led.next_job_id
    check(led.open_job("c", ids[4:5]) is None, "a job above max_inflight_jobs was admitted")
    check(led.open_job("c", []) is None, "a job pinning no block was admitted above max_inflight_jobs")
    check(led.next_job_id == nxt, "a deferred job used an id")
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=100, max_pinned_blocks=4)
    a = led.open_job("a", ids[0:2])
    check(led.open_job("d", ids[3:6]) is None, "a job above max_pinned_blocks was admitted")
    check(led.open_job("d", ids[4:6]) is not None, "a job reaching max_pinned_blocks exactly was deferred")


def probe_aborted_load_keeps_its_blocks() -> None:
    """S9 LoadsPinned: a request whose async load is in flight is aborted (vLLM frees its blocks at once);
    until every rank reported the load, its destination blocks stay out of BlockPool's free queue and no
    new allocation gets them; after CollectLoad they are free again."""
    pool, ids = block_pool(3)
    led = SchedulerLedger(pool, world_size=2, max_inflight_jobs=2, max_pinned_blocks=4)
    dest = ids[:2]
    led.pin_load("r", dest)
    pool.free_blocks([pool.blocks[b] for b in dest])  # the abort: the request's own references go
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    check(not free & set(dest), f"S9 LoadsPinned: blocks {sorted(free & set(dest))} of a load in flight are in "
                                 f"the free queue after its request was aborted")
    got = [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]
    check(not set(got) & set(dest), f"S9 LoadsPinned: a new allocation got blocks {sorted(set(got) & set(dest))} "
                                     f"a rank may still be loading into")
    pool.free_blocks([pool.blocks[b] for b in got])
    led.collect_loads({"r": 1})  # one rank of two finished: still pinned
    check(led.num_load_pinned_blocks == 2, "a load's pins dropped after one rank of two reported")
    led.collect_loads({"r": 1})
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    check(set(dest) <= free, f"after every rank reported, blocks {sorted(set(dest) - free)} are not free")


def probe_reports_of_two_ranks_merge() -> None:
    """Both ranks report a job in one step: merged as vLLM's executor does, the job is released once, and
    the next step reports nothing again."""
    pool, ids = block_pool(2)
    led = SchedulerLedger(pool, world_size=2, max_inflight_jobs=2, max_pinned_blocks=4)
    j = led.open_job("r", ids)
    ranks = [rank(ProbeStore(), tp_rank=t) for t in (0, 1)]
    for w in ranks:
        w.receive("r", j, 0)  # type: ignore[arg-type]
        w.report_save(j)  # type: ignore[arg-type]
    meta = KVLedgerWorkerMetadata()
    for w in ranks:
        meta.aggregate(KVLedgerWorkerMetadata(w.take_reports()))
    check(meta.completed_saves == {j: 2}, f"two ranks' reports merged to {meta.completed_saves}")
    led.collect(meta.completed_saves)
    check(led.num_inflight_jobs == 0, "the job is still pinned after both ranks reported")
    again = [w.take_reports() for w in ranks]
    check(again == [{}, {}], f"reports taken twice: {again}")


def _layout(**kw: Any) -> KeyLayout:
    return KeyLayout(model="probe", tp_rank=0, tp_size=1, block_size=BLOCK_SIZE, dtype="torch.float32",
                     kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=8, **kw)


def parts_rank(store: ProbeStore, layouts: Sequence[KeyLayout], sub_batch: int = 2,
               reads: list[tuple[int, int]] | None = None) -> WorkerSteps:
    """A rank whose block is several keys, a key builder per part (a head shard of the TP-shared layout, a
    KV cache group of a hybrid model: `BlockShape.of_keys`, each part's group from its layout); ``reads``:
    every (block id, part) its buffers hand to a store call, in order."""
    def buffers(ids: list[int], parts: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
        if reads is not None:
            reads.extend(zip(ids, parts if parts is not None else [0] * len(ids)))
        return _buffers(ids)
    return with_edge(WorkerSteps(worker_config(sub_batch=sub_batch), probe_cache(buffers),
                                 ledger=WorkerLedger(0, max_live_jobs=8), loads=LoadLedger(0, max_inflight_loads=4),
                                 tp_rank=0, shape=BlockShape.of_keys([KeyBuilder(lay) for lay in layouts])), store)


def tp_shared_rank(store: ProbeStore, sub_batch: int = 3) -> WorkerSteps:
    """The TP-shared layout: a block is a key per head shard (2 here), one KV cache group."""
    return parts_rank(store, [_layout(heads=(j, 2)) for j in range(2)], sub_batch=sub_batch)


def hybrid_rank(store: ProbeStore, reads: list[tuple[int, int]] | None = None) -> WorkerSteps:
    """Two KV cache groups: 0 full attention, 1 a sliding window of 2 blocks."""
    return parts_rank(store, [_layout(), _layout(extra=(("group", "1"), ("window", str(2 * BLOCK_SIZE))))],
                      reads=reads)


def probe_a_block_of_several_keys_loads_only_when_every_key_did() -> None:
    """The TP-shared layout stores a block as a key per head shard (`LoadLedger.begin_load(keys_per_block=k)`):
    a block is loaded only once every key of it was read whole. A load cut short between a block's keys, or
    a later key of the block failing (in a later sub-batch or the same one), is a load error of that block."""
    st = ProbeStore()
    w = tp_shared_rank(st)  # sub-batches of 3 keys: block 5's two keys fall in two sub-batches
    shard = [w.block_shape().parts[j].builder.keys(HASHES[:3]) for j in range(2)]
    check(shard[0][0] != shard[1][0], f"head shards 0 and 1 share the key {shard[0][0]!r}")
    st.data.update(dict.fromkeys(shard[0] + shard[1], 1))
    gen = w.load_steps(io_of(w), "r", [4, 5], HASHES[:2])
    lid = next(gen).load_id  # EMIT_LOAD
    next(gen)  # the first sub-batch: block 4's two keys and block 5's first
    pend = w.loads.pending(lid)
    check(pend == [5], f"with 1 of block 5's 2 keys read the load's pending blocks are {pend}, expected [5]")
    gen.close()  # cut short (abandoned) before block 5's second key
    errs = w.take_load_errors()
    check(errs == {5}, f"a load cut short after 1 of block 5's 2 keys reported blocks {sorted(errs)}, expected [5]")
    check(w.take_finished_loads() == {"r"}, "the load cut short was not finished")
    del st.data[shard[1][1]]  # block 5's second key (the second sub-batch) missing
    st.get_codes[shard[1][2]] = KEY_BYTES // 2  # block 6's second key (the same sub-batch as its first) short
    res = w.run_load(io_of(w), "r", [4, 5, 6], HASHES[:3])
    check(res.loaded == {4} and res.failed == {5, 6},
          f"blocks whose second key failed: loaded {sorted(res.loaded)}, failed {sorted(res.failed)}; "
          f"expected loaded [4], failed [5, 6]")
    errs = w.take_load_errors()
    check(errs == {5, 6}, f"load errors reported {sorted(errs)}, expected [5, 6]")


def probe_a_rank_resuming_from_an_old_offset_never_reads_a_block_vllm_freed() -> None:
    """Two KV cache groups (0 full attention, 1 a sliding window): a job's ids are group-interleaved per block
    (`SentBlocks.resolve`: block b, group g at b * 2 + g), and a spec's `null_before` = (n0, n1) nulls
    group g's ids of blocks below n_g that earlier specs sent (vLLM freed them since). A rank whose put
    failed (its offset lags) resumes from block 0 and puts group 0's blocks there, never group 1's freed
    ones."""
    reads: list[tuple[int, int]] = []
    st = ProbeStore()
    w = hybrid_rank(st, reads)
    st.mem.update({b: b for b in (11, 21, 12, 22, 13, 23)})
    job = w.receive_save(SaveSpec("r", 1, 0, 0, 2, (11, 21, 12, 22), tuple(HASHES[:2]), num_groups=2))
    check(job is not None and job.block_ids == (11, 21, 12, 22),
          f"the first spec resolved to {job and job.block_ids}, expected (11, 21, 12, 22)")
    group1 = w.block_shape().parts[1].builder
    st.put_codes[group1.key(HASHES[1])] = -800  # group 1's key of block 1 fails: the offset stays 0
    assert job is not None
    w.run_save(io_of(w), "r", 1, job.end_block, job.block_ids, job.block_hashes, None, job.full_end_block)
    off = w.ledger.request("r").saved_offset  # type: ignore[union-attr]
    check(off == 0, f"a put with a failed key moved the offset to {off}")
    st.put_codes.clear()
    reads.clear()
    later = SaveSpec("r", 2, 0, 2, 3, (13, 23), (HASHES[2],), num_groups=2, null_before=(0, 2))
    job = w.receive_save(later)
    ids = job and job.block_ids
    check(ids == (11, 0, 12, 0, 13, 23),
          f"null_before=(0, 2) resolved the job's ids to {ids}, expected (11, 0, 12, 0, 13, 23): group 1's "
          f"blocks 0 and 1 null, group 0's kept")
    assert job is not None
    w.run_save(io_of(w), "r", 2, job.end_block, job.block_ids, job.block_hashes, None, job.full_end_block)
    freed = sorted({(21, 1), (22, 1)} & set(reads))
    check(not freed, f"the resuming rank read blocks {freed} (block id, group) that vLLM freed")
    check(sorted(reads) == [(13, 0), (23, 1)], f"the resuming put read {reads}, expected [(13, 0), (23, 1)]")
    off = w.ledger.request("r").saved_offset  # type: ignore[union-attr]
    check(off == 3 * BLOCK_SIZE, f"after the resumed put the offset is {off}, expected {3 * BLOCK_SIZE}")
    check(w.take_reports() == {1: 1, 2: 1}, "the jobs were not reported once each")


Probe = Callable[[], None]
PROBES: list[Probe] = [
    probe_partial_put_fails_the_job, probe_an_answer_of_the_wrong_length_fails_the_job,
    probe_pressure_anywhere_in_a_batch, probe_short_read_is_a_load_error,
    probe_rotated_load_reports_the_right_block, probe_exception_in_a_save_still_reports,
    probe_exception_in_a_load_reports_every_block, probe_put_resumes_at_the_saved_offset,
    probe_stale_and_skipped_jobs_put_nothing, probe_copy_on_write_tail_is_pinned, probe_pin_cap_boundary,
    probe_reports_of_two_ranks_merge, probe_aborted_load_keeps_its_blocks,
    probe_a_block_of_several_keys_loads_only_when_every_key_did,
    probe_a_rank_resuming_from_an_old_offset_never_reads_a_block_vllm_freed,
]


@dataclass
class ProbeRun:
    """What a run of probes found: the first named check that failed (probe name, what it saw), and
    every probe that crashed before it (name, exception and where)."""
    failed: tuple[str, str] | None = None
    crashes: list[tuple[str, str]] = field(default_factory=list)


@contextlib.contextmanager
def quiet(logger: str = "kvledger_connector.worker.steps") -> Iterator[None]:
    """A module's log (default the step functions') silenced: the probes' injected failures are expected,
    not news."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def run_probes(probes: Sequence[Probe] | None = None) -> ProbeRun:
    """Run ``probes`` (default: PROBES) in order until one fails a named check (:data:`NAMED_CHECKS`); a
    probe raising anything else is a crash: noted, and the next probe runs."""
    out = ProbeRun()
    with quiet():
        for p in PROBES if probes is None else probes:
            try:
                p()
            except NAMED_CHECKS as e:
                out.failed = (p.__name__, f"{type(e).__name__}: {e}")
                return out
            except Exception as e:  # noqa: BLE001 - a crash, reported as such
                out.crashes.append((p.__name__, raised(e)))
    return out
