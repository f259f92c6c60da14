"""Identical KV stored once, through vLLM 0.32.0's real Scheduler (testbed.harness, a real Mooncake master).

With MLA every TP rank holds the same latent; with fewer KV heads than TP ranks vLLM replicates each head on
consecutive ranks. Those ranks share one key per block (`tp<first>+<k>of<n>`), each key is put by exactly one
of them (`kvledger.put_positions`), and every rank loads every key. The harness's stand-in writes the same KV
on every rank in these models and checks, before every forward, that each position it did not write holds
it: a rank that loaded a key another rank put is checked like one that loaded its own.
"""
from __future__ import annotations

import pytest

from kvledger_connector.config import StoreConfig
from kvledger_connector.shape.engine_facts import kv_replicas
from testbed.harness import Harness, shared_prefix_prompts

BS = 16


def _keys_of(h: Harness, prompts: list[list[int]]) -> set[str]:
    """Every key of the prompts' full blocks that is in the store, over every rank's key builder."""
    checker = h.checker()
    keys = {kb.key(bh) for p in prompts for bh in h.block_hashes_of(p) for kb in h.key_builders}
    present = checker.batch_is_exist(sorted(keys))
    return {k for k, c in zip(sorted(keys), present) if c == 1}


def _two_passes(h: Harness, prompts: list[list[int]], max_tokens: int = 4) -> None:
    for i, p in enumerate(prompts):
        h.add_request(f"a{i}", p, max_tokens)
    h.run()
    h.scheduler.reset_prefix_cache()  # pass 2's hits come from the store
    for i, p in enumerate(prompts):
        h.add_request(f"b{i}", p, max_tokens)
    h.run()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["mla", "replicated"])
def test_mla_at_tp2_stores_one_copy_and_every_rank_loads_it(store_config: StoreConfig, kind: str, tp: int):
    prompts = shared_prefix_prompts(6, num_prefixes=2, prefix_len=3 * BS, suffix_len=20, seed=7 + tp)
    with Harness(store_config, tp_size=tp, num_blocks=48, kv_kind=kind) as h:
        assert kv_replicas(h.vllm_config) == tp
        prefixes = {kb.prefix for kb in h.key_builders}
        assert len(prefixes) == 1 and f"/tp0+{tp}of{tp}-pp0of1/" in prefixes.pop()
        _two_passes(h, prompts)
        ss = h.scheduler_connector.scheduler_side.steps
        assert ss.stats.total("loads_emitted") > 0 and h.stats.load_error_blocks == 0
        assert h.garbage == []  # every rank read what the block must hold, whoever put it (S7)
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"b{i}"] == h.expected_output(p, 4)
        # one copy: each stored key was put by exactly one rank, and every rank put its share
        puts = [w.stats.total("put_keys") for w in h.workers]
        stored = _keys_of(h, prompts)
        full_blocks = {bytes(bh) for p in prompts for bh in h.block_hashes_of(p)}
        assert len(stored) == len(full_blocks)
        assert sum(puts) == len(stored), puts
        assert all(n > 0 for n in puts), puts
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0
        assert h.check_at_rest() == []


def test_per_rank_copies_when_turned_off(store_config: StoreConfig):
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=3 * BS, suffix_len=20, seed=3)
    with Harness(store_config, tp_size=2, num_blocks=48, kv_kind="mla",
                 extra={"store_replicated_kv_once": False}) as h:
        assert sorted(kb.layout.shard for kb in h.key_builders) == ["tp0of2", "tp1of2"]
        _two_passes(h, prompts)
        assert h.garbage == [] and h.stats.load_error_blocks == 0
        full_blocks = {bytes(bh) for p in prompts for bh in h.block_hashes_of(p)}
        assert len(_keys_of(h, prompts)) == 2 * len(full_blocks)  # a copy per rank
        assert h.check_store()[1] == 0
        assert h.check_at_rest() == []
