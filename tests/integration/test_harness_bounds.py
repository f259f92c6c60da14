"""Every wait in the integration machinery is bounded (a hang fails its test with a diagnosis):
the harness's step loop, and a store client's close."""
from __future__ import annotations

import threading
import time

import pytest

from connector.config import StoreConfig
from tests.integration.harness import Harness, HarnessStallError, shared_prefix_prompts


class GatedGet:
    """Test double around the real store: `batch_get` blocks until `gate` is set (bounded by 30 s), so a
    load never finishes while the test wants it not to."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def batch_get(self, *a):
        self.gate.wait(30)
        return self.inner.batch_get(*a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_load_that_never_finishes_stalls_the_harness_with_a_diagnosis(store_config: StoreConfig):
    prompts = shared_prefix_prompts(6, num_prefixes=6, prefix_len=48, suffix_len=8, seed=23)
    gate = threading.Event()
    with Harness(store_config, num_blocks=14, stall_timeout_s=2.0) as h:
        for i, p in enumerate(prompts):
            h.add_request(f"req-{i}", p, 8)
        h.run()  # stores every prefix
        for w in h.workers:
            w.worker_side.store = GatedGet(w.worker_side.store, gate)
        for i, p in enumerate(prompts):  # most prefixes left vLLM's cache: they are loaded from the store
            h.add_request(f"req-{i}", p, 8)
        t0 = time.monotonic()
        try:
            with pytest.raises(HarnessStallError) as e:
                h.run()
        finally:
            gate.set()
        assert time.monotonic() - t0 < 30  # the stall bound, not run()'s 240 s or the gate's 30 s
        assert "no progress" in str(e.value) and "load pins=" in str(e.value)
        assert "load pins=0" not in str(e.value)  # it names what it waits for
        h.run()  # released: everything finishes and drains
        assert h.garbage == [] and h.check_at_rest() == []
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, 8)


def test_stall_timeout_must_be_positive(store_config: StoreConfig):
    with pytest.raises(ValueError, match="stall_timeout_s=0"):
        Harness(store_config, stall_timeout_s=0)
