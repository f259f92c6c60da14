"""``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, e.g. after an RL weight update) on one
real master shared by several engines: it removes exactly the resetting engine's keys (its model, layout,
namespace and shards), never another model's or another namespace's, and the engine then misses and re-saves.
It refuses (False, nothing removed, why logged and counted) while a store job, a load or a request with
computed KV could bring pre-reset KV back (kvledger_connector/scheduler/reset.py). Otherwise it is done at once: a new
weights version is switched to first, the removal runs on its own thread with bounded retries, and a store
that fails the removal never makes the engine read pre-reset KV."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from kvledger_connector.config import StoreConfig
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.scheduler.reset import REMOVAL_ATTEMPTS, ecma_escape, engine_key_regex, removal_backoff_s
from kvledger_connector.store.client import MooncakeStore
from testbed.faults import FaultyMooncakeClient, HeldPuts, RawFault, StoredCopies
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 4


def _keys(h: Harness, prompts: list[list[int]]) -> list[str]:
    """Every key the engine saves for these prompts (full prompt blocks, every shard), without repeats."""
    keys: dict[str, None] = {}
    for p in prompts:
        hashes = h.block_hashes_of(p)[:len(p) // h.block_size]
        for kb in h.key_builders:
            keys.update(dict.fromkeys(kb.keys(hashes)))
    return list(keys)


def _exist(store: MooncakeStore, keys: list[str]) -> list[int]:
    return store.batch_is_exist(keys)


def test_reset_removes_only_this_engines_model_and_namespace(store_config: StoreConfig, tmp_path: Path,
                                                             shared_store: MooncakeStore):
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=8, seed=3)
    model_a, model_b = str(tmp_path / "a"), str(tmp_path / "b")
    # A and A' share the model and differ in a namespace that an unescaped "." in A's pattern would match;
    # B is another model (other layout digest: 3 layers) in A's namespace. All stay up: they hold the pool.
    with Harness(store_config, workdir=model_a, extra={"namespace": "t.1"}) as a, \
            Harness(store_config, workdir=model_a, extra={"namespace": "tx1"}) as a2, \
            Harness(store_config, workdir=model_b, num_layers=3, extra={"namespace": "t.1"}) as b:
        for tag, h in (("a", a), ("a2", a2), ("b", b)):
            h.run_pass(prompts, MAX_TOKENS, tag)
        ka, ka2, kb = _keys(a, prompts), _keys(a2, prompts), _keys(b, prompts)
        assert not (set(ka) & set(ka2)) and not (set(ka) & set(kb))
        for keys in (ka, ka2, kb):
            assert _exist(shared_store, keys) == [1] * len(keys)

        # vLLM's own path: reset_prefix_cache(reset_connector=True) -> Scheduler.reset_connector_cache
        assert a.scheduler.reset_prefix_cache(reset_connector=True) is True
        a.wait_reset_removals()  # the removal runs on its own thread
        sa = a.scheduler_connector.scheduler_side.steps
        assert sa.stats.total("resets") == 1
        assert a.scheduler_connector.stats.totals.data["reset_removed_keys"] == len(ka)  # exactly A's keys
        assert _exist(shared_store, ka) == [0] * len(ka)
        assert _exist(shared_store, ka2) == [1] * len(ka2)  # same model, other namespace: kept
        assert _exist(shared_store, kb) == [1] * len(kb)  # other model, same namespace: kept

        # B still hits (its GPU cache reset first, so the hits come from the store)
        assert b.scheduler.reset_prefix_cache() is True
        loads_b = b.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted")
        b.run_pass(prompts, MAX_TOKENS, "b-again")
        assert b.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > loads_b

        # A misses (vLLM reset its GPU pool too) and re-saves, under a fresh reset epoch's keys
        loads_a, jobs_a = sa.stats.total("loads_emitted"), sa.ledger.num_jobs_opened
        hits_a = a.scheduler_connector.stats.totals.data.get("lookup_hit_tokens", 0)
        a.run_pass(prompts, MAX_TOKENS, "a-again")
        assert sa.stats.total("loads_emitted") == loads_a
        assert a.scheduler_connector.stats.totals.data.get("lookup_hit_tokens", 0) == hits_a
        assert sa.ledger.num_jobs_opened > jobs_a
        ka_new = _keys(a, prompts)
        assert sa.reset_epoch and not set(ka_new) & set(ka) and _exist(shared_store, ka_new) == [1] * len(ka_new)
        assert _exist(shared_store, ka) == [0] * len(ka)


def test_reset_refused_while_a_store_job_is_in_flight(store_config: StoreConfig, shared_store: MooncakeStore,
                                                      caplog: Any):
    # two prefixes: the held request's blocks are new, so it surely opens a store job (with one shared prefix
    # its blocks were already stored and whether a job opened depended on the schedule: a flaky test)
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=48, suffix_len=8, seed=9)
    gate = threading.Event()
    with Harness(store_config, extra={"namespace": "held"}) as h:
        h.run_pass(prompts[:1], MAX_TOKENS, "first")  # stored before: the refused reset must leave these
        kept = _keys(h, prompts[:1])
        for w in h.workers:
            w.worker_side.io.store = HeldPuts(w.worker_side.io.store, gate)
        h.add_request("held", prompts[1], MAX_TOKENS)
        sa = h.scheduler_connector.scheduler_side.steps
        while "held" not in h.stats.finished:  # the request finishes; its job stays pinned (put held)
            h.step()
        assert sa.ledger.num_inflight_jobs == 1 and sa.num_live_requests == 0
        try:
            with caplog.at_level(logging.WARNING, logger="kvledger_connector.scheduler.reset"):
                assert h.scheduler_connector.reset_cache() is False
            assert "reset_cache refused: 1 store jobs in flight" in caplog.text  # says why
            assert h.scheduler.reset_prefix_cache(reset_connector=True) is False
            assert _exist(shared_store, kept) == [1] * len(kept)  # nothing removed
            assert h.scheduler_connector.stats.totals.data["resets_refused"] == 2
        finally:
            gate.set()
        h.run()
        assert h.check_at_rest() == []
        assert h.scheduler_connector.reset_cache() is True  # drained: the reset goes through
        h.wait_reset_removals()
        assert _exist(shared_store, kept + _keys(h, prompts[1:])) == [0] * len(kept + _keys(h, prompts[1:]))


def test_reset_refused_while_a_request_holds_computed_kv(store_config: StoreConfig):
    """Its later store job would save pre-reset blocks (a rank resumes from its own saved offset)."""
    prompts = shared_prefix_prompts(1, num_prefixes=1, prefix_len=48, suffix_len=8, seed=4)
    with Harness(store_config, extra={"namespace": "busy"}, kv_role="kv_consumer") as h:  # no store jobs
        h.add_request("r", prompts[0], 8)
        h.step()
        assert h.requests["r"].num_computed_tokens > 0
        assert h.scheduler_connector.reset_cache() is False
        h.run()
        assert h.scheduler_connector.reset_cache() is True  # finished: nothing of it can be saved any more
        assert h.workers[0].reset_cache() is None  # the worker role has nothing to reset


def test_pattern_matches_exactly_the_engines_keys():
    lay = KeyLayout(model="org/m-1.5", tp_rank=0, tp_size=2, block_size=16, dtype="torch.bfloat16",
                    kv_layout="LBNHC", num_layers=2, num_kv_heads=1, head_size=8)
    import dataclasses
    import re
    kbs = [KeyBuilder(dataclasses.replace(lay, tp_rank=r), namespace="t.1") for r in range(2)]
    rx = re.compile(engine_key_regex(kbs))  # Python's re agrees with ECMAScript on this subset
    h = bytes(range(32))
    assert all(rx.search(kb.key(h)) for kb in kbs)
    assert all(rx.search(kb.key(-5)) for kb in kbs)  # negative int hashes ("n" prefix)
    other_ns = KeyBuilder(lay, namespace="tx1").key(h)
    other_model = KeyBuilder(dataclasses.replace(lay, model="org/m-1x5"), namespace="t.1").key(h)
    no_ns = KeyBuilder(lay).key(h)
    other_tp = KeyBuilder(dataclasses.replace(lay, tp_size=4, tp_rank=3), namespace="t.1").key(h)
    for k in (other_ns, other_model, no_ns, other_tp, "pre/" + kbs[0].key(h), kbs[0].key(h) + "/x"):
        assert not rx.search(k), k
    assert ecma_escape("a.b-c/d(e)") == r"a\.b-c/d\(e\)"


# ---------------------------------------------------------------- a store that fails or holds the removal
class _NoWait:
    """THIS IS A TEST DOUBLE: the removals' backoff wait (`StoreRemovals.wait`), recording each wait and
    returning at once, so the bounded retries run without the real seconds."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False


def _failing_removals(h: Harness) -> tuple[FaultyMooncakeClient, _NoWait]:
    """The scheduler's store client under a test double whose every removal raises (the wrapper answers
    CLIENT_EXCEPTION: a code that does not open the breaker, so lookups still reach the master)."""
    store = h.scheduler_connector.store
    client = FaultyMooncakeClient(store._raw)
    client.always("remove", RawFault(raises=True))
    store._raw = client
    wait = _NoWait()
    h.scheduler_connector.removals.wait = wait
    return client, wait


def _write_version(path: Path, version: str) -> None:
    new = path.with_name(path.name + ".new")
    new.write_text(version + "\n")
    new.chmod(0o644)
    os.replace(new, path)


def test_a_reset_switches_the_weights_version_though_the_store_fails_the_removal(store_config: StoreConfig,
                                                                                  tmp_path: Path):
    """A weight update whose reset meets a store failing every removal: the reset succeeds, the engine is on
    the new version at once, never loads the old version's KV (still in the store) and saves under the new
    keys, which then hit; the old keys' removal is tried REMOVAL_ATTEMPTS times, its waits doubling to their
    cap, then given up and counted (those keys age out)."""
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=48, suffix_len=8, seed=21)
    version = tmp_path / "weights_version"
    _write_version(version, "step-1")
    with Harness(store_config, workdir=str(tmp_path / "model"),
                 extra={"weights_version_file": str(version), "namespace": "rm-fail"}) as h:
        h.run_pass(prompts, MAX_TOKENS, "v1")
        old = _keys(h, prompts)
        store = h.scheduler_connector.store
        assert _exist(store, old) == [1] * len(old)
        client, wait = _failing_removals(h)

        _write_version(version, "step-2")
        h.reset_prefix_cache_when_idle(reset_connector=True)  # waits for the removal thread too
        ss = h.scheduler_connector.scheduler_side.steps
        assert ss.weights_version == "step-2"
        n = REMOVAL_ATTEMPTS
        assert client.num_calls["remove"] == n
        assert wait.waits == [removal_backoff_s(i) for i in range(1, n)]
        totals = h.scheduler_connector.stats.totals.data
        assert (totals["reset_removals_given_up"], totals["reset_removal_retries"], totals["resets"]) == (1, n - 1, 1)
        assert _exist(store, old) == [1] * len(old)  # the old version's KV is still there...

        loads = ss.stats.total("loads_emitted")
        h.run_pass(prompts, MAX_TOKENS, "v2")
        assert ss.stats.total("loads_emitted") == loads  # ...and never loaded
        new = _keys(h, prompts)  # the workers' keys: they followed the switch
        assert not set(new) & set(old) and _exist(store, new) == [1] * len(new)
        assert h.scheduler.reset_prefix_cache() is True  # vLLM's own cache only: the next hits are the store's
        h.run_pass(prompts, MAX_TOKENS, "v2-again")
        assert ss.stats.total("loads_emitted") > loads


def test_a_reset_whose_removal_fails_never_loads_the_pre_reset_kv(store_config: StoreConfig):
    """No new weights version: the keys move under a fresh reset epoch, so though the removal is given up
    (the store still holds the pre-reset KV) every lookup misses it; the engine's own new saves hit."""
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=48, suffix_len=8, seed=22)
    with Harness(store_config, extra={"namespace": "rm-fail"}) as h:
        h.run_pass(prompts, MAX_TOKENS, "a")
        keys = _keys(h, prompts)
        store = h.scheduler_connector.store
        _failing_removals(h)
        h.reset_prefix_cache_when_idle(reset_connector=True)
        totals = h.scheduler_connector.stats.totals.data
        assert totals["reset_removals_given_up"] == 1
        assert _exist(store, keys) == [1] * len(keys)
        ss = h.scheduler_connector.scheduler_side.steps
        loads, lookups = ss.stats.total("loads_emitted"), totals.get("lookups", 0)
        h.run_pass(prompts, MAX_TOKENS, "b")
        assert ss.stats.total("loads_emitted") == loads and totals.get("lookups", 0) > lookups  # it asked, and missed
        assert not set(_keys(h, prompts)) & set(keys)  # saved again, under the new epoch
        assert h.scheduler.reset_prefix_cache() is True  # vLLM's own cache only: the next hits are the store's
        h.run_pass(prompts, MAX_TOKENS, "c")
        assert ss.stats.total("loads_emitted") > loads


def test_pre_reset_objects_put_back_after_the_reset_are_never_loaded(store_config: StoreConfig):
    """The replay: another client of the store reads the engine's objects, waits for the reset's removal and
    puts them back under their keys (first writer wins; each is the engine's own object under its own key, so
    its tag is valid). A reset keeping the weights version moved the keys: none of them is loaded, the engine
    saves afresh, and a second reset moves the keys again."""
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=48, suffix_len=8, seed=24)
    with Harness(store_config, extra={"namespace": "rm-replay"}) as h:
        other = StoredCopies(store_config)
        try:
            h.run_pass(prompts, MAX_TOKENS, "a")
            keys = _keys(h, prompts)
            assert sorted(other.take(keys)) == sorted(keys)
            h.reset_prefix_cache_when_idle(reset_connector=True)
            ss = h.scheduler_connector.scheduler_side.steps
            epoch = ss.reset_epoch
            assert epoch and h.scheduler_connector.stats.totals.data["reset_removed_keys"] == len(keys)
            assert sorted(other.put_back()) == sorted(keys)  # every pre-reset object is back under its key
            loads = ss.stats.total("loads_emitted")
            h.run_pass(prompts, MAX_TOKENS, "b")  # outputs checked against the model's
            assert ss.stats.total("loads_emitted") == loads
            fresh = _keys(h, prompts)
            assert not set(fresh) & set(keys) and _exist(h.scheduler_connector.store, fresh) == [1] * len(fresh)
            h.reset_prefix_cache_when_idle(reset_connector=True)
            assert ss.reset_epoch not in ("", epoch)
        finally:
            other.close()


class _HeldRemoval:
    """THIS IS A TEST DOUBLE: the raw client whose `remove_by_regex` waits for `release` (at most 10 s) before
    forwarding; every other call is the real client's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered, self.returned, self.release = threading.Event(), threading.Event(), threading.Event()

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        self.entered.set()
        self.release.wait(10)
        try:
            return int(self.inner.remove_by_regex(regex, force))
        finally:
            self.returned.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_reset_never_waits_for_the_store(store_config: StoreConfig):
    """A removal held inside the store: reset_cache has returned True while the call is still inside, and
    the engine steps on (its lookups miss); once the store answers the keys are gone."""
    prompts = shared_prefix_prompts(1, num_prefixes=1, prefix_len=48, suffix_len=8, seed=23)
    with Harness(store_config, extra={"namespace": "rm-held"}) as h:
        h.run_pass(prompts, MAX_TOKENS, "a")
        keys = _keys(h, prompts)
        store = h.scheduler_connector.store
        held = _HeldRemoval(store._raw)
        store._raw = held
        ss = h.scheduler_connector.scheduler_side.steps
        try:
            assert h.scheduler_connector.reset_cache() is True
            assert held.entered.wait(10)  # the removal is inside the store...
            assert not held.returned.is_set()  # ...and the reset did not wait for it
            loads = ss.stats.total("loads_emitted")
            h.run_pass(prompts, MAX_TOKENS, "during")
            assert ss.stats.total("loads_emitted") == loads
        finally:
            held.release.set()
        h.wait_reset_removals()
        assert _exist(store, keys) == [0] * len(keys)
