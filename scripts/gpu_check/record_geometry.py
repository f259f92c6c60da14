"""Record the KV cache geometry vLLM 0.32's allocator produces, for the GPU check (no vLLM there).

For each case (layout x dtype x kernel block x spec) this builds the engine's KVCacheConfig and calls
vLLM's own `allocate_kv_cache` (testbed.kvcache) on CPU, and writes what a CUDA allocation of the same
config would be: the backing buffer's size and, per layer, the view's dtype, shape, strides and storage
offset (the allocator's arithmetic does not depend on the device). Run by `scripts/gpu-check.sh pack`.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig

from testbed.kvcache import LAYOUTS, SPLITTABLE_LAYOUTS, allocate, attention_specs, build_kv_cache_config

CASES: list[dict[str, Any]] = []
for layout in LAYOUTS:
    for dtype in ("float16", "bfloat16", "float8_e4m3fn"):
        for kernel in ((16, 8) if layout in SPLITTABLE_LAYOUTS else (16,)):
            for mla in (False, True):
                CASES.append(dict(layout=layout, dtype=dtype, kernel=kernel, mla=mla, layers=3, heads=2,
                                  head_size=16, block_size=16, num_blocks=9))
# one realistic shape per common layout (32 layers x 8 heads x 128, bf16): 2 MiB a block
for layout in ("LBNHC", "LHBNC", "BLNHC"):
    CASES.append(dict(layout=layout, dtype="bfloat16", kernel=16, mla=False, layers=32, heads=8, head_size=128,
                      block_size=16, num_blocks=12))


def record(case: dict[str, Any]) -> dict[str, Any]:
    vc = VllmConfig(cache_config=CacheConfig(block_size=case["block_size"]), device_config=DeviceConfig("cpu"))
    specs = attention_specs(case["layers"], block_size=case["block_size"], num_kv_heads=case["heads"],
                            head_size=case["head_size"], dtype=getattr(torch, case["dtype"]), mla=case["mla"])
    cfg = build_kv_cache_config(vc, specs, case["num_blocks"], case["layout"])
    kernel = None if case["kernel"] == case["block_size"] else [case["kernel"]]
    views = allocate(cfg, case["layout"], kernel_block_sizes=kernel)
    base = next(iter(views.values())).untyped_storage().data_ptr()
    sizes = {t.size for t in cfg.kv_cache_tensors}
    return {**case, "buffer_bytes": sizes.pop(), "views": {
        name: {"shape": list(t.shape), "stride": list(t.stride()),
               "offset_bytes": t.data_ptr() - base} for name, t in views.items()}}


def main() -> int:
    json.dump([record(c) for c in CASES], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
