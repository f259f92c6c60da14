"""A model whose every attention layer has the same sliding window (Mistral-7B-v0.1-like) through the connector:
vLLM 0.32's real Scheduler, a real Mooncake master, the harness's uniform sliding-window stand-in
(`Harness(sliding_window=W, full_every=0)`: 2 layers, window 64, block 16). vLLM plans ONE KV cache group with a
`SlidingWindowSpec` and manages it with its sliding-window manager (`UnitaryKVCacheCoordinator`), which puts its
null block (block 0) in a request's table in place of the blocks that left the window (a connector that takes
such a lone group for full attention pins and loads into the null block and crashes at the first store hit).

The stand-in checks every position each layer's attention reads (the last W), so a wrong byte loaded is
garbage (S7, `h.garbage`); `check_store` reads every stored key back against the model's KV (S1).

Workload: 8 prompts of 236 tokens (2 shared 192-token prefixes, 14 full blocks each), 80 generated tokens, a
20-block pool: vLLM preempts in pass 2 (4 to 9 times in runs here; no preemption in pass 1, where vLLM's
admission gate reserves what each sliding-window request can ever hold, and 16 blocks gave none at all: too
few requests run at once). Pass 2 runs after `reset_prefix_cache()`, so its hits come from the store.
"""
from __future__ import annotations

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

from bench.replicas import stored_keys
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.shape.keys import partial_tail_hash
from testbed.harness import Harness, shared_prefix_prompts

W = 64
BS = 16
PREFIX_LEN = 192
PROMPTS = shared_prefix_prompts(8, num_prefixes=2, prefix_len=PREFIX_LEN, suffix_len=44, seed=5)
MAX_TOKENS = 80
NUM_BLOCKS = 20
#: what the null block of every layer holds in `test_the_null_block_is_never_stored_or_loaded_into`: no KV of
#: the stand-in is negative (`KVContent`), so these bytes under a key never compare equal to a block's KV
SENTINEL = -12345.0


def _uniform(store_config: StoreConfig, **kw) -> Harness:
    kw.setdefault("num_blocks", NUM_BLOCKS)
    return Harness(store_config, sliding_window=W, full_every=0, num_layers=2, block_size=BS, **kw)


def _kept_by_vllm(h: Harness, prompt: list[int], boundaries: list[int]) -> list[int]:
    """Which of the prompt's full blocks vLLM's own prefix cache keeps for a sliding-window group when hits
    can land at ``boundaries`` (token positions), by vLLM's rule itself: `SlidingWindowManager.
    reachable_block_mask` as `cache_blocks` calls it (alignment = the block size, the configured
    `prefix_cache_retention_interval`, 0 by default: only the reachable boundaries' tails). With W = 64 and
    16-token blocks a hit needs the cdiv(W - 1, 16) = 4 blocks before it: for the replay boundary 235
    (a resend of the 236-token prompt recomputes its last token; 224 once block-aligned) blocks 10..13, for
    the shared prefix's junction 192 blocks 8..11. Blocks 0..7 lie outside every such window."""
    n = len(h.block_hashes_of(prompt))
    spec = h.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    mask = SlidingWindowManager.reachable_block_mask(
        start_block=0, end_block=n, alignment_tokens=BS, kv_cache_spec=spec, use_eagle=False,
        retention_interval=h.vllm_config.cache_config.prefix_cache_retention_interval,
        reachable_boundaries=boundaries)
    return [1] * n if mask is None else [int(m) for m in mask]


def _check_stored_as_vllm_keeps(h: Harness) -> None:
    """Every rank's keys of each prompt: the replay boundary's window always stored, and nothing outside the
    blocks vLLM would keep (the junction's window is kept only where vLLM detected the junction for a sibling,
    which depends on the order it admitted them: allowed, not required)."""
    store = h.checker()
    for prompt in PROMPTS:
        must = _kept_by_vllm(h, prompt, [len(prompt) - 1])
        may = _kept_by_vllm(h, prompt, [len(prompt) - 1, PREFIX_LEN])
        assert must == [0] * 10 + [1] * 4 and may == [0] * 8 + [1] * 6  # the arithmetic in `_kept_by_vllm`
        hashes = h.block_hashes_of(prompt)
        for r, w in enumerate(h.workers):
            (kb,) = w.worker_side.steps.block_shape().builders  # one KV cache group: one key builder
            present = store.batch_is_exist(kb.keys(hashes))
            assert all(p in (0, 1) for p in present), present
            assert all(m <= p <= k for m, p, k in zip(must, present, may)), (r, present, must, may)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_uniform_sliding_window_model_stores_what_vllm_keeps_and_loads_it_across_preemptions(
        store_config: StoreConfig, tp_size: int):
    with _uniform(store_config, tp_size=tp_size) as h:
        groups = h.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"] and h.window_of_group == [W]
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        h.run_pass(PROMPTS, MAX_TOKENS, tag="a")  # outputs the model's, no wrong KV read (S7), at rest
        _check_stored_as_vllm_keeps(h)

        h.scheduler.reset_prefix_cache()  # pass 2's hits come from the store
        ss = h.scheduler_connector.scheduler_side.steps
        loads = ss.stats.total("loads_emitted")
        h.run_pass(PROMPTS, MAX_TOKENS, tag="b")
        assert h.stats.preemptions > 0, "no preemption happened: that part of the scenario is void"
        assert ss.stats.total("loads_emitted") > loads and h.scheduler_connector.stats.total("loaded_tokens") > 0
        assert h.garbage == [] and h.check_at_rest() == []
        checked, polluted = h.check_store()
        assert checked >= tp_size * 4 and polluted == 0  # every stored key of every rank read back
        _check_stored_as_vllm_keeps(h)  # pass 2 (loads, preemptions, re-saves) stored nothing vLLM drops
        assert all(not w.worker_side.steps.errors for w in h.workers)


def test_the_null_block_is_never_stored_or_loaded_into(store_config: StoreConfig, mooncake: EmbeddedMooncake):
    """Block 0 (vLLM's null block, in a sliding-window table wherever a block left the window) of every layer
    holds SENTINEL bytes on every rank. After two passes with store hits and preemptions:

    - block 0 still holds them on every rank: no load wrote into it;
    - every key under this harness's prefixes on the master is one that `check_store` compares with the
      model's KV (a key of some request's block or prompt tail), and none is polluted: a null block's bytes
      put under a real key would be counted there, since no KV of the stand-in equals SENTINEL."""
    with _uniform(store_config, tp_size=2) as h:
        for caches in h.kv_caches:
            for t in caches.values():
                t[0].fill_(SENTINEL)  # a [B, H, N, C] view: block 0 of this layer
        h.run_pass(PROMPTS, MAX_TOKENS, tag="a")
        h.scheduler.reset_prefix_cache()
        h.run_pass(PROMPTS, MAX_TOKENS, tag="b")
        assert h.scheduler_connector.stats.total("loaded_tokens") > 0
        for r, caches in enumerate(h.kv_caches):
            for name, t in caches.items():
                assert torch.all(t[0] == SENTINEL), f"rank {r} {name}: the null block was written"
        builders = [kb for w in h.workers for kb in w.worker_side.steps.block_shape().builders]
        covered = set()
        for req in h.requests.values():
            hashes = list(req.block_hashes)
            k, rem = divmod(req.num_prompt_tokens, BS)
            if rem >= 2 and 1 <= k <= len(hashes):  # a prompt's partial tail, as check_store reads it
                hashes.append(partial_tail_hash(hashes[k - 1], req.prompt_token_ids[k * BS:k * BS + rem]))
            covered.update(key for kb in builders for key in kb.keys(hashes))
        prefixes = tuple({kb.prefix for kb in builders})
        mine = {key for key in stored_keys(mooncake.metrics_port) if key.startswith(prefixes)}
        assert mine and mine <= covered, sorted(mine - covered)[:5]
        checked, polluted = h.check_store()
        assert checked == len(mine) and polluted == 0


def test_the_harness_plans_one_sliding_window_group_as_vllm_does_for_a_mistral_like_config():
    """The stand-in's config declares the window as Mistral-7B-v0.1's does (`sliding_window`, no `layer_types`);
    the harness copies it into CacheConfig.sliding_window as vLLM's EngineArgs does for such a model, and vLLM
    plans one SlidingWindowSpec group run by its sliding-window manager, with the hybrid KV cache manager on
    (as in the real engine on the CPU platform)."""
    with Harness(StoreConfig(), connector="none", sliding_window=W, full_every=0, num_layers=2, block_size=BS,
                 num_blocks=NUM_BLOCKS) as h:
        hf = h.vllm_config.model_config.hf_text_config
        assert hf.sliding_window == W and getattr(hf, "layer_types", None) is None
        assert h.vllm_config.cache_config.sliding_window == W
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        coord = h.scheduler.kv_cache_manager.coordinator
        assert type(coord).__name__ == "UnitaryKVCacheCoordinator"
        assert [type(m) for m in coord.single_type_managers] == [SlidingWindowManager]
        assert h.window_of_group == [W] and set(h.group_of_layer.values()) == {0}
    with pytest.raises(ValueError, match="full_every"):
        Harness(StoreConfig(), connector="none", sliding_window=W, full_every=1, num_layers=2)
