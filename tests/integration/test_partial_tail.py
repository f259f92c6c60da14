"""Partial-tail saves and hits (`save_partial_tail`, opt-in) through vLLM 0.32.0's real Scheduler, BlockPool
and KVOutputAggregator (testbed.harness, 2 ranks, a real Mooncake master).

A prompt of L = k * block_size + r tokens (r >= 2) keeps r tokens of KV in its table block k. With the
option on, the store job that completes the prompt also puts block k under the tail's own key, pinned
through the ledger's tail_block_ids; a second request with the same prompt then loads L - 1 tokens
(k full blocks and r - 1 tail tokens) and computes only the last one. The harness's forward checks that
every position it did not write holds the right KV (S7), and check_store compares every stored key,
tail keys included, with the KV its block must hold (S1 NoPollution).
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvledger_connector.config import StoreConfig
from testbed.faults import HeldPuts
from testbed.harness import Harness, shared_prefix_prompts

BS = 16  # the harness's block size


@contextlib.contextmanager
def _opens(gate: threading.Event):
    """Open the gate on the way out, also when the test fails, so the store threads can stop."""
    try:
        yield
    finally:
        gate.set()


def _gate_puts(h: Harness, gate: threading.Event) -> None:
    for w in h.workers:
        w.worker_side.io.store = HeldPuts(w.worker_side.io.store, gate)  # a test double: holds puts, nothing else


def _preempt_all(h: Harness) -> None:
    """vLLM's own preemption path: reset_prefix_cache(reset_running_requests=True) preempts every running
    request (the ids reach the connector through the next step's preempted_req_ids). The cache reset itself
    then fails, because pinned blocks are not free, and vLLM raises; the requests are preempted all the same."""
    running = {r.request_id for r in h.scheduler.running}
    try:
        h.scheduler.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError:
        pass
    assert running and not {r.request_id for r in h.scheduler.running} & running


def _prompt(seed: int, full_blocks: int = 4, tail: int = 5) -> list[int]:
    return shared_prefix_prompts(1, num_prefixes=1, prefix_len=full_blocks * BS, suffix_len=tail, seed=seed)[0]


@pytest.mark.parametrize("tail", [True, False], ids=["save_partial_tail", "full_blocks_only"])
def test_tail_is_saved_and_a_repeated_prompt_loads_all_but_its_last_token(store_config: StoreConfig, tail: bool):
    prompt = _prompt(51)  # 4 full blocks + 5 tokens
    with Harness(store_config, tp_size=2, num_blocks=24, extra={"save_partial_tail": tail}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        h.add_request("a", prompt, 3)
        h.run()
        assert ss.stats.total("tail_saves") == (1 if tail else 0)
        h.scheduler.reset_prefix_cache()  # the next hit must come from the store
        h.add_request("b", prompt, 3)
        h.run()
        assert ss.stats.total("loads_emitted") == 1
        assert ss.stats.total("tail_hits") == (1 if tail else 0)
        assert h.garbage == []  # the loaded tail holds the right KV (S7): the forward checked every slot
        assert h.stats.outputs["b"] == h.expected_output(prompt, 3)
        checked, polluted = h.check_store()
        assert polluted == 0
        assert h.tails_checked == (2 if tail else 0)  # one tail key per rank
        assert h.check_at_rest() == []


@pytest.mark.parametrize("model", ["hybrid", "tp_shared"])
def test_a_tail_of_a_block_stored_as_several_keys_is_saved_and_loaded_by_every_key(
        store_config: StoreConfig, model: str):
    """A block stored as several keys (a sliding-window hybrid: a key per KV cache group; the TP-shared
    layout: a key per KV-head shard): the prompt's partial tail is one key per part, each staged and tagged
    from the bytes it puts; a repeated prompt loads all but its last token from every part's tail key, and
    every tail key holds its part's KV (S1)."""
    prompt = _prompt(53, full_blocks=10)  # 10 full blocks + 5 tokens: longer than the window's 8 blocks
    extra = {"save_partial_tail": True}
    kw = ({"sliding_window": 128, "num_layers": 4, "num_blocks": 48} if model == "hybrid"
          else {"num_blocks": 24, "extra": {**extra, "kv_heads_per_key": 1}})
    with Harness(store_config, tp_size=2, extra=extra, **{k: v for k, v in kw.items() if k != "extra"}) \
            if model == "hybrid" else Harness(store_config, tp_size=2, **kw) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        parts = len(h.workers[0].worker_side.steps.block_shape().builders)
        assert parts == 2
        h.add_request("a", prompt, 3)
        h.run()
        assert ss.stats.total("tail_saves") == 1
        h.scheduler.reset_prefix_cache()
        h.add_request("b", prompt, 3)
        h.run()
        assert ss.stats.total("tail_hits") == 1 and h.scheduler_connector.stats.total("loaded_tokens") == len(prompt) - 1
        assert h.garbage == [] and h.stats.outputs["b"] == h.expected_output(prompt, 3)
        checked, polluted = h.check_store()
        assert polluted == 0 and h.tails_checked == 2 * parts  # a tail key per part and rank
        assert h.check_at_rest() == []


def test_tail_hit_answers_the_prompt_minus_one_token(store_config: StoreConfig):
    """The lookup's answer itself: k full blocks plus r - 1 tail tokens with the option on, and a prompt
    whose tail differs in one token gets the full blocks only. Async loads: the answer is what
    num_computed_tokens holds while the request waits (a sync load computes the last token in that step)."""
    prompt = _prompt(52, full_blocks=3, tail=7)  # L = 55
    with Harness(store_config, tp_size=2, num_blocks=24,
                 extra={"save_partial_tail": True, "sync_load_max_tokens": 0}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        h.add_request("a", prompt, 2)
        h.run()
        h.scheduler.reset_prefix_cache()
        other = prompt[:-1] + [(prompt[-1] + 1) % 1000 + 1]
        h.add_request("same", prompt, 2)
        h.add_request("other", other, 2)
        ext = {}
        while not {"same", "other"} <= ext.keys():
            h.step()
            for rid in ("same", "other"):
                req = h.scheduler.requests.get(rid)
                if rid not in ext and req is not None and req.num_computed_tokens > 0:
                    ext[rid] = req.num_computed_tokens
        h.run()
        assert ext["same"] == len(prompt) - 1  # 3 * 16 + 6: everything but the last token
        assert ext["other"] in (3 * BS, len(prompt))  # the full blocks (or computed in one step)
        assert ss.stats.total("tail_hits") == 1
        assert h.garbage == []
        assert h.check_store()[1] == 0
        assert h.check_at_rest() == []


def test_preemption_while_a_tail_save_is_in_flight(store_config: StoreConfig):
    """The request is preempted (vLLM frees its table) while its tail job's puts are held: the tail block
    stays pinned (never free, never another request's) until every rank reported, the resumed request
    computes into other blocks, and the stored tail holds the preempted generation's prompt KV."""
    prompt = _prompt(53)
    filler = _prompt(54, full_blocks=2, tail=3)
    gate = threading.Event()
    with Harness(store_config, tp_size=2, num_blocks=16, extra={"save_partial_tail": True}) as h, _opens(gate):
        ss = h.scheduler_connector.scheduler_side.steps
        ledger = ss.ledger
        _gate_puts(h, gate)
        h.add_request("a", prompt, 6)
        while ss.stats.total("tail_saves") == 0:
            assert h.step()
        (job,) = ledger.inflight_jobs()
        pinned = ledger.pinned_block_ids(job)
        table = h.scheduler.kv_cache_manager.get_block_ids("a")[0]
        tail_block = table[len(prompt) // BS]
        assert pinned[-1] == tail_block and len(pinned) == len(prompt) // BS + 1  # full blocks, then the tail
        _preempt_all(h)
        h.add_request("filler", filler, 4)  # wants blocks while the pinned ones must not be handed out
        for _ in range(6):
            h.step()
            assert job in ledger.inflight_jobs()  # its puts are held (other jobs open too)
            free = {b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()}
            assert tail_block not in free and h.block_pool.blocks[tail_block].ref_cnt >= 1
            for rid in ("a", "filler"):  # the resumed request too computes into other blocks
                if rid in h.scheduler.requests:
                    assert tail_block not in h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        assert "a" in h.stats.preempted_req_ids
        assert ss.has_pending_push_work()
        gate.set()
        h.run()
        assert job not in ledger.inflight_jobs()
        assert h.garbage == []
        checked, polluted = h.check_store()
        assert polluted == 0 and h.tails_checked >= 2
        assert h.check_at_rest() == []
        # and the stored tail serves a repeated prompt
        h.scheduler.reset_prefix_cache()
        hits = ss.stats.total("tail_hits")
        h.add_request("b", prompt, 2)
        h.run()
        assert ss.stats.total("tail_hits") == hits + 1 and h.garbage == []
        assert h.check_at_rest() == []


def test_tail_pin_dropped_is_caught(store_config: StoreConfig, monkeypatch):
    """The same schedule with the ledger's tail pin dropped (mutant `_tail_unpinned` of
    conformance/mutants.py, applied here by monkeypatch): the preempted request's tail block goes back to
    the free queue while a rank still has to read it. The check above would fail."""
    from kvledger.scheduler import SchedulerLedger

    orig = SchedulerLedger.open_job

    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        return orig(self, req_id, block_ids, (), **kw)

    monkeypatch.setattr(SchedulerLedger, "open_job", open_job)
    prompt = _prompt(55)
    gate = threading.Event()
    with Harness(store_config, tp_size=2, num_blocks=16, extra={"save_partial_tail": True}) as h, _opens(gate):
        ss = h.scheduler_connector.scheduler_side.steps
        _gate_puts(h, gate)
        h.add_request("a", prompt, 6)
        while ss.stats.total("tail_saves") == 0:
            assert h.step()
        tail_block = h.scheduler.kv_cache_manager.get_block_ids("a")[0][len(prompt) // BS]
        _preempt_all(h)
        h.step()
        free = {b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()}
        exposed = tail_block in free or "a" in h.scheduler.requests and \
            tail_block in h.scheduler.kv_cache_manager.get_block_ids("a")[0]
        gate.set()
        deadline = time.monotonic() + 30
        while ss.has_pending_push_work() and time.monotonic() < deadline:
            h.step()
        assert exposed  # the unpinned tail block was free for reuse while its job was in flight


def test_reset_cache_removes_tail_keys_too(store_config: StoreConfig, tmp_path):
    """reset_cache's pattern (kvledger_connector/scheduler/reset.py) covers the tail keys: after vLLM's
    reset_prefix_cache(reset_connector=True) a repeated prompt finds neither its blocks nor its tail."""
    from kvledger_connector.shape.keys import partial_tail_hash

    prompt = _prompt(56)
    with Harness(store_config, tp_size=1, num_blocks=24, workdir=str(tmp_path / "m"),
                 extra={"save_partial_tail": True, "namespace": "tails"}) as h:
        h.run_pass([prompt], 2, "a")
        k = len(prompt) // BS
        hashes = h.block_hashes_of(prompt)
        tail_key = h.key_builders[0].key(partial_tail_hash(hashes[k - 1], prompt[k * BS:]))
        store = h.scheduler_connector.store
        assert store.batch_is_exist([tail_key]) == [1]
        assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
        h.wait_reset_removals()
        removed = h.scheduler_connector.stats.totals.data["reset_removed_keys"]
        assert removed == k + 1  # the full blocks and the tail of the one rank
        assert store.batch_is_exist([tail_key]) == [0]
