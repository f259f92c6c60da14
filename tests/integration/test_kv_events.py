"""KV events for KV-aware routers, through vLLM's own path: the real Scheduler collects the connector's
``take_events()`` in ``update_from_output`` into its `KVEventBatch` and publishes it with vLLM's ZMQ publisher
(``kv_events_config``); the test subscribes to that socket like a router does and decodes vLLM's msgpack.

Checked: a BlockStored (medium CPU) for every saved block, once every rank reported it, with the request's
block hashes as vLLM computed them (the same hashes vLLM's own GPU-pool BlockStored events carry), its tokens
and parent chain; a BlockRemoved when a lookup finds an announced block gone; a BlockRemoved for every
announced block after reset_cache; and the pending-event cap (oldest dropped, counted)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm import SamplingParams
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request

from kvledger_connector.config import StoreConfig
from kvledger_connector.telemetry.events import StoreEvents
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from testbed.faults import FaultPlan, FaultRule, FaultyStore, HeldPuts
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 4
BS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Router:
    """A ZMQ subscriber to vLLM's KV event publisher, as a KV-aware router runs one."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # before bind: the publisher that connects gets it at once
        self.sub.bind(endpoint)  # vLLM's publisher binds only wildcard endpoints; to a host:port it connects
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def handshake(self, publisher: Any, timeout_s: float = 10.0) -> None:
        """ZMQ drops what a PUB sends before the connection is up: send empty batches through vLLM's publisher
        until one arrives."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            if self.sub.poll(100):
                self.drain(0.2)
                return
        raise TimeoutError(f"no batch from vLLM's publisher in {timeout_s} s")

    def drain(self, quiet_s: float = 1.0) -> list[Any]:
        """Every batch published until nothing arrives for `quiet_s`."""
        while self.sub.poll(int(quiet_s * 1000)):
            _topic, _seq, payload = self.sub.recv_multipart()
            self.events.extend(self.decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def _hashes(h: Harness, prompt: list[int]) -> list[Any]:
    """The prompt's block hashes as vLLM's events carry them (``maybe_convert_block_hash``: 64-bit ints by
    default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    req = Request("probe", prompt, SamplingParams(max_tokens=1), None, block_hasher=h._hasher)
    return [maybe_convert_block_hash(bh) for bh in req.block_hashes]


def _raw_hashes(h: Harness, prompt: list[int]) -> list[bytes]:
    return list(Request("probe", prompt, SamplingParams(max_tokens=1), None, block_hasher=h._hasher).block_hashes)


def _of_medium(events: list[Any], kind: type, medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and e.medium == medium]


def test_events_published_through_vllms_scheduler(store_config: StoreConfig):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    kvev = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    router = _Router(endpoint)
    prompts = shared_prefix_prompts(3, num_prefixes=1, prefix_len=48, suffix_len=16, seed=5)
    try:
        with Harness(store_config, tp_size=2, extra={"namespace": "events"}, kv_events=kvev) as h:
            router.handshake(h.scheduler.kv_event_publisher)
            for i, p in enumerate(prompts):
                h.add_request(f"r{i}", p, MAX_TOKENS)
            h.run()
            assert h.garbage == [] and h.check_at_rest() == []
            events = router.drain()
            stored = _of_medium(events, BlockStored, MEDIUM_CPU)
            gpu = _of_medium(events, BlockStored, "GPU")
            assert stored and gpu
            # every saved block announced once, under vLLM's own hash of that block
            want: dict[Any, list[int]] = {}
            for p in prompts:
                for j, bh in enumerate(_hashes(h, p)[:len(p) // BS]):
                    want[bh] = p[j * BS:(j + 1) * BS]
            got = [bh for e in stored for bh in e.block_hashes]
            assert len(got) == len(set(got))
            assert set(got) == set(want)
            gpu_hashes = {bh for e in gpu for bh in e.block_hashes}
            assert set(got) <= gpu_hashes  # the same hashes vLLM's GPU pool announced for these blocks
            all_hashes = {i: _hashes(h, p) for i, p in enumerate(prompts)}
            for e in stored:
                assert e.block_size == BS and e.group_idx == 0 and e.lora_id is None
                assert e.token_ids == [t for bh in e.block_hashes for t in want[bh]]
                # the prompts share their first blocks: an event's run lies in the chain of *some* prompt
                first, n = e.block_hashes[0], len(e.block_hashes)
                runs = [(hs.index(first), hs) for hs in all_hashes.values() if first in hs]
                assert any(hs[k:k + n] == e.block_hashes
                           and e.parent_block_hash == (hs[k - 1] if k > 0 else None) for k, hs in runs)
            ss = h.scheduler_connector.scheduler_side.steps
            assert ss.events is not None and ss.events.num_announced == len(want)

            # a block the store lost: the next lookup that sees it missing announces its removal
            victim = _hashes(h, prompts[0])[1]
            victim_key = h.key_builders[1].key(_raw_hashes(h, prompts[0])[1])
            rc = h.workers[1].store.remove(victim_key, force=True)  # rank 1's shard only
            assert rc == 0
            assert h.scheduler.reset_prefix_cache() is True  # GPU pool only: the lookup must start at block 0
            h.add_request("again", prompts[0], MAX_TOKENS)
            h.run()
            events = router.drain()
            removed = _of_medium(events, BlockRemoved, MEDIUM_CPU)
            assert [bh for e in removed for bh in e.block_hashes] == [victim]

            # reset_cache through vLLM's reset_prefix_cache: every announced block removed, in the next batch
            announced = {maybe_convert_block_hash(bh) for _, bh in ss.events._announced}
            n_before = len(router.events)
            assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
            h.wait_reset_removals()  # until then the store's answers are withheld: nothing would be announced
            h.add_request("after-reset", prompts[1], MAX_TOKENS)  # a step: update_from_output publishes
            h.run()
            events = router.drain()[n_before:]
            removed = _of_medium(events, BlockRemoved, MEDIUM_CPU)
            assert removed and set(removed[0].block_hashes) == announced
            assert any(isinstance(e, AllBlocksCleared) for e in events)  # vLLM's own (GPU pool reset)
            # ...and the re-saved blocks of the request after the reset are announced again
            assert _of_medium(events, BlockStored, MEDIUM_CPU)
            h.scheduler.shutdown()  # stops vLLM's publisher thread (also shuts the connector down)
    finally:
        router.close()


def test_block_stored_only_once_every_rank_holds_the_block(store_config: StoreConfig):
    """Rank 1's report held back: nothing announced while rank 0 alone reported. Then rank 1's put fails
    (FaultyStore): both ranks report the job, but the store lacks rank 1's shard, so nothing is announced."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    kvev = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    router = _Router(endpoint)
    p0, p1 = shared_prefix_prompts(2, num_prefixes=2, prefix_len=48, suffix_len=16, seed=21)
    gate = threading.Event()
    try:
        with Harness(store_config, tp_size=2, extra={"namespace": "ranks"}, kv_events=kvev) as h:
            router.handshake(h.scheduler.kv_event_publisher)
            ss = h.scheduler_connector.scheduler_side.steps
            real = h.workers[1].worker_side.io.store
            h.workers[1].worker_side.io.store = HeldPuts(real, gate)
            h.add_request("r0", p0, MAX_TOKENS)
            try:
                while "r0" not in h.stats.finished:
                    h.step()
                job = ss.ledger.inflight_jobs()[0]
                deadline = time.monotonic() + 30
                while ss.ledger.ranks_left(job) == 2 and time.monotonic() < deadline:
                    h.step()  # until rank 0's report is collected; rank 1's is held
                assert ss.ledger.num_inflight_jobs == 1 and ss.ledger.ranks_left(job) == 1
                assert _of_medium(router.drain(), BlockStored, MEDIUM_CPU) == []
            finally:
                gate.set()
            h.run()
            n0 = len(p0) // BS
            assert sorted(bh for e in _of_medium(router.drain(), BlockStored, MEDIUM_CPU)
                          for bh in e.block_hashes) == sorted(_hashes(h, p0)[:n0])

            h.workers[1].worker_side.io.store = FaultyStore(real, FaultPlan([
                FaultRule("put", "code", code=int(StoreCode.NO_AVAILABLE_HANDLE))]))
            n_events = len(router.events)
            h.add_request("r1", p1, MAX_TOKENS)
            h.run()
            assert ss.ledger.counts.total("jobs_released") == ss.ledger.num_jobs_opened  # reported by both ranks
            fresh = set(_hashes(h, p1)[:len(p1) // BS]) - set(_hashes(h, p0))
            announced = {bh for e in _of_medium(router.drain()[n_events:], BlockStored, MEDIUM_CPU)
                         for bh in e.block_hashes}
            assert fresh and not (fresh & announced)
            h.workers[1].worker_side.io.store = real
            h.scheduler.shutdown()
    finally:
        router.close()


def _job_request(prompt: list[int]) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    init_none_hash(sha256)
    return Request("job", prompt, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def test_pending_events_are_bounded_oldest_dropped(shared_store: MooncakeStore, key_prefix: str):
    """The cap on events held between two steps, hit: 5 collected jobs' events with room for 2. The store is
    the session's real master; the jobs are recorded as the scheduler side does at EmitStore."""
    lay = KeyLayout(model=key_prefix + "m", tp_rank=0, tp_size=1, block_size=BS, dtype="torch.float32",
                    kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=4)
    kb = KeyBuilder(lay)
    ev = StoreEvents(key_builders=[kb], store=shared_store, block_size=BS, max_pending=2)
    reqs = [_job_request(list(range(100 * i, 100 * i + 2 * BS))) for i in range(5)]
    for job_id, r in enumerate(reqs):
        for bh in r.block_hashes[:1]:  # block 0 of each stored; block 1 missing (a failed put)
            assert shared_store.raw.put(kb.key(bh), b"x" * 64) == 0
        ev.job_opened(job_id, r, 0, 2)
    ev.jobs_collected({j: 1 for j in range(5)}, still_pinned=lambda j: j == 4)  # job 4 not done yet
    assert ev.stats.total("kv_events_dropped") == 2
    taken = ev.take()
    assert [e.block_hashes for e in taken] == [[maybe_convert_block_hash(reqs[i].block_hashes[0])] for i in (2, 3)]
    assert ev.take() == [] and ev.num_pending == 0
    ev.jobs_collected({4: 1}, still_pinned=lambda j: False)
    assert [e.block_hashes for e in ev.take()] == [[maybe_convert_block_hash(reqs[4].block_hashes[0])]]
    for r in reqs:
        shared_store.remove(kb.key(r.block_hashes[0]), force=True)


def test_announced_set_is_bounded_and_reset_then_clears_all(shared_store: MooncakeStore, key_prefix: str):
    """Past `max_announced` the oldest hashes are forgotten; a reset then cannot name every removed block and
    sends AllBlocksCleared instead (a router over-clears rather than keeping stale hints)."""
    lay = KeyLayout(model=key_prefix + "m", tp_rank=0, tp_size=1, block_size=BS, dtype="torch.float32",
                    kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=4)
    kb = KeyBuilder(lay)
    ev = StoreEvents(key_builders=[kb], store=shared_store, block_size=BS, max_announced=3)
    r = _job_request(list(range(4 * BS + 1)))
    for bh in r.block_hashes:
        assert shared_store.raw.put(kb.key(bh), b"x" * 64) == 0
    ev.job_opened(0, r, 0, 4)
    ev.jobs_collected({0: 1}, still_pinned=lambda j: False)
    assert ev.num_announced == 3 and ev.lost_track
    ev.take()
    ev.store_reset()
    assert [type(e) for e in ev.take()] == [AllBlocksCleared]
    assert ev.num_announced == 0 and not ev.lost_track
    for bh in r.block_hashes:
        shared_store.remove(kb.key(bh), force=True)


@pytest.mark.parametrize("bad", [0, -1, True, "10"])
def test_max_kv_events_refuses_bad_values(store_config: StoreConfig, bad: Any):
    from kvledger_connector.config import ConfigError
    kvev = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with pytest.raises(ConfigError, match="max_kv_events"):
        Harness(store_config, extra={"max_kv_events": bad}, kv_events=kvev)


def test_a_hybrid_models_groups_are_announced_each_with_its_spec(store_config: StoreConfig):
    """The gpt-oss-like stand-in (sliding window 64 and full attention): each KV cache group's stored blocks
    are announced on their own (``group_idx``), with the kind and window vLLM's own events give that group,
    and a block the store lost from one group only is removed from that group only."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    kvev = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    router = _Router(endpoint)
    prompts = shared_prefix_prompts(3, num_prefixes=1, prefix_len=96, suffix_len=16, seed=8)
    try:
        with Harness(store_config, sliding_window=64, num_layers=4, num_blocks=96, kv_events=kvev,
                     extra={"namespace": "events-hybrid"}) as h:
            router.handshake(h.scheduler.kv_event_publisher)
            h.run_pass(prompts, MAX_TOKENS, "a")
            events = router.drain()
            stored = _of_medium(events, BlockStored, MEDIUM_CPU)
            gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
            want = {maybe_convert_block_hash(bh) for p in prompts for bh in _raw_hashes(h, p)[:len(p) // BS]}
            spec_of = {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in gpu}
            assert sorted(spec_of) == [0, 1] and sorted(w is None for _, w in spec_of.values()) == [False, True]
            sliding = next(g for g, (_, w) in spec_of.items() if w is not None)
            for g in (0, 1):
                mine = [e for e in stored if e.group_idx == g]
                # full attention: every block; sliding window: the blocks vLLM's own prefix cache kept (its
                # GPU events), by the one rule both follow (the windows behind the reachable boundaries)
                vllm_kept = {bh for e in gpu if e.group_idx == g for bh in e.block_hashes}
                assert {bh for e in mine for bh in e.block_hashes} == (vllm_kept if g == sliding else want)
                assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in mine} == {spec_of[g]}
            # the sliding group's key of one block lost: only that group's block is removed
            announced = {bh for e in stored if e.group_idx == sliding for bh in e.block_hashes}
            victim = next(bh for bh in _raw_hashes(h, prompts[0]) if maybe_convert_block_hash(bh) in announced)
            kb = h.workers[0].worker_side.steps.block_shape().builders[sliding]
            assert h.workers[0].store.remove(kb.key(victim), force=True) == 0
            assert h.scheduler.reset_prefix_cache() is True
            h.add_request("again", prompts[0], MAX_TOKENS)
            h.run()
            removed = _of_medium(router.drain(), BlockRemoved, MEDIUM_CPU)
            assert [(e.group_idx, bh) for e in removed for bh in e.block_hashes] == [
                (sliding, maybe_convert_block_hash(victim))]
    finally:
        router.close()
