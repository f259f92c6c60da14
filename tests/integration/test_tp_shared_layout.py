"""The TP-shared store layout (`kv_heads_per_key`), through vLLM 0.32.0's real Scheduler (testbed.harness) on a
real Mooncake master.

A key holds k of the model's KV heads of a block and names them (``kvh<first>+<k>of<heads>``), so engines at
different TP sizes put and load the same keys. Here a TP 2 engine saves; a TP 1 and a TP 4 engine of the same
model (the same model directory: one `ModelConfig.compute_hash`) then serve the same prompts from the store.
The stand-in's KV of a head does not depend on the rank holding it or the TP size (`KVContent`), and the
harness checks every position a rank did not write itself before each forward: a block loaded into a TP 1
rank's four heads or a TP 4 rank's one head is compared with what that rank's heads must hold, byte for byte.
"""
from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from kvledger_connector.config import ConfigError, StoreConfig
from testbed.harness import Harness, shared_prefix_prompts

BS = 16
HEADS = 4  # the model's KV heads


def _harness(store_config: StoreConfig, workdir: str, tp: int, namespace: str, layout: str,
             **extra: Any) -> Harness:
    return Harness(store_config, tp_size=tp, num_kv_heads=HEADS // tp, num_blocks=48, workdir=workdir,
                   kv_layout=layout, extra={"kv_heads_per_key": 1, "namespace": namespace, **extra})


def _prefixes(h: Harness) -> set[str]:
    return {kb.prefix for w in h.workers for kb in w.worker_side.steps.block_shape().builders}


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC"])  # a head's bytes strided per token; one run per layer
def test_a_tp2_engine_saves_and_tp1_and_tp4_ranks_load_it_byte_exact(store_config: StoreConfig, tmp_path,
                                                                       layout: str):
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=3 * BS, suffix_len=20, seed=11)
    ns = f"tps-{uuid.uuid4().hex[:10]}"
    workdir = os.fspath(tmp_path)  # one model directory: the three engines have one model identity
    with _harness(store_config, workdir, 2, ns, layout) as h2:  # its ranks' segments hold what it stored
        assert sorted(len(w.worker_side.steps.block_shape().builders) for w in h2.workers) == [2, 2]  # two heads a rank
        h2.run_pass(prompts, 4, "save")
        checked, polluted = h2.check_store()
        assert checked > 0 and polluted == 0
        full_blocks = {bytes(bh) for p in prompts for bh in h2.block_hashes_of(p)}
        put = sum(w.stats.total("put_keys") for w in h2.workers)
        assert put == HEADS * len(full_blocks)  # a key per head and block, each put once
        for tp in (1, 4):
            with _harness(store_config, workdir, tp, ns, layout) as h:
                assert _prefixes(h) == _prefixes(h2)  # the same keys at every TP size
                h.run_pass(prompts, 4, f"tp{tp}")  # S7: every loaded head holds its KV, outputs the model's
                ss = h.scheduler_connector.scheduler_side.steps
                assert ss.stats.total("loads_emitted") > 0 and h.stats.load_error_blocks == 0
                loaded = sum(w.stats.total("get_keys") for w in h.workers)
                assert loaded > 0 and loaded % HEADS == 0  # every head of every loaded block, over the ranks
                assert sum(w.stats.total("put_keys") for w in h.workers) == 0  # nothing it needed was missing
                assert h.check_store()[1] == 0
                assert h.check_at_rest() == []


def test_mla_keys_are_shared_by_every_tp_size(store_config: StoreConfig, tmp_path):
    """MLA's latent is one head on every rank: one key per block, whatever the TP size."""
    prompts = shared_prefix_prompts(3, num_prefixes=1, prefix_len=3 * BS, suffix_len=10, seed=5)
    ns = f"tps-{uuid.uuid4().hex[:10]}"
    extra = {"kv_heads_per_key": 1, "namespace": ns}
    with Harness(store_config, tp_size=2, num_blocks=48, workdir=os.fspath(tmp_path), kv_kind="mla",
                 extra=extra) as h2:
        h2.run_pass(prompts, 4, "save")
        full_blocks = {bytes(bh) for p in prompts for bh in h2.block_hashes_of(p)}
        assert sum(w.stats.total("put_keys") for w in h2.workers) == len(full_blocks)  # one copy
        assert {p.split("/")[-2] for p in _prefixes(h2)} == {"kvh0+1of1-pp0of1"}
        with Harness(store_config, tp_size=1, num_blocks=48, workdir=os.fspath(tmp_path), kv_kind="mla",
                     extra=extra) as h1:
            assert _prefixes(h1) == _prefixes(h2)
            h1.run_pass(prompts, 4, "tp1")
            assert h1.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0 and h1.stats.load_error_blocks == 0
            assert h1.check_at_rest() == []


def test_a_hybrid_models_groups_are_shared_across_tp_sizes(store_config: StoreConfig, tmp_path):
    """A gpt-oss-like stand-in (sliding window 64 and full attention, two KV cache groups): a block's parts
    are a key per group and head; a TP 1 engine loads both groups' heads a TP 2 engine stored."""
    prompts = shared_prefix_prompts(3, num_prefixes=1, prefix_len=128, suffix_len=20, seed=9)
    ns = f"tps-{uuid.uuid4().hex[:10]}"
    kw: dict[str, Any] = dict(sliding_window=64, num_layers=4, num_blocks=96, workdir=os.fspath(tmp_path),
                              extra={"kv_heads_per_key": 1, "namespace": ns})
    with Harness(store_config, tp_size=2, num_kv_heads=1, **kw) as h2:
        assert [len(w.worker_side.steps.block_shape().builders) for w in h2.workers] == [2, 2]  # 2 groups x 1 head
        h2.run_pass(prompts, 4, "save")
        assert h2.check_store()[1] == 0
        with Harness(store_config, tp_size=1, num_kv_heads=2, **kw) as h1:
            parts = h1.workers[0].worker_side.steps.block_shape().parts
            assert [p.group for p in parts] == [0, 0, 1, 1]  # per group, its two heads
            assert _prefixes(h1) == _prefixes(h2)
            h1.run_pass(prompts, 4, "tp1")  # both groups' loaded heads checked where attention reads them
            assert h1.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0
            assert sum(w.stats.total("put_keys") for w in h1.workers) == 0
            assert h1.check_at_rest() == []


@pytest.mark.parametrize(("extra", "field", "why"), [
    ({"kv_heads_per_key": 3}, "kv_heads_per_key", "must divide the 2 KV heads each rank holds"),
    ({"kv_heads_per_key": 1, "store_replicated_kv_once": False}, "store_replicated_kv_once", "leave it true"),
])
def test_kv_heads_per_key_that_does_not_divide_a_ranks_heads_is_refused(store_config: StoreConfig, extra: dict,
                                                                        field: str, why: str):
    with pytest.raises(ConfigError) as e:
        Harness(store_config, tp_size=2, num_kv_heads=2, num_blocks=16, extra=extra)
    assert e.value.field == field and why in str(e.value)
