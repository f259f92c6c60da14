"""A hybrid model through the connector: vLLM 0.32's real Scheduler with its hybrid KV cache manager on, the
harness's gpt-oss-like stand-in (even layers a 128-token sliding window, odd layers full attention: two KV
cache groups, `Harness(sliding_window=...)`), a real Mooncake master.

Each group's blocks are stored under their own keys; a lookup hits by vLLM's rule (every full-attention key,
a sliding group's keys only within its window behind the hit's end); a load fills every group's blocks of
the hit (a sliding-window group's blocks below its window are vLLM's null block and load nothing); loads are asynchronous and a failed one is reported per request. The stand-in checks
every position each layer's attention reads, so a wrong byte loaded into either group is garbage (S7), and
`check_store` reads every stored key of both groups back against the model's KV (S1).

Prompts of 300 tokens with `max_num_batched_tokens` 128: prefill runs in chunks, so a sliding-window table
turns null below the window while its request's later chunks are still being saved (`SaveSpec.null_before`).
"""
from __future__ import annotations

import pytest
import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.worker.sent import SentBlocks
from kvledger_connector.metadata import SaveSpec
from testbed.faults import run_pass_with_a_failed_get
from testbed.harness import Harness, shared_prefix_prompts

W = 128
BS = 16
PROMPTS = shared_prefix_prompts(6, num_prefixes=2, prefix_len=256, suffix_len=44, seed=5)
# What a sliding-window group stores of a 300-token prompt (18 full blocks), by vLLM's rule for its own prefix
# cache (`reachable_block_mask`, `prefix_cache_retention_interval` 0): the blocks a hit at a reachable boundary
# reads. The replay boundary 288 reads blocks (288 - 127) // 16 = 10 .. 17; the shared prefix's junction 256,
# where vLLM detected one for a sibling, blocks 8 .. 15 (shared keys: whether 8 and 9 are stored depends on the
# order vLLM admitted the siblings in). Blocks 0 .. 7 lie outside every such window: never stored.
def _sw_stored_as_vllm_keeps(present: list[int]) -> bool:
    return present[:8] == [0] * 8 and present[10:] == [1] * 8


def _hybrid(store_config: StoreConfig, **kw) -> Harness:
    kw.setdefault("num_blocks", 160)
    kw.setdefault("num_layers", 4)
    return Harness(store_config, sliding_window=W, block_size=BS, **kw)


def _keys_present_per_part(h: Harness, prompt: list[int]) -> list[list[int]]:
    """Per group of rank 0: which of the prompt's full blocks have a key in the store."""
    hashes = h.block_hashes_of(prompt)
    store = h.checker()
    return [store.batch_is_exist(kb.keys(hashes)) for kb in h.workers[0].worker_side.steps.block_shape().builders]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_hybrid_model_keeps_the_hybrid_manager_and_loads_every_group_from_the_store(
        store_config: StoreConfig, tp_size: int):
    with _hybrid(store_config, tp_size=tp_size) as h:
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA
        assert len(h.kv_cache_config.kv_cache_groups) == 2
        h.run_pass(PROMPTS, 4, tag="a")  # outputs, S7 and rest checked by the harness
        present = _keys_present_per_part(h, PROMPTS[0])
        sw = h.window_of_group.index(W)
        assert all(c == 1 for c in present[1 - sw])  # full attention: every block
        assert _sw_stored_as_vllm_keeps(present[sw]), present[sw]  # sliding: the windows behind hit points
        builders = h.workers[0].worker_side.steps.block_shape().builders
        keys = [kb.keys(h.block_hashes_of(PROMPTS[0])[:1]) for kb in builders]
        assert keys[0] != keys[1]  # each group under its own key

        h.scheduler.reset_prefix_cache()  # pass 2's hits come from the store
        ss = h.scheduler_connector.scheduler_side.steps
        loads = ss.stats.total("loads_emitted")
        h.run_pass(PROMPTS, 4, tag="b")
        assert ss.stats.total("loads_emitted") > loads and ss.stats.total("sync_loads") == 0  # loaded, and asynchronously
        assert h.scheduler_connector.stats.total("loaded_tokens") >= 256
        checked, polluted = h.check_store()
        assert checked >= tp_size * (17 + 10) and polluted == 0  # both groups' keys of every rank, read back
        assert all(not w.worker_side.steps.errors for w in h.workers)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_gemma3_like_model_loads_every_group_from_the_store(store_config: StoreConfig, tp_size: int):
    """Five sliding-window layers to one full-attention layer (Gemma 3's pattern): vLLM plans a KV cache
    group per layer, six block tables per request; every group's keys are stored and loaded."""
    with _hybrid(store_config, tp_size=tp_size, num_layers=6, full_every=6, num_blocks=400) as h:
        kinds = [type(g.kv_cache_spec).__name__ for g in h.kv_cache_config.kv_cache_groups]
        assert kinds == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
        h.run_pass(PROMPTS, 4, tag="a")
        present = _keys_present_per_part(h, PROMPTS[0])
        assert len(present) == 6 and all(c == 1 for c in present[5])
        assert all(_sw_stored_as_vllm_keeps(g) for g in present[:5]), present  # each sliding group
        h.scheduler.reset_prefix_cache()
        ss = h.scheduler_connector.scheduler_side.steps
        loads = ss.stats.total("loads_emitted")
        h.run_pass(PROMPTS, 4, tag="b")  # each layer checked over what its attention reads
        assert ss.stats.total("loads_emitted") > loads and h.scheduler_connector.stats.total("loaded_tokens") >= 256
        checked, polluted = h.check_store()
        assert checked >= tp_size * (17 + 5 * 10) and polluted == 0


def test_a_missing_sliding_window_key_shortens_the_hit_to_an_earlier_stored_window_and_a_failed_load_recomputes(
        store_config: StoreConfig):
    """vLLM's rule for a hit of H tokens: every full-attention block, and of a sliding-window group only the
    blocks holding positions from H - W + 1 on (the rest it allocates as its null block). The store holds a
    sliding group's blocks only in the windows behind the reachable boundaries: with a key
    missing in the replay boundary's window only, the hit ends at the shared prefix's junction; with one
    missing in both, no shorter hit exists (as in vLLM's own prefix cache). A get that fails is reported per
    request (vLLM refuses block-level errors with several groups): the request recomputes and its output is
    the model's."""
    with _hybrid(store_config) as h:
        h.run_pass(PROMPTS[:3], 4, tag="a")
        hashes = h.block_hashes_of(PROMPTS[0])
        sw = h.workers[0].worker_side.steps.block_shape().builders[h.window_of_group.index(W)]
        loaded = h.scheduler_connector.stats
        # the whole prompt's hit is 18 blocks (288 tokens); block 16 is in its window, not in 256's (8 .. 15)
        junction = all(c == 1 for c in h.checker().batch_is_exist(sw.keys(hashes[8:16])))
        h.checker().remove(sw.key(hashes[16]), True)
        h.scheduler.reset_prefix_cache()
        before = loaded.total("loaded_tokens")
        h.run_pass(PROMPTS[:1], 4, tag="b")
        assert loaded.total("loaded_tokens") - before == (16 * BS if junction else 0)
        # block 12 is in both windows, and no other boundary's window was stored: no hit
        h.checker().remove(sw.key(hashes[12]), True)
        h.scheduler.reset_prefix_cache()
        before = loaded.total("loaded_tokens")
        h.run_pass(PROMPTS[:1], 4, tag="c")
        assert loaded.total("loaded_tokens") - before == 0

        faulty = run_pass_with_a_failed_get(h, PROMPTS[1:3], 4, "d")  # outputs checked: the request recomputed
        assert len(faulty.injected) == 1
        assert h.workers[0].stats.total("load_errors_reported") > 0
        assert h.garbage == [] and h.check_at_rest() == []


def test_preemption_with_saves_and_loads_of_two_groups_gives_the_models_outputs(store_config: StoreConfig):
    prompts = shared_prefix_prompts(8, num_prefixes=2, prefix_len=192, suffix_len=60, seed=9)
    # 56 blocks and 60 generated tokens: 7 to 18 preemptions in runs here (72 and 40 gave one, sometimes
    # none: saves holding their pins keep vLLM waiting rather than preempting)
    with _hybrid(store_config, num_blocks=56) as h:
        h.run_pass(prompts, 60, tag="a")
        h.scheduler.reset_prefix_cache()
        h.run_pass(prompts, 60, tag="b")
        assert h.stats.preemptions > 0
        assert h.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0
        assert h.check_store()[1] == 0


def test_a_rank_resuming_from_an_old_offset_never_reads_a_block_vllm_freed():
    """SentBlocks: a sliding-window group's ids below `null_before` become null, so a rank whose earlier put
    failed (its offset lags) puts only the full group's blocks there, never a freed and reused one."""
    sent = SentBlocks(4)
    first = SaveSpec("r", 1, 0, 0, 2, (11, 21, 12, 22), (b"h0", b"h1"), num_groups=2)
    assert sent.resolve(first) == ((11, 21, 12, 22), (b"h0", b"h1"))
    later = SaveSpec("r", 2, 0, 2, 3, (13, 23), (b"h2",), num_groups=2, null_before=(0, 2))
    ids, hashes = sent.resolve(later)
    assert ids == (11, 0, 12, 0, 13, 23) and hashes == (b"h0", b"h1", b"h2")
    with pytest.raises(ValueError, match="null_before"):
        sent.resolve(SaveSpec("r", 3, 0, 3, 3, (), (), num_groups=2, null_before=(1,)))




@pytest.mark.parametrize("group", ["sliding", "full"])
def test_a_same_size_overwrite_of_either_groups_key_is_never_loaded(store_config: StoreConfig, group: str):
    """Integrity (`checksum`, the default) with two groups: each object's tag is computed over its own
    group's views. Another client's same-size bytes under one group's key fail the tag: a load error, the
    request recomputes, the object is removed (and saved again by the recompute); never loaded."""
    with _hybrid(store_config) as h:
        h.run_pass(PROMPTS[:3], 4, tag="a")
        g = h.window_of_group.index(W if group == "sliding" else None)
        key = h.workers[0].worker_side.steps.block_shape().builders[g].key(h.block_hashes_of(PROMPTS[0])[15])
        store = h.checker()
        size = h.workers[0].worker_side.steps.key_bytes
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8)  # the forger's bytes, as long as the object
        store.register_buffer(buf.data_ptr(), size)
        h._attack_buf = buf  # registered with the store: kept alive with the harness
        assert store.remove(key, True) == 0
        assert store.batch_put([key], [[buf.data_ptr()]], [[size]]) == [0]
        h.scheduler.reset_prefix_cache()
        h.run_pass(PROMPTS[:1], 4, tag="b")  # outputs and S7 checked: the forged block never loaded
        assert sum(w.stats.total("integrity_mismatches") for w in h.workers) == 1
        assert h.workers[0].stats.total("load_errors_reported") > 0
        checked, polluted = h.check_store()  # the forged object removed, the recompute's own saved again
        assert checked > 0 and polluted == 0


def test_reset_cache_removes_every_groups_keys(store_config: StoreConfig):
    """reset_cache's one pattern covers each group's key prefix (a group's layout digest differs)."""
    with _hybrid(store_config) as h:
        h.run_pass(PROMPTS[:2], 4, tag="a")
        assert all(any(g) for g in _keys_present_per_part(h, PROMPTS[0]))
        h.reset_prefix_cache_when_idle(reset_connector=True)
        assert all(not any(g) for g in _keys_present_per_part(h, PROMPTS[0]))
