"""vLLM 0.32.0's real Scheduler + BlockPool on CPU, our connector loaded by vLLM's factory, a real Mooncake
master, real torch KV tensors; 1 and 2 ranks; a block pool far smaller than the working set (preemption,
req_id reuse). After every run: S1 NoPollution over the store, NoLeakAtRest, correct KV before every
compute (S7) and the expected output for every request."""
from __future__ import annotations

import pytest

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 40


def _run_pass(h: Harness, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> None:
    for i, p in enumerate(prompts):
        h.add_request(f"req-{i}", p, max_tokens)  # same ids in every pass: req_id reuse across passes
    h.run()


def _check(h: Harness, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> None:
    assert h.garbage == []
    assert h.check_at_rest() == []
    assert set(h.stats.finished) == {f"req-{i}" for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        assert h.stats.finished[f"req-{i}"] == "length"
        assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, max_tokens), f"req-{i}"
    checked, polluted = h.check_store()
    assert checked > 0 and polluted == 0


@pytest.mark.parametrize("tp_size", [1, 2])
def test_preemption_storm_then_store_hits(store_config: StoreConfig, tp_size: int):
    prompts = shared_prefix_prompts(16, num_prefixes=3, prefix_len=48, suffix_len=20, seed=tp_size)
    with Harness(store_config, tp_size=tp_size, num_blocks=18, max_num_seqs=8) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _run_pass(h, prompts)
        assert h.stats.preemptions > 0  # the pool is far smaller than the working set
        _check(h, prompts)
        jobs_first = ss.ledger.num_jobs_opened
        assert jobs_first > 0
        # second pass: vLLM's prefix cache is mostly evicted by then; hits come from the store
        h.stats.outputs.clear()
        _run_pass(h, prompts)
        _check(h, prompts)
        assert ss.stats.total("loads_emitted") > 0
        assert h.scheduler_connector.stats.totals.data.get("loaded_tokens", 0) > 0
        for w in h.workers:
            assert w.worker_side.steps.stats.total("loads") > 0
            assert w.worker_side.steps.stats.total("load_errors_reported") == 0


def test_cap_defers_saves_and_everything_still_drains(store_config: StoreConfig):
    """max_inflight_jobs=1: most saves are deferred by the cap and retried; pins never exceed it."""
    prompts = shared_prefix_prompts(10, num_prefixes=2, prefix_len=32, suffix_len=20, seed=5)
    extra = {"max_inflight_jobs": 1, "max_pinned_blocks": 8}
    # max_model_len 128 = 8 blocks: the longest request fits the pin cap (the connector checks at start-up)
    with Harness(store_config, tp_size=1, num_blocks=24, extra=extra, max_model_len=128) as h:
        _run_pass(h, prompts, max_tokens=24)
        ss = h.scheduler_connector.scheduler_side
        assert h.scheduler_connector.stats.total("deferrals") > 0
        assert ss.steps.ledger.peak_inflight_jobs == 1 and ss.steps.ledger.peak_pinned_blocks <= 8
        assert ss.steps.ledger.num_jobs_opened > 0
        assert h.scheduler_connector.stats.totals.data["deferrals"] > 0  # reported to vLLM's stats too
        _check(h, prompts, max_tokens=24)


def test_lookup_is_idempotent_while_waiting(store_config: StoreConfig):
    """vLLM asks get_num_new_matched_tokens again every step a request waits: same answer, no new query."""
    prompts = shared_prefix_prompts(12, num_prefixes=1, prefix_len=48, suffix_len=8, seed=9)
    with Harness(store_config, num_blocks=8, max_num_seqs=4) as h:  # a waiting request waits for blocks
        ss = h.scheduler_connector.scheduler_side
        _run_pass(h, prompts, max_tokens=8)
        _check(h, prompts, max_tokens=8)
        # a request whose prefix is stored: two asks, one store query, the same answer
        from vllm import SamplingParams
        from vllm.v1.request import Request
        sp = SamplingParams(max_tokens=4)
        req = Request("probe", prompts[0], sp, None, block_hasher=h._hasher)
        q0 = ss.steps.stats.total("lookups")
        first = ss.get_num_new_matched_tokens(req, 0)
        again = ss.get_num_new_matched_tokens(req, 0)
        assert first == again and first[0] == 48  # the 3 stored blocks
        assert first[1] is True  # the harness's policy is "recompute": every load is async there
        assert ss.steps.stats.total("lookups") == q0 + 1
        ss.request_finished(req)


def test_lookup_cache_is_bounded(store_config: StoreConfig):
    prompts = shared_prefix_prompts(12, num_prefixes=1, prefix_len=48, suffix_len=8, seed=9)
    with Harness(store_config, num_blocks=12, max_num_seqs=2, extra={"max_lookup_cache": 2}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _run_pass(h, prompts, max_tokens=8)
        assert ss.peak_lookup_cache == 2  # the bound was hit, never exceeded
        _check(h, prompts, max_tokens=8)


def test_finished_request_frees_at_once_and_pins_keep_the_engine_stepping(store_config: StoreConfig):
    """request_finished never delays the free; the store job's own pin keeps the blocks until every rank
    reported, and has_pending_push_work keeps the engine stepping until then. `SlowStore` (a test double)
    delays puts so that the job outlives its request deterministically."""
    import time

    class SlowStore:
        def __init__(self, inner):
            self.inner = inner

        def batch_put(self, *a):
            time.sleep(0.3)
            return self.inner.batch_put(*a)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    prompt = shared_prefix_prompts(1, num_prefixes=1, prefix_len=48, suffix_len=8, seed=3)[0]
    with Harness(store_config, tp_size=2, num_blocks=16) as h:
        for w in h.workers:
            w.worker_side.io.store = SlowStore(w.worker_side.io.store)
        h.add_request("req-0", prompt, 1)
        pinned_after_finish = 0
        while h.step():
            if "req-0" in h.stats.finished and h.scheduler_connector.has_pending_push_work():
                held = [b for b in h.block_pool.blocks[1:] if b.ref_cnt > 0]
                pinned_after_finish = max(pinned_after_finish, len(held))
        assert h.stats.finished["req-0"] == "length"
        assert h.stats.push_work_steps > 0
        assert pinned_after_finish == len(prompt) // 16  # the job's blocks, held by its pin alone
        assert h.check_at_rest() == []
        assert h.check_store()[1] == 0


def test_trace_path_writes_the_shared_vocabulary(store_config: StoreConfig, tmp_path):
    """extra `trace_path`: the ledgers' NDJSON events (kvledger/trace.py names) from a real run, both roles."""
    import json
    trace = tmp_path / "trace.ndjson"
    prompts = shared_prefix_prompts(6, num_prefixes=6, prefix_len=48, suffix_len=8, seed=13)
    with Harness(store_config, num_blocks=12, extra={"trace_path": str(trace)}) as h:
        _run_pass(h, prompts, max_tokens=20)
        _run_pass(h, prompts, max_tokens=20)
        _check(h, prompts, max_tokens=20)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    actions = {e["action"] for e in events}
    assert {"EmitStore", "Collect", "Receive", "DmaRead", "Put", "Report", "DropGeneration", "Load"} <= actions
    emitted = {e["job"] for e in events if e["action"] == "EmitStore"}
    reported = [e["job"] for e in events if e["action"] == "Report"]
    assert sorted(reported) == sorted(emitted)  # one rank: every job reported exactly once (S5)


def test_reset_prefix_cache_preempting_running_requests(store_config: StoreConfig):
    """reset_prefix_cache(reset_running_requests=True) preempts outside schedule(): in vllm 0.32.0 the ids
    still reach the connector through the next step's preempted_req_ids, so the old generations are
    dropped, their in-flight jobs stay pinned until reported, and every request finishes correctly.
    While store jobs hold pins vLLM's reset itself reports failure (RuntimeError): pins are never dropped
    early to make a cache reset succeed."""
    prompts = shared_prefix_prompts(8, num_prefixes=4, prefix_len=48, suffix_len=16, seed=17)
    with Harness(store_config, tp_size=2, num_blocks=40) as h:
        for i, p in enumerate(prompts):
            h.add_request(f"req-{i}", p, MAX_TOKENS)
        for _ in range(6):
            h.step()
        running = {r.request_id for r in h.scheduler.running}
        assert running
        if h.scheduler_connector.has_pending_push_work():
            # vLLM frees every running request, then finds blocks still referenced (our store jobs' pins:
            # a DMA may be reading them) and raises; the requests are preempted all the same
            with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
                h.scheduler.reset_prefix_cache(reset_running_requests=True)
        else:
            assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
        h.run()
        assert running <= h.stats.preempted_req_ids
        _check(h, prompts)


def test_abort_during_async_load_keeps_destination_blocks_pinned(store_config: StoreConfig):
    """An aborted request frees its blocks at once (request_finished never delays); the load already sent
    to the workers holds its own pin on the destination blocks until every rank finished it, so no other
    request can be given a block a load thread is still writing. `SlowGet` (a test double) slows gets so
    the abort lands mid-load."""
    import time

    from vllm.v1.request import RequestStatus

    class SlowGet:
        def __init__(self, inner):
            self.inner = inner

        def batch_get(self, *a):
            time.sleep(0.4)
            return self.inner.batch_get(*a)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    prompts = shared_prefix_prompts(6, num_prefixes=6, prefix_len=48, suffix_len=8, seed=23)
    # async loads (a sync one is begun and finished inside one engine step: no abort comes in between)
    with Harness(store_config, tp_size=2, num_blocks=14, extra={"sync_load_max_tokens": 0}) as h:
        _run_pass(h, prompts, max_tokens=8)
        for w in h.workers:
            w.worker_side.io.store = SlowGet(w.worker_side.io.store)
        for i, p in enumerate(prompts):
            h.add_request(f"req-{i}", p, 8)
        ss = h.scheduler_connector.scheduler_side.steps
        victim = None
        while victim is None and h.step():
            loading = [r for r in h.scheduler.requests.values()
                       if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                       and r.request_id in ss.ledger.pinned_loads()]
            victim = loading[0] if loading else None
        assert victim is not None
        dest = ss.ledger.load_pinned_block_ids(victim.request_id)
        h.scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        assert all(h.block_pool.blocks[b].ref_cnt >= 1 for b in dest)  # held by the load pin alone
        h.run()
        assert h.garbage == []
        assert h.check_at_rest() == []
        for i, p in enumerate(prompts):
            if f"req-{i}" != victim.request_id:
                assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, 8)
        assert h.check_store()[1] == 0


@pytest.mark.parametrize("kv_role, saves, loads", [("kv_producer", True, False), ("kv_consumer", False, True)])
def test_kv_role_selects_saves_and_loads(store_config: StoreConfig, tmp_path, kv_role: str, saves: bool,
                                         loads: bool):
    """kv_producer only saves, kv_consumer only loads (what another kv_both engine of the same model saved:
    same model dir, so the same key layout)."""
    prompts = shared_prefix_prompts(6, num_prefixes=6, prefix_len=48, suffix_len=8, seed=29)
    # the warm engine stays up: stored KV lives in the segments its workers contribute
    with Harness(store_config, num_blocks=14, workdir=str(tmp_path)) as warm, \
            Harness(store_config, num_blocks=14, kv_role=kv_role, workdir=str(tmp_path)) as h:
        _run_pass(warm, prompts, max_tokens=8)
        _run_pass(h, prompts, max_tokens=8)
        ss = h.scheduler_connector.scheduler_side.steps
        assert (ss.ledger.num_jobs_opened > 0) is saves
        assert (ss.stats.total("loads_emitted") > 0) is loads
        _check(h, prompts, max_tokens=8)


def test_req_id_reused_the_step_after_it_finished_still_loads(store_config: StoreConfig):
    """A request finishes in step k; the same req_id comes back before step k+1 with a store hit. vLLM
    reports the old finish in step k+1's `finished_req_ids`, in the same step that admits the new request
    and emits its load: the finish notice must not wipe the new generation's pending load (it did: the
    request then waited for remote KV forever, holding its load pins)."""
    saved = shared_prefix_prompts(1, num_prefixes=1, prefix_len=48, suffix_len=8, seed=11)[0]
    other = shared_prefix_prompts(1, num_prefixes=1, prefix_len=40, suffix_len=8, seed=12)[0]
    with Harness(store_config, tp_size=2, num_blocks=32, stall_timeout_s=20) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        h.add_request("s", saved, 4)
        h.run()
        assert h.scheduler.reset_prefix_cache()  # from now on a hit on `saved` can only be a store hit
        h.add_request("a", other, 4)
        while "a" not in h.stats.finished:
            assert h.step()
        loads_before = ss.stats.total("loads_emitted")
        h.add_request("a", saved, 4)  # the same id, before the step that reports the old one finished
        h.run()
        assert ss.stats.total("loads_emitted") == loads_before + 1
        assert h.stats.outputs["a"][-4:] == h.expected_output(saved, 4)
        assert h.garbage == [] and h.check_at_rest() == []
