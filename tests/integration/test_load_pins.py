"""Load pins through vLLM 0.32.0's real Scheduler, BlockPool and KVOutputAggregator (testbed.harness, 2
ranks, a real Mooncake master): the destination blocks of an async load stay pinned in the scheduler
ledger (S9 LoadsPinned) until EVERY rank finished the load, also when the request is aborted mid-load and
one rank already finished its part. The loads here are async ones (``sync_load_max_tokens=0``): a sync
load is begun and finished inside one engine step, so no abort can come in between."""
from __future__ import annotations

import threading
import time

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts

ASYNC = {"sync_load_max_tokens": 0}  # every load asynchronous: its request waits in WAITING_FOR_REMOTE_KVS


class GatedGet:
    """A test double around rank 1's store that holds its batch_get until `gate` is set, so that rank 0
    finishes the load first and rank 1 is still writing: a deterministic schedule, nothing else faked."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate

    def batch_get(self, *a):
        self.gate.wait(30)
        return self.inner.batch_get(*a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_aborted_load_stays_pinned_until_every_rank_finished(store_config: StoreConfig):
    from vllm.v1.request import RequestStatus

    prompt = shared_prefix_prompts(1, num_prefixes=1, prefix_len=64, suffix_len=8, seed=41)[0]
    gate = threading.Event()
    with Harness(store_config, tp_size=2, num_blocks=16, extra=ASYNC) as h:
        h.add_request("warm", prompt, 4)
        h.run()  # the prompt's blocks are saved by both ranks
        h.scheduler.reset_prefix_cache()  # so the next hit comes from the store, not vLLM's prefix cache
        ss = h.scheduler_connector.scheduler_side.steps
        ledger = ss.ledger
        rank0, rank1 = (w.worker_side for w in h.workers)
        rank1.io.store = GatedGet(rank1.io.store, gate)  # the store the rank's step functions call
        h.add_request("victim", prompt, 4)
        while "victim" not in ledger.pinned_loads():
            assert h.step()
        dest = ledger.load_pinned_block_ids("victim")
        assert dest and ledger.load_ranks_left("victim") == 2
        assert h.scheduler.requests["victim"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        # the request is aborted mid-load: vLLM frees its blocks at once (request_finished never delays)
        h.scheduler.finish_requests("victim", RequestStatus.FINISHED_ABORTED)
        assert _wait(lambda: rank0.steps.loads.num_inflight_loads == 0)  # rank 0 finished its part
        assert rank1.steps.loads.num_inflight_loads == 1  # rank 1 is still writing into `dest`
        for _ in range(3):  # engine steps go on: rank 0 reports, the aggregator waits for rank 1
            h.step()
            assert ledger.load_pinned_block_ids("victim") == dest
            free = {b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()}
            assert not free & set(dest)  # no other request can be given a block rank 1 writes
            assert all(h.block_pool.blocks[b].ref_cnt >= 1 for b in dest), \
                [h.block_pool.blocks[b].ref_cnt for b in dest]
        assert ss.has_pending_push_work()
        gate.set()
        assert _wait(lambda: rank1.steps.loads.num_inflight_loads == 0)
        h.run()
        assert "victim" not in ledger.pinned_loads() and ledger.num_load_pinned_blocks == 0
        free = {b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()}
        assert set(dest) <= free
        assert ledger.counts.total("loads_released") == ledger.counts.total("loads_pinned") >= 1
        assert h.check_at_rest() == []
        assert h.check_store()[1] == 0
