"""A Mamba hybrid through the connector: vLLM 0.32's real Scheduler with its hybrid KV cache manager on, Mamba
in vLLM's "align" mode, the harness's Jamba-like stand-in (`Harness(mamba=True)`: Mamba mixers on even
layers, attention on odd ones; one Mamba group and one attention group), a real Mooncake master.

vLLM plans it here as the engine does (`testbed.kvcache.mamba_hybrid_specs`: the model class's state shapes,
the block size aligned to one page size for both groups). A Mamba group's block p holds the whole recurrent
state after (p + 1) * block_size tokens; vLLM keeps one running state per request and offers the connector
the exact blocks of the boundary states it caches (`boundary_state_offloads`). The connector saves a state
only from those, under its own key; a lookup hits at H only when the state key at H exists (with every
attention key before H); a load fills the one state block vLLM reads at the hit's end. The stand-in writes
each chunk's final state and checks the state a request reads when it starts computing (after a load, a
prefix-cache hit, a preemption), so a wrong or missing state is garbage (S7); `check_store` reads every
stored state key back against the model's state (S1).
"""
from __future__ import annotations

import pytest

from kvledger_connector.config import ConfigError, StoreConfig
from testbed.faults import run_pass_with_a_failed_get
from testbed.harness import Harness, shared_prefix_prompts

# 3 shared 96-token prefixes (3 blocks of the aligned 32) + 37-token suffixes; chunks of 64 tokens so that
# vLLM cuts prefill at block boundaries and caches (and offers) states inside a prompt
PROMPTS = shared_prefix_prompts(6, num_prefixes=3, prefix_len=96, suffix_len=37, seed=11)


def _mamba(store_config: StoreConfig, **kw) -> Harness:
    kw.setdefault("num_blocks", 96)
    kw.setdefault("num_layers", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    return Harness(store_config, mamba=True, **kw)


def _state_keys_present(h: Harness, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Rank 0's (Mamba group, attention group) keys of the prompt's full blocks: 1 where stored."""
    hashes = h.block_hashes_of(prompt)
    store = h.checker()
    steps = h.workers[0].worker_side.steps
    by_group = {kb.layout.is_state: store.batch_is_exist(kb.keys(hashes)) for kb in steps.block_shape().builders}
    return by_group[True], by_group[False]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_mamba_hybrid_keeps_the_hybrid_manager_and_loads_its_state_from_the_store(
        store_config: StoreConfig, tp_size: int):
    with _mamba(store_config, tp_size=tp_size) as h:
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA
        kinds = [type(g.kv_cache_spec).__name__ for g in h.kv_cache_config.kv_cache_groups]
        assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec"]
        assert h.block_size == 32  # aligned by vLLM: one page size for both groups

        h.run_pass(PROMPTS, 4, tag="a")  # outputs, S7 and rest checked by the harness
        state, attn = _state_keys_present(h, PROMPTS[0])
        assert attn == [1] * len(attn)  # every attention block
        # a state only where vLLM cached one (a chunk ended there): never every boundary of a long chunk
        assert 1 in state
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0

        h.scheduler.reset_prefix_cache()  # pass 2's hits come from the store
        ss = h.scheduler_connector.scheduler_side.steps
        loads = ss.stats.total("loads_emitted")
        h.run_pass(PROMPTS, 4, tag="b")
        assert ss.stats.total("loads_emitted") > loads  # the state and the attention blocks before it, loaded
        assert not h.garbage, h.garbage[:3]
        assert h.check_at_rest() == []


def test_a_lookup_needs_the_state_key_at_the_hits_end(store_config: StoreConfig):
    """With the state at a boundary removed from the store, the hit stops at an earlier state (or is none):
    vLLM's Mamba hit is the one snapshot at its end, never attention blocks without it."""
    with _mamba(store_config) as h:
        h.run_pass(PROMPTS[:1], 2, tag="a")
        state, attn = _state_keys_present(h, PROMPTS[0])
        ends = [i for i, c in enumerate(state) if c == 1]
        assert ends and all(c == 1 for c in attn)
        steps = h.workers[0].worker_side.steps
        skb = next(kb for kb in steps.block_shape().builders if kb.layout.is_state)
        hashes = h.block_hashes_of(PROMPTS[0])
        store = h.checker()
        for i in ends:  # every state of the prompt gone: attention keys alone hit nothing
            store.remove(skb.key(hashes[i]), True)
        h.scheduler.reset_prefix_cache()
        ss = h.scheduler_connector.scheduler_side.steps
        loads = ss.stats.total("loads_emitted")
        h.run_pass(PROMPTS[:1], 2, tag="b")
        assert ss.stats.total("loads_emitted") == loads
        assert not h.garbage


def test_a_missing_state_key_shortens_the_hit_to_the_state_before_it_and_a_failed_state_load_recomputes(
        store_config: StoreConfig):
    """A hit ends where a state is stored: with the prompt's last state removed, the hit ends at the state
    before it (the attention keys past it do not count). vLLM caches (and offers) the states it retains: the
    prompt's last boundary, and the shared prefix's end where a sibling resumed from it (all six prompts). A state get that fails is reported per request
    (several groups): the request recomputes and its output is the model's."""
    with _mamba(store_config) as h:
        h.run_pass(PROMPTS, 4, tag="a")
        state, attn = _state_keys_present(h, PROMPTS[0])
        ends = [i for i, c in enumerate(state) if c == 1]
        assert len(ends) >= 2 and all(c == 1 for c in attn), (state, attn)
        stats = h.scheduler_connector.stats
        h.scheduler.reset_prefix_cache()
        before = stats.total("loaded_tokens")
        h.run_pass(PROMPTS[:1], 4, tag="b")
        assert stats.total("loaded_tokens") - before == (ends[-1] + 1) * h.block_size
        skb = next(kb for kb in h.workers[0].worker_side.steps.block_shape().builders if kb.layout.is_state)
        h.checker().remove(skb.key(h.block_hashes_of(PROMPTS[0])[ends[-1]]), True)
        h.scheduler.reset_prefix_cache()
        before = stats.total("loaded_tokens")
        h.run_pass(PROMPTS[:1], 4, tag="c")
        assert stats.total("loaded_tokens") - before == (ends[-2] + 1) * h.block_size

        faulty = run_pass_with_a_failed_get(h, PROMPTS[1:3], 4, "d")  # outputs checked: the request recomputed
        assert len(faulty.injected) == 1
        assert h.workers[0].stats.total("load_errors_reported") > 0
        assert h.garbage == [] and h.check_at_rest() == []


def test_preemption_and_deferred_saves_never_store_or_read_a_wrong_state(store_config: StoreConfig):
    """A small pool and 60 generated tokens make vLLM preempt (a resumed request re-reads its state from
    the block its new table holds), and one store job at a time defers saves: a deferred job keeps its
    state offers while vLLM's prefix cache still records each block as it did when offered, and saves
    them when admitted. Every stored state is the model's (S1), every read one too (S7)."""
    prompts = shared_prefix_prompts(8, num_prefixes=2, prefix_len=192, suffix_len=60, seed=9)
    with _mamba(store_config, num_blocks=40, extra={"max_inflight_jobs": 1}) as h:
        h.run_pass(prompts, 60, tag="a")
        h.scheduler.reset_prefix_cache()
        h.run_pass(prompts, 60, tag="b")
        assert h.stats.preemptions > 0
        stats = h.scheduler_connector.stats
        assert stats.total("deferrals") > 0
        print(f"blocks kept by deferred jobs and saved: {stats.total('kept_blocks')}, "
              f"evicted before the retry: {stats.total('expired_kept_blocks')}")
        assert stats.total("kept_blocks") > 0  # deferred jobs saved states offered steps before
        assert h.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0


def test_partial_tails_are_refused_for_a_mamba_hybrid_by_name(store_config: StoreConfig):
    """A Mamba state at a prompt's partial end is vLLM's copy-on-write hand-off, which is not served."""
    with pytest.raises(ConfigError) as e:
        _mamba(store_config, extra={"save_partial_tail": True})
    assert e.value.field == "save_partial_tail" and "Mamba group" in str(e.value)


def test_the_tp_shared_layout_is_refused_for_a_mamba_hybrid_by_name(store_config: StoreConfig):
    """A Mamba state is a rank's shard of the mixer, with no KV heads a key could name."""
    with pytest.raises(ConfigError) as e:
        _mamba(store_config, extra={"kv_heads_per_key": 1})
    assert e.value.field == "kv_heads_per_key" and "Mamba" in str(e.value)
