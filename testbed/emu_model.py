"""The emulated model shared by the in-process harness and the engine's stand-in worker (`emu_worker`).

No weights, no tokenizer: `write_model_dir` writes a tiny Llama `config.json` that vLLM's `ModelConfig`
accepts. The "forward" is defined by `KVContent`: the KV that position p of a request must hold is a
deterministic function of (token prefix up to p, layer, K|V, the model's KV head), and the token sampled
after a prefix is a function of that prefix. A reader can therefore check any KV it did not write (a
prefix-cache hit, a block loaded from the store) and any output (`expected_output`) exactly.
"""
from __future__ import annotations

import json
import os
import random

import torch

EOS = 2
VOCAB = 1024
_MOD = (1 << 61) - 1
#: `layer_types` spellings of Hugging Face configs (gpt-oss, Gemma 2/3)
SLIDING, FULL = "sliding_attention", "full_attention"


def hybrid_layer_types(num_layers: int, full_every: int = 2) -> list[str]:
    """A sliding-window model's layer pattern: every ``full_every``-th layer full attention, the others
    sliding window (2: gpt-oss, alternating; 6: Gemma 3, five sliding to one full; 0: no full-attention
    layer, every layer sliding window, as Mistral-7B-v0.1: the uniform case, one KV cache group)."""
    if full_every == 0:
        if num_layers < 1:
            raise ValueError(f"hybrid_layer_types full_every=0, num_layers={num_layers!r}: needs a layer")
        return [SLIDING] * num_layers
    if full_every < 2 or num_layers < full_every:
        raise ValueError(f"hybrid_layer_types full_every={full_every!r}, num_layers={num_layers!r}: needs "
                         f"full_every >= 2 and at least that many layers (one sliding, one full), or 0 (every "
                         f"layer sliding)")
    return [FULL if (i + 1) % full_every == 0 else SLIDING for i in range(num_layers)]


def write_model_dir(path: str, *, num_layers: int, num_kv_heads: int, head_size: int,
                    num_attention_heads: int | None = None, mla: bool = False,
                    sliding_window: int | None = None, full_every: int = 2) -> str:
    """A tiny Llama config.json (no weights, no tokenizer): enough for vLLM's ModelConfig. With
    ``num_attention_heads`` above ``num_kv_heads``: grouped-query attention (vLLM replicates KV heads on
    TP ranks beyond them). ``mla``: a tiny DeepSeek-V2 config instead (``model_config.use_mla``; one latent
    of ``head_size`` = kv_lora_rank + qk_rope_head_dim per token, the same on every TP rank).
    ``sliding_window`` with ``full_every`` >= 2: a hybrid, declared as gpt-oss and Gemma 3 do
    (`sliding_window` + `layer_types`): every ``full_every``-th layer attends to all tokens, the others to the
    last ``sliding_window`` (2: gpt-oss-like, 6: Gemma-3-like). ``full_every=0``: no full-attention layer,
    every layer attends to the last ``sliding_window`` tokens, declared as Mistral-7B-v0.1 does
    (`sliding_window`, no `layer_types`): vLLM's EngineArgs copies the window into CacheConfig.sliding_window,
    which every `Attention` layer then takes, and vLLM plans one KV cache group with a `SlidingWindowSpec`.
    The stand-in worker reads all of them; `testbed.kvcache.attention_specs` gives the same pattern."""
    os.makedirs(path, exist_ok=True)
    heads = num_attention_heads or num_kv_heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": heads * head_size, "intermediate_size": 2 * heads * head_size,
        "num_attention_heads": heads, "num_key_value_heads": num_kv_heads, "head_dim": head_size,
        "num_hidden_layers": num_layers, "max_position_embeddings": 4096, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
        "eos_token_id": EOS, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if mla:
        if head_size < 8 or head_size % 4:
            raise ValueError(f"write_model_dir head_size={head_size}: MLA needs a multiple of 4, >= 8")
        rope = 4
        cfg.update({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "kv_lora_rank": head_size - rope, "qk_rope_head_dim": rope, "qk_nope_head_dim": 8,
                    "v_head_dim": 8, "q_lora_rank": None, "first_k_dense_replace": num_layers,
                    "moe_layer_freq": 1})
        del cfg["head_dim"]
    if sliding_window is not None:
        if mla or sliding_window < 1 or num_layers < (1 if full_every == 0 else 2):
            raise ValueError(f"write_model_dir sliding_window={sliding_window!r}: needs a window >= 1, at least "
                             f"2 layers (1 with full_every=0) and no MLA (num_layers={num_layers}, mla={mla})")
        types = hybrid_layer_types(num_layers, full_every)  # validates full_every
        cfg["sliding_window"] = sliding_window
        if full_every:
            # `layer_types` keeps vLLM's EngineArgs from copying the window into CacheConfig.sliding_window,
            # which it does only for models without per-layer types (or all of them sliding)
            cfg["layer_types"] = types
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_jamba_dir(path: str, *, num_layers: int, num_kv_heads: int, head_size: int,
                    num_attention_heads: int | None = None) -> str:
    """A tiny Jamba config.json (no weights): a Mamba hybrid, Mamba mixers on even layers and attention on
    odd ones (``attn_layer_period`` 2, offset 1), so vLLM plans one Mamba group and one attention group of
    equal layer counts. vLLM runs Mamba in "align" mode with prefix caching on (`MambaModelConfig`)."""
    if num_layers < 2 or num_layers % 2:
        raise ValueError(f"write_jamba_dir num_layers={num_layers!r}: an even count >= 2 (Mamba, attention pairs)")
    os.makedirs(path, exist_ok=True)
    heads = num_attention_heads or num_kv_heads
    hidden = heads * head_size
    cfg = {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": num_kv_heads,
        "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 1, "num_experts_per_tok": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
        "max_position_embeddings": 4096, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS,
        "pad_token_id": 0,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def mamba_state(prefix_hash: int, layer: int, rank: int, nbytes: int) -> torch.Tensor:
    """A Mamba layer's recurrent state after a prefix (int8 [nbytes]): a function of the prefix (its
    `KVContent.prefix_hashes` entry at the prefix's last token), the layer and the TP rank (each rank holds
    its own shard of the mixer's state). Different prefixes differ in almost every byte."""
    seed = (prefix_hash * 0x9E3779B1 + layer * 0x85EBCA6B + rank * 0xC2B2AE35) % (1 << 31)
    ramp = torch.arange(1, nbytes + 1, dtype=torch.int64)
    return (((ramp * (2 * seed + 1)) % (1 << 31)) >> 11).remainder(256).to(torch.uint8).view(torch.int8)


class KVContent:
    """KV of position p in the model's KV head h = base(prefix hash of tokens[0..p], layer, k|v) * span +
    h * head_size + arange(head_size), with span = the model's KV heads * head_size.

    A head's KV depends on the head, never on which rank holds it or on the TP size (as in a real model, up
    to the all-reduce's rounding): ranks of engines at different TP sizes holding one head hold the same
    bytes, and a rank holding another rank's heads holds other values. Integers below 2**24 are exact in
    float32, so equality checks are exact while the span is at most 16 (larger spans still compare
    deterministically, with a little less power to tell values apart). Different prefixes give different
    bases (up to a 2**20 hash: collisions are astronomically unlikely in a test run)."""

    def __init__(self, num_kv_heads: int, head_size: int, device: str = "cpu", *,
                 total_kv_heads: int | None = None) -> None:
        self.h, self.d = num_kv_heads, head_size  # the heads one rank holds
        self.total = total_kv_heads or num_kv_heads
        if self.total < num_kv_heads:
            raise ValueError(f"KVContent total_kv_heads={self.total}: fewer than a rank's {num_kv_heads}")
        self.ramp = torch.arange(num_kv_heads * head_size, dtype=torch.float32, device=device).view(
            num_kv_heads, head_size)
        self.span = self.total * head_size

    @staticmethod
    def prefix_hashes(tokens: list[int], upto: int, cache: list[int]) -> list[int]:
        h = cache[-1] if cache else 7
        for t in tokens[len(cache):upto]:
            h = (h * 1_000_003 + t + 1) % _MOD
            cache.append(h)
        return cache

    def bases(self, hashes: list[int], layer: int, kv: int) -> torch.Tensor:
        salt = layer * 0x9E3779B1 + kv * 0x7F4A7C15
        vals = [((h ^ salt) * 0x2545F491) % (1 << 20) * self.span for h in hashes]
        return torch.tensor(vals, dtype=torch.float32, device=self.ramp.device)

    def slots(self, hashes: list[int], layer: int, kv: int, first_head: int) -> torch.Tensor:
        """(len(hashes), heads, head_size) KV for these positions, of the model's KV heads from
        ``first_head`` on (a rank's: its first head)."""
        if not 0 <= first_head <= self.total - self.h:
            raise ValueError(f"KVContent first_head={first_head}: a rank's {self.h} heads from there pass the "
                             f"model's {self.total}")
        return self.bases(hashes, layer, kv)[:, None, None] + (self.ramp + first_head * self.d)

    @staticmethod
    def token_after(h: int) -> int:
        return 10 + (h * 0x5851F42D) % (VOCAB - 20)


def shared_prefix_prompts(n: int, *, num_prefixes: int, prefix_len: int, suffix_len: int,
                          seed: int = 0) -> list[list[int]]:
    """`n` prompts: one of `num_prefixes` shared prefixes + a unique suffix (deterministic)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, VOCAB - 10) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(10, VOCAB - 10) for _ in range(suffix_len)]
            for i in range(n)]


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens the emulated model generates after `prompt` (greedy, EOS never sampled)."""
    toks, cache = list(prompt), []
    for _ in range(max_tokens):
        KVContent.prefix_hashes(toks, len(toks), cache)
        toks.append(KVContent.token_after(cache[-1]))
    return toks[len(prompt):]
