"""GPU variants of the integration tests: KV cache as CUDA tensors, a CUDA event recorded after the forward
and waited on by the store thread before it reads. Skipped without CUDA. On a GPU host install the CUDA
Mooncake wheel (`mooncake-transfer-engine`) so that GPU memory can be registered with the store."""
from __future__ import annotations

import pytest
import torch

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, shared_prefix_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_cuda_kv_cache_preemption_and_store_hits(store_config: StoreConfig, tp_size: int):
    prompts = shared_prefix_prompts(16, num_prefixes=3, prefix_len=48, suffix_len=20, seed=70 + tp_size)
    with Harness(store_config, tp_size=tp_size, num_blocks=18, device="cuda") as h:
        assert all(w.worker_side.steps.cache.is_cuda for w in h.workers)  # the event path is on
        for _ in range(2):
            h.stats.outputs.clear()
            for i, p in enumerate(prompts):
                h.add_request(f"req-{i}", p, 40)
            h.run()
            for i, p in enumerate(prompts):
                assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, 40)
        assert h.stats.preemptions > 0
        assert h.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0
        assert h.garbage == [] and h.check_at_rest() == []
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0
