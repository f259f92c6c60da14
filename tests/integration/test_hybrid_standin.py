"""The harness's gpt-oss-like hybrid stand-in, through vLLM's real Scheduler with its hybrid KV cache manager.

`Harness(sliding_window=W)`: even layers attend to the last W tokens (`SlidingWindowSpec`), odd layers to all
of them (`FullAttentionSpec`). vLLM plans two KV cache groups and runs `HybridKVCacheCoordinator`. The
in-process platform (`UnspecifiedPlatform`) says it has no hybrid KV cache support, so the harness declares it
while it builds the config (a labelled test double; the CPU platform the real engine runs on says True).
Connector "none" here: no store is needed, `StoreConfig()` is never contacted (ours with this stand-in:
tests/integration/test_hybrid_kv.py).
"""
from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts

W = 128
BS = 16
# 6 prompts of 300 tokens, 3 per 256-token prefix: longer than the window, so sliding-window tables of hits
# and of long runs start with null blocks
PROMPTS = shared_prefix_prompts(6, num_prefixes=2, prefix_len=256, suffix_len=44, seed=5)


def _hybrid(**kw: Any) -> Harness:
    return Harness(StoreConfig(), connector="none", sliding_window=W, num_layers=4, block_size=BS, **kw)


def _probe_null_tables(h: Harness) -> list[int]:
    """Wrap the stand-in forward: count steps in which a sliding-window table started with null blocks."""
    seen: list[int] = []
    sw_group = h.window_of_group.index(W)
    orig = h._forward

    def forward(out: Any, req_ids: list[str], failed: Any = frozenset()) -> list[list[int]]:
        for rid in req_ids:
            table = h.scheduler.kv_cache_manager.get_block_ids(rid)[sw_group]
            if table and table[0] == 0:
                seen.append(len(table))
        return orig(out, req_ids, failed)
    h._forward = forward  # type: ignore[method-assign]
    return seen


def test_vllm_plans_a_sliding_and_a_full_group_with_the_hybrid_manager_on():
    from vllm.platforms import current_platform
    before = type(current_platform).support_hybrid_kv_cache()  # vLLM's CPU platform: True; unspecified: False
    with _hybrid(num_blocks=64) as h:
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        groups = h.kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec) for g in groups]
        assert kinds == [SlidingWindowSpec, FullAttentionSpec]
        assert groups[0].kv_cache_spec.sliding_window == W
        assert [[int(n.split(".")[2]) for n in g.layer_names] for g in groups] == [[0, 2], [1, 3]]
        assert type(h.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
        assert h.window_of_group == [W, None]
    # the test double is undone: the in-process platform says what it said before
    assert type(current_platform).support_hybrid_kv_cache() is before
    with Harness(StoreConfig(), connector="none", num_layers=4) as plain:  # the control: one group
        assert len(plain.kv_cache_config.kv_cache_groups) == 1
        assert plain.window_of_group == [None]


def test_the_hybrid_standin_refuses_upstream():
    """Upstream's hybrid support is not driven by this harness (ours: tests/integration/test_hybrid_kv.py)."""
    with pytest.raises(ValueError, match="sliding_window"):
        Harness(StoreConfig(), connector="upstream", sliding_window=W, num_layers=4)


def test_the_hybrid_standin_needs_two_layers():
    with pytest.raises(ValueError, match="num_layers"):
        Harness(StoreConfig(), connector="none", sliding_window=W, num_layers=1)


def test_prompts_longer_than_the_window_run_right_twice_with_local_hits():
    with _hybrid(num_blocks=96) as h:
        null_tables = _probe_null_tables(h)
        h.run_pass(PROMPTS, 4, tag="a")  # outputs the model's, no wrong KV read (S7), at rest
        hits = {i: h.stats.local_hit_tokens[f"a-{i}"] for i in range(len(PROMPTS))}
        # vLLM's hybrid hit rule: a hit needs the window's blocks before it, cached at a shared-prefix
        # junction, so the third sibling of each prefix hits the whole 256-token prefix
        assert max(hits.values()) > W, hits
        assert h.stats.local_hit_tokens["a-4"] == 256 and h.stats.local_hit_tokens["a-5"] == 256, hits
        assert null_tables  # sliding-window tables did start with null blocks
        assert h.scheduler.reset_prefix_cache()
        h.run_pass(PROMPTS, 4, tag="b")
        assert {i: h.stats.local_hit_tokens[f"b-{i}"] for i in range(len(PROMPTS))} == hits
        assert h.garbage == [] and h.check_at_rest() == []


def test_preemption_under_a_small_pool_still_gives_the_models_outputs():
    with _hybrid(num_blocks=68) as h:
        h.run_pass(PROMPTS, 100, tag="a")  # checks outputs, S7, at rest
        assert h.stats.preemptions > 0
        assert h.scheduler.reset_prefix_cache()
        h.run_pass(PROMPTS[:3], 100, tag="b")
        assert h.garbage == []


# (layer, how far before the chunk's first position, reported): layer 0 slides (window W), layer 1 is full.
# Position start - W is in a live block of the sliding layer but outside what its attention reads.
CORRUPTIONS = [(0, 1, True), (0, W - 1, True), (0, W, False), (1, 200, True), (1, 1, True)]


@pytest.mark.parametrize("layer, back, reported", CORRUPTIONS)
def test_a_wrong_byte_is_garbage_where_attention_reads_it(layer: int, back: int, reported: bool):
    """FAULT INJECTION: `Harness.corrupt_kv` adds 1 to one position of a prefix-cache hit's KV just before
    the forward that reads it."""
    prompt = PROMPTS[0]
    with _hybrid(num_blocks=96) as h:
        h.run_pass([prompt], 2, tag="a")
        done: list[tuple[int, int]] = []
        orig = h._forward

        def forward(out: Any, req_ids: list[str], failed: Any = frozenset()) -> list[list[int]]:
            if not done and "b-0" in out.num_scheduled_tokens:  # its first forward
                start = h.scheduler.requests["b-0"].num_computed_tokens - out.num_scheduled_tokens["b-0"]
                done.append((start, h.corrupt_kv("b-0", layer, start - back)))
            return orig(out, req_ids, failed)
        h._forward = forward  # type: ignore[method-assign]
        h.add_request("b-0", prompt, 2)  # the same prompt: hits (len - 1) // BS full blocks
        h.run()
        start, block = done[0]
        assert start == (len(prompt) - 1) // BS * BS and block != 0
        if reported:
            assert len(h.garbage) == 1 and f"layer {layer} K" in h.garbage[0], h.garbage
            assert f"positions {start - back}.." in h.garbage[0] or f"(block {block})" in h.garbage[0]
        else:
            assert h.garbage == []
