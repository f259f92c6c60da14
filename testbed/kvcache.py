"""KV caches as vLLM's engine (0.32 or 0.33) builds them, for tests, benchmarks and drivers.

The engine resolves one `KVCacheLayout`, records it on `cache_config`, turns the layers' specs into a
`KVCacheConfig`, and each worker allocates it with `vllm.v1.worker.utils.allocate_kv_cache`, whose per-layer
``[B, H, N, C]`` views go unchanged to `register_kv_caches`. vLLM 0.32 builds the config with
`kv_cache_utils.get_kv_cache_groups` + `get_kv_cache_config_from_groups`; 0.33 moved planning to
`kv_cache_planning` behind the platform's `KVCacheConfigBuilder` (`get_global_kv_cache_groups`, then
`builder.get_kv_cache_config_from_groups(..., num_blocks)`). This module calls whichever the installed vLLM
exports: nothing here shapes a KV tensor.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

try:  # vLLM >= 0.33: the engine plans through the platform's KVCacheConfigBuilder
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups as _default_kv_cache_groups
    _PLANNING_BUILDER = True
except ImportError:  # vLLM 0.32: module-level functions in kv_cache_utils
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    _PLANNING_BUILDER = False
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from testbed.emu_model import SLIDING, hybrid_layer_types

#: every layout the installed vLLM defines
LAYOUTS: tuple[str, ...] = tuple(lay.name for lay in KVCacheLayout)
#: layouts whose blocks are dense pages: the only ones vLLM lets split into kernel blocks
SPLITTABLE_LAYOUTS: tuple[str, ...] = ("LBHNC", "LBNHC")


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def attention_specs(num_layers: int, *, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype = torch.float32, mla: bool = False,
                    cache_dtype_str: str | None = None,
                    sliding_window: int | None = None, full_every: int = 2) -> dict[str, KVCacheSpec]:
    """The per-layer specs a model's attention layers report (`get_kv_cache_spec`). ``sliding_window``:
    every ``full_every``-th layer full attention and the others attending to the last ``sliding_window``
    tokens (`SlidingWindowSpec`; `emu_model.hybrid_layer_types`); ``full_every=0``: every layer sliding window
    (a Mistral-like model, one KV cache group)."""
    if mla:
        if sliding_window is not None:
            raise ValueError("attention_specs: sliding_window is not supported with mla")
        spec: KVCacheSpec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size,
                                             dtype=dtype, cache_dtype_str=cache_dtype_str)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                                 dtype=dtype)
    if sliding_window is None:
        return {n: spec for n in layer_names(num_layers)}
    if sliding_window < 1 or num_layers < (1 if full_every == 0 else 2):
        raise ValueError(f"attention_specs sliding_window={sliding_window!r}, num_layers={num_layers!r}: "
                         "need a window >= 1 and at least 2 layers (one sliding, one full; 1 with full_every=0)")
    sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                           sliding_window=sliding_window)
    types = hybrid_layer_types(num_layers, full_every)
    return {n: sw if t == SLIDING else spec for t, n in zip(types, layer_names(num_layers))}


def mamba_layer_names(hf_config: Any) -> list[str]:
    """A Mamba hybrid's layer names (`emu_model.write_jamba_dir`), in layer order: mixers and attention."""
    return [f"model.layers.{i}.self_attn.attn" if t == "attention" else f"model.layers.{i}.mixer"
            for i, t in enumerate(hf_config.layers_block_type)]


def align_mamba_block_size(vllm_config: Any) -> None:
    """What the engine does after loading a Mamba hybrid (`Platform.update_block_size_for_backend` ->
    `_align_hybrid_block_size` with the CPU attention backend): attention and Mamba pages made one size, so
    ``cache_config.block_size`` may grow and ``mamba_block_size`` / ``mamba_page_size_padded`` are set.
    Called directly because a stand-in model has no attention layers for the engine to find the backend of."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    type(current_platform)._align_hybrid_block_size(vllm_config, CPUAttentionBackend)


def mamba_hybrid_specs(vllm_config: Any, dtype: torch.dtype = torch.float32) -> dict[str, KVCacheSpec]:
    """The per-layer specs of a Mamba hybrid (`emu_model.write_jamba_dir`) once its block size is aligned
    (`align_mamba_block_size`), as its layers report them: the attention layers' `FullAttentionSpec`, the
    mixers' `MambaSpec` as `MambaBase.get_kv_cache_spec` builds it from the model class's state shapes and
    dtypes."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
    attn = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
                             head_size=mc.get_head_size(), dtype=dtype)
    mamba = MambaSpec(shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=cc.mamba_block_size,
                      page_size_padded=cc.mamba_page_size_padded, mamba_type=MambaAttentionBackendEnum.MAMBA1,
                      mamba_cache_mode=cc.mamba_cache_mode, num_speculative_blocks=vllm_config.num_speculative_tokens)
    return {n: (mamba if n.endswith(".mixer") else attn) for n in mamba_layer_names(mc.hf_config)}


def build_kv_cache_config(vllm_config: Any, specs: Mapping[str, KVCacheSpec], num_blocks: int,
                          layout: str) -> KVCacheConfig:
    """The engine's per-worker path: record the resolved layout on `cache_config` (as
    `resolve_kv_cache_layout` does), group the layers (`get_kv_cache_groups`) and build the config
    (`get_kv_cache_config_from_groups`) with `num_gpu_blocks_override` = num_blocks, block 0 being
    vLLM's null block. `get_kv_cache_configs` adds only an admission check that one max_model_len
    request fits the pool, which tests that force preemption with tiny pools must skip."""
    cc = vllm_config.cache_config
    if cc.kv_cache_layout not in (None, layout):
        raise ValueError(f"cache_config.kv_cache_layout={cc.kv_cache_layout!r}, asked for {layout!r}")
    cc.kv_cache_layout = KVCacheLayout[layout].name
    cc.num_gpu_blocks_override = num_blocks
    if _PLANNING_BUILDER:
        # 0.33's per-worker path in EngineCore._initialize_kv_caches / get_kv_cache_configs
        if vllm_config.model_config is None:
            # a model-less engine config (tests): no model can declare its own grouping, so the default
            # builder's grouping is the planning module's (the builder itself reads model_config)
            groups = _default_kv_cache_groups(vllm_config, dict(specs))
        else:
            groups = get_global_kv_cache_groups(vllm_config, [dict(specs)])
        cfg = get_kv_cache_config_builder(vllm_config).get_kv_cache_config_from_groups(
            vllm_config, groups, num_blocks)
    else:
        groups = get_kv_cache_groups(vllm_config, dict(specs))
        page = sum(s.page_size_bytes for s in specs.values())
        cfg = get_kv_cache_config_from_groups(vllm_config, groups, page * (num_blocks + 1))
    cfg.kv_cache_layout = cc.kv_cache_layout
    if cfg.num_blocks != num_blocks:
        raise ValueError(f"vLLM built {cfg.num_blocks} blocks, asked for {num_blocks}")
    return cfg


def allocate(kv_cache_config: KVCacheConfig, layout: str, *, device: str | torch.device = "cpu",
             kernel_block_sizes: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """vLLM's own allocation: one backing buffer, one [B, H, N, C] view per layer."""
    return allocate_kv_cache(kv_cache_config, torch.device(device), KVCacheLayout[layout],
                             list(kernel_block_sizes) if kernel_block_sizes is not None else None)
