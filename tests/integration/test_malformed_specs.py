"""Property: whatever specs the worker receives, well-formed or malformed, in the metadata types vLLM hands it
(`KVLedgerConnectorMetadata` of LoadSpec / SaveSpec / DropNotice, pickled across the process boundary as vLLM
ships them), the real worker steps (`WorkerSide.end_step`, `start_step`) on a real Mooncake master with
integrity 'mac' on:

- never raise into the model runner;
- finish every request's load (async: finished_recving; sync: completed_loads), with exactly the blocks that
  were not loaded reported failed: every real block a malformed spec names, a well-formed load's blocks
  whose object is missing or tampered, nothing else; a loaded block holds the bytes that were saved;
- report every save job once (a malformed spec's at once, with nothing written), except a spec whose job id
  is not one or is another job's (a second report would count twice);
- remove no store object, except one that fails its integrity tag (removed by the store thread);
- release every held request a notice releases, even a malformed notice.

Hypothesis (the CI profile of tests/conftest.py: derandomized, no database, no deadline) draws each step's
cases; the oracle is built from the shipped `reportable_blocks`."""
from __future__ import annotations

import itertools
import os
import pickle
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.probes_specs import worker_side
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.metadata import (DropNotice, KVLedgerConnectorMetadata, LoadSpec, SaveSpec,
                                         reportable_blocks)
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.worker.side import WorkerSide
from tests.reports import merged, report_until

NUM_BLOCKS = 64
SAVE_BLOCKS = range(1, 32)  # saves read these blocks ...
LOAD_BLOCKS = range(32, NUM_BLOCKS)  # ... loads write these: a load never changes a block a later save reads
SAVE_KINDS = ["ok", "ok", "ok", "neg_gen", "float_gen", "dup_ids", "id_past", "id_null", "neg_job", "float_job",
              "dup_job", "hash_missing", "ids_short", "no_req"]
LOAD_KINDS = ["hit", "hit", "miss", "mixed", "neg_id", "float_id", "id_past", "id_null", "dup_ids", "hash_missing",
              "bad_group", "no_req", "refused_bad_id"]
DROP_KINDS = ["ok", "neg_gen", "str_gen", "bad_finished", "no_req"]


@dataclass(repr=False)
class _Rank:
    ws: WorkerSide
    kv: dict[str, torch.Tensor]
    store: MooncakeStore
    ids: Iterator[int]  # fresh job ids, req ids: examples never share one
    step: Iterator[int]
    attack: torch.Tensor  # another client's buffer, registered with the store once

    def __repr__(self) -> str:
        return "rank"

    def drain(self) -> list[Any]:
        """What the worker still has to report (an example that failed leaves some behind)."""
        report = self.ws.take_report()
        return [report] if report else []


@pytest.fixture(scope="module")
def rank(mooncake: EmbeddedMooncake) -> Iterator[_Rank]:
    cfg = StoreConfig(global_segment_size=128 << 20, local_buffer_size=4 << 20,
                      rpc_timeout_ms=2000).with_addresses(mooncake.master_address, mooncake.metadata_server)
    store = MooncakeStore.connect(cfg)
    ws, kv = worker_side(store, num_blocks=NUM_BLOCKS, secret=os.urandom(32), model=f"specs-{uuid.uuid4().hex[:8]}")
    attack = torch.zeros(ws.steps.key_bytes, dtype=torch.uint8)
    store.register_buffer(attack.data_ptr(), attack.numel())
    try:
        yield _Rank(ws, kv, store, itertools.count(1), itertools.count(1), attack)
    finally:
        ws.shutdown()
        store.close()


def _meta(r: _Rank, **kw: Any) -> KVLedgerConnectorMetadata:
    """The step's metadata as a worker process receives it: pickled across the process boundary."""
    return pickle.loads(pickle.dumps(KVLedgerConnectorMetadata(step=next(r.step), **kw)))


def _wait(pred: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def _block(r: _Rank, b: int) -> bytes:
    return b"".join(bytes(t[b].view(torch.uint8).flatten().tolist()) for t in r.kv.values())


def _tamper(r: _Rank, key: str) -> None:
    """Another client replaces ``key``'s object with same-size random bytes (what integrity catches)."""
    buf = r.attack
    buf.copy_(torch.randint(0, 256, tuple(buf.shape), dtype=torch.uint8))
    assert r.store.remove(key, True) == 0
    assert r.store.batch_put([key], [[buf.data_ptr()]], [[buf.numel()]]) == [0]


def _save_spec(r: _Rank, kind: str, n: int, blocks: list[int], live_job: int | None) -> tuple[SaveSpec, bool]:
    """(one save of this kind over ``blocks``, whether its job must be reported)."""
    job, req = next(r.ids), f"s{next(r.ids)}"
    hashes = tuple(os.urandom(32) for _ in range(n))
    ids: tuple[Any, ...] = tuple(blocks[:n])
    gen: Any = 0
    report = True
    if kind == "neg_gen":
        gen = -1
    elif kind == "float_gen":
        gen = 0.0
    elif kind == "dup_ids":
        ids = (ids[0],) * n if n > 1 else (ids[0], ids[0])
        hashes = tuple(os.urandom(32) for _ in ids)
        n = len(ids)
    elif kind == "id_past":
        ids = ids[:-1] + (NUM_BLOCKS,)
    elif kind == "id_null":
        ids = (0,) + ids[1:]
    elif kind == "neg_job":
        job, report = -job, False
    elif kind == "float_job":
        job, report = float(job), False  # type: ignore[assignment]
    elif kind == "dup_job":
        job, report = (live_job, False) if live_job is not None else (job, True)  # type: ignore[assignment]
        if live_job is None:
            ids = (-1,) + ids[1:]  # nothing to duplicate yet: another malformed spec instead
    elif kind == "hash_missing":
        hashes = hashes[:-1]
    elif kind == "ids_short":
        ids = ids[:-1]
    elif kind == "no_req":
        req = ""
    return SaveSpec(req, job, gen, 0, n, ids, hashes), report


def _load_spec(r: _Rank, kind: str, blocks: list[int], stored: list[bytes], sync: bool) -> LoadSpec:
    req = f"l{next(r.ids)}"
    n = len(blocks)
    fresh = [os.urandom(32) for _ in range(n)]
    hashes = [stored[i % len(stored)] for i in range(n)] if kind == "hit" and stored else fresh
    if kind == "mixed" and stored:
        hashes = [stored[0]] + fresh[1:]
    ids: list[Any] = list(blocks)
    groups: tuple[Any, ...] = ()
    refused = ""
    if kind == "neg_id":
        ids[-1] = -ids[-1]
    elif kind == "float_id":
        ids[0] = float(ids[0])
    elif kind == "id_past":
        ids.append(NUM_BLOCKS + 3)
        hashes.append(os.urandom(32))
    elif kind == "id_null":
        ids[0] = 0
    elif kind == "dup_ids":
        ids.append(ids[0])
        hashes.append(os.urandom(32))
    elif kind == "hash_missing":
        hashes = hashes[:-1]
    elif kind == "bad_group":
        groups = (1,) * n
    elif kind == "no_req":
        req = None  # type: ignore[assignment]
    elif kind == "refused_bad_id":
        ids[0], hashes, refused = -5, [], "probe"
    return LoadSpec(req, tuple(ids), tuple(hashes), sync=sync, groups=groups, refused=refused)


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    return {
        "saves": draw(st.lists(st.tuples(st.sampled_from(SAVE_KINDS), st.integers(1, 3)), min_size=1, max_size=4)),
        "loads": draw(st.lists(st.tuples(st.sampled_from(LOAD_KINDS), st.integers(1, 3), st.booleans()),
                               min_size=1, max_size=5)),
        "drops": draw(st.lists(st.tuples(st.sampled_from(DROP_KINDS), st.booleans()), max_size=3)),
        "tamper": draw(st.booleans()),
    }


@settings(max_examples=100)
@given(case=_cases())
def test_any_specs_finish_every_load_report_every_failed_block_and_remove_no_good_object(rank: _Rank,
                                                                                          case: dict[str, Any]):
    r, ws = rank, rank.ws
    _wait(lambda: not ws.busy(), "the worker's threads did not finish an earlier example")
    r.drain()  # left by an earlier example that failed: this one starts from nothing owed
    # ---- step 1: saves (end_step, as wait_for_save calls it)
    saves: list[SaveSpec] = []
    owed: dict[int, int] = {}
    live: int | None = None
    for i, (kind, n) in enumerate(case["saves"]):
        spec, report = _save_spec(r, kind, n, list(SAVE_BLOCKS[i * 4:i * 4 + 4]), live)
        saves.append(spec)
        if report:
            owed[spec.store_job_id] = 1
        if kind == "ok":
            live = spec.store_job_id
    ws.end_step(_meta(r, saves=saves))
    _wait(lambda: not ws.busy(), "the store thread did not finish the step's jobs")
    meta = ws.take_report().worker_meta
    assert (meta.completed_saves if meta is not None else {}) == owed, "a job not reported once, or reported twice"
    good = [s for s, (kind, _) in zip(saves, case["saves"]) if kind == "ok"]
    bad = [s for s, (kind, _) in zip(saves, case["saves"]) if kind != "ok"]
    kb = ws.steps.block_shape().builders[0]
    assert kb is not None
    stored_keys = {kb.key(h): (s.block_ids[j], h) for s in good for j, h in enumerate(s.block_hashes)}
    if stored_keys:
        assert r.store.batch_is_exist(list(stored_keys)) == [1] * len(stored_keys), "a well-formed save not stored"
    written = [kb.key(h) for s in bad for h in s.block_hashes if isinstance(h, bytes)]
    if written:
        assert r.store.batch_is_exist(written) == [0] * len(written), "a malformed save wrote an object"
    stored = [h for _, h in stored_keys.values()]
    tampered: set[str] = set()
    if case["tamper"] and stored:
        key = kb.key(stored[0])
        _tamper(r, key)
        tampered.add(key)

    # ---- step 2: drops and loads (start_step, as start_load_kv calls it)
    free = list(LOAD_BLOCKS)
    loads = []
    for kind, n, sync in case["loads"]:
        blocks, free = free[:n], free[n:]
        loads.append(_load_spec(r, kind, blocks, stored, sync))
    if tampered:  # a well-formed load that reads the tampered object
        blocks, free = free[:1], free[1:]
        loads.append(LoadSpec(f"l{next(r.ids)}", tuple(blocks), (stored[0],), sync=bool(len(loads) % 2)))
    drops, released = [], set()
    for kind, release in case["drops"]:
        req = f"d{next(r.ids)}"
        nt = {"ok": DropNotice(req, 0, True, release), "neg_gen": DropNotice(req, -1, False, release),
              "str_gen": DropNotice(req, "0", True, release),  # type: ignore[arg-type]
              "bad_finished": DropNotice(req, 0, None, release),  # type: ignore[arg-type]
              "no_req": DropNotice(None, 0, True, release)}[kind]  # type: ignore[arg-type]
        drops.append(nt)
        if release and kind != "no_req":
            released.add(req)
    ws.start_step(_meta(r, loads=loads, drops=drops))
    first = ws.take_report()
    assert first.finished_sending == released

    # every request's load finishes: sync ones before the forward, async ones through finished_recving
    named = [s for s in loads if isinstance(s.req_id, str) and s.req_id]
    meta = first.worker_meta
    assert (meta.completed_loads if meta is not None else {}) == {s.req_id: 1 for s in named if s.sync}
    waiting = {s.req_id for s in named if not s.sync}
    report = merged(first, report_until(ws, lambda got: waiting <= first.finished_recving | got.finished_recving))
    _wait(lambda: not ws.busy(), "the worker's threads did not finish")
    report = merged(report, ws.take_report())

    # exactly the blocks not loaded are reported failed
    want: set[int] = set()
    for s, (kind, _, _) in zip(loads, case["loads"] + [("hit", 1, False)] * len(tampered)):
        if kind in ("hit", "miss", "mixed"):
            for b, h in zip(s.block_ids, s.block_hashes):
                if h not in stored or kb.key(h) in tampered:
                    want.add(b)
                else:
                    src = stored_keys[kb.key(h)][0]
                    assert _block(r, b) == _block(r, src), f"block {b} loaded other bytes than were saved"
        elif s.req_id:
            want |= set(reportable_blocks(s.block_ids, NUM_BLOCKS))
    assert report.invalid_block_ids == want

    # no object removed but the tampered one (by the store thread, once it is woken)
    _wait(lambda: not tampered or r.store.batch_is_exist(sorted(tampered)) == [0] * len(tampered),
          "the tampered object was not removed")
    others = [k for k in stored_keys if k not in tampered]
    if others:
        assert r.store.batch_is_exist(others) == [1] * len(others), "a good object was removed"
    # the saving requests finish, as the scheduler tells every rank (their request states go)
    ws.start_step(_meta(r, drops=[DropNotice(s.req_id, 0, True) for s in good]))
    assert ws.steps.ledger.num_requests == 0
    assert r.drain() == [], "reported twice, or late"
