"""A hybrid model through the connector: what it stores against what a hit needs, and what vLLM's hybrid KV
cache manager (which the connector keeps on) saves in KV memory per request. Nothing asserted.

The harness's gpt-oss-like stand-in (testbed/harness.py ``sliding_window``: even layers a sliding window of
W tokens, odd layers full attention, vLLM's hybrid coordinator), vLLM 0.32's real Scheduler, a private
Mooncake master, shared-prefix prompts asked once.

* Stored vs needed, per KV cache group: keys in the store after the pass, and the keys a hit of each whole
  prompt needs by vLLM's allocation rule (a full group every block; a sliding-window group only the blocks
  vLLM does not null for that hit, those holding positions at or past ``H - W + 1`` for a hit of H tokens),
  counted once across prompts that share blocks. One more row: the uniform sliding-window stand-in
  (``Harness(sliding_window=W, full_every=0)``: every layer the same window, Mistral-like; vLLM plans one
  SlidingWindowSpec group and runs its sliding-window manager), 2 layers, the same prompts.
* The same for the Jamba-like Mamba stand-in (``Harness(mamba=True)``, Mamba in "align" mode, the block size
  aligned by vLLM): a Mamba group's hit needs the one state at the hit's end.
* KV memory per request, hybrid manager on vs off: the sum over the model's layers of vLLM's own
  ``KVCacheSpec.max_memory_usage_bytes`` with the layers' specs as planned with it on (SlidingWindowSpec)
  and as vLLM unifies them with it off (FullAttentionSpec of the same shape), at several max_model_len.

    python -m bench.hybrid [--window W] [--prompt-len N]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "3")

BS = 16


def stored_vs_needed(window: int, prompt_len: int, *, full_every: int = 2, num_layers: int = 4
                     ) -> tuple[list[tuple[str, int, int]], dict[str, int], int, dict[str, int]]:
    """The stand-in with every ``full_every``-th layer full attention (0: none, every layer sliding window):
    per KV cache group, (name, keys stored, keys a hit needs); the connector's deferral counters, its block
    pin cap, the workers' job counters."""
    from bench.replicas import stored_keys
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.harness import Harness, shared_prefix_prompts

    prompts = shared_prefix_prompts(12, num_prefixes=3, prefix_len=prompt_len - 44, suffix_len=44, seed=3)
    with EmbeddedMooncake() as mc:
        cfg = StoreConfig(global_segment_size=64 << 20).with_addresses(mc.master_address, mc.metadata_server)
        with Harness(cfg, sliding_window=window, full_every=full_every, num_layers=num_layers, block_size=BS,
                     num_blocks=400) as h:
            h.run_pass(prompts, 4, tag="a")
            stored = stored_keys(mc.metrics_port)
            rows = []
            for g, kb in enumerate(h.workers[0].worker_side.steps.block_shape().builders):
                w = h.window_of_group[g]
                needed: set[str] = set()
                for p in prompts:
                    hashes = h.block_hashes_of(p)
                    hit = min(len(hashes), (len(p) - 1) // BS) * BS  # vLLM computes at least one token
                    first = 0 if w is None else max(0, (hit - w + 1) // BS)
                    needed.update(kb.keys(hashes[first:hit // BS]))
                mine = {k for k in stored if k.startswith(kb.prefix)}
                name = ("full attention" if w is None else f"all sliding, W {w}" if full_every == 0
                        else f"sliding window {w}")
                rows.append((name, len(mine), len(needed)))
            totals = h.scheduler_connector.stats.totals
            worker = {k: int(sum(w.stats.total(k) for w in h.workers))
                      for k in ("stale_jobs", "skipped_jobs", "failed_jobs", "put_failed_keys")}
            deferred = {k: int(totals.data.get(k, 0)) for k in ("deferrals", "saves_dropped", "kept_blocks",
                                                               "expired_kept_blocks")}
            return rows, deferred, h.scheduler_connector.config.max_pinned_blocks, worker


def stored_vs_needed_mamba(prompt_len: int) -> tuple[list[tuple[str, int, int]], int]:
    from bench.replicas import stored_keys
    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from testbed.harness import Harness, shared_prefix_prompts

    prompts = shared_prefix_prompts(12, num_prefixes=3, prefix_len=prompt_len - 44, suffix_len=44, seed=3)
    with EmbeddedMooncake() as mc:
        cfg = StoreConfig(global_segment_size=64 << 20).with_addresses(mc.master_address, mc.metadata_server)
        with Harness(cfg, mamba=True, num_layers=4, num_blocks=400, max_num_batched_tokens=128) as h:
            h.run_pass(prompts, 4, tag="a")
            stored = stored_keys(mc.metrics_port)
            bs = h.block_size
            rows = []
            for kb in h.workers[0].worker_side.steps.block_shape().builders:
                needed: set[str] = set()
                for p in prompts:
                    hashes = h.block_hashes_of(p)
                    hit = min(len(hashes), (len(p) - 1) // bs)  # blocks
                    needed.update(kb.keys(hashes[hit - 1:hit] if kb.layout.is_state else hashes[:hit]))
                mine = {k for k in stored if k.startswith(kb.prefix)}
                rows.append(("Mamba state" if kb.layout.is_state else "full attention", len(mine), len(needed)))
            return rows, bs


def memory_per_request(window: int, max_model_lens: list[int]) -> list[tuple[int, int, int]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvledger_connector.config import StoreConfig
    from testbed.harness import Harness

    with Harness(StoreConfig(), connector="none", sliding_window=window, num_layers=4, block_size=BS,
                 num_blocks=64) as h:
        specs = {n: g.kv_cache_spec for g in h.kv_cache_config.kv_cache_groups for n in g.layer_names}
        out = []
        for n in max_model_lens:
            vc = copy.copy(h.vllm_config)
            vc.model_config = copy.copy(vc.model_config)
            vc.model_config.max_model_len = n
            on = sum(s.max_memory_usage_bytes(vc) for s in specs.values())
            off = sum(FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                                        dtype=s.dtype).max_memory_usage_bytes(vc)
                      if isinstance(s, SlidingWindowSpec) else s.max_memory_usage_bytes(vc) for s in specs.values())
            out.append((n, on, off))
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=300)
    args = ap.parse_args(argv)
    rows, deferrals, pin_cap, worker = stored_vs_needed(args.window, args.prompt_len)
    print(f"\nstored vs needed: 12 prompts of {args.prompt_len} tokens (3 shared prefixes), window {args.window}, "
          f"block {BS}, 4 layers (2 per group)")
    print(f"{'group':<20} {'keys stored':>11} {'keys a hit needs':>16} {'stored/needed':>13}")
    urows, _, _, _ = stored_vs_needed(args.window, args.prompt_len, full_every=0, num_layers=2)
    for name, stored, needed in rows + urows:
        print(f"{name:<20} {stored:>11} {needed:>16} {stored / needed if needed else float('nan'):>13.2f}")
    print("(all sliding: the uniform sliding-window stand-in, 2 layers with the same window, one KV cache group)")
    print(f"saves deferred at the pin cap ({pin_cap} blocks): {deferrals['deferrals']}; given up as their request "
          f"finished first (a later miss): {deferrals['saves_dropped']}; window blocks vLLM freed meanwhile, saved "
          f"from its prefix cache: {deferrals['kept_blocks']}, evicted first: {deferrals['expired_kept_blocks']}; "
          f"store jobs {worker}")
    mrows, mbs = stored_vs_needed_mamba(args.prompt_len)
    print(f"\nstored vs needed, the Mamba stand-in: the same prompts, block {mbs} (aligned by vLLM), 4 layers "
          f"(2 Mamba, 2 attention), 128-token chunks")
    print(f"{'group':<20} {'keys stored':>11} {'keys a hit needs':>16} {'stored/needed':>13}")
    for name, stored, needed in mrows:
        print(f"{name:<20} {stored:>11} {needed:>16} {stored / needed if needed else float('nan'):>13.2f}")
    print("(KV memory with the hybrid manager off: none; vLLM cannot plan a Mamba hybrid without it)")
    print("\nKV memory per request (vLLM's max_memory_usage_bytes over the layers), hybrid manager on vs off")
    print(f"{'max_model_len':>13} {'on bytes':>12} {'off bytes':>12} {'on/off':>7}")
    for n, on, off in memory_per_request(args.window, [1024, 8192, 32768]):
        print(f"{n:>13} {on:>12} {off:>12} {on / off:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
