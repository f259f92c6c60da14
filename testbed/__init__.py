"""Drivers of real runs (not loaded by vLLM): KV caches from vLLM's own allocator, the in-process harness.
`tests/`, `bench/` and `conformance/` import from here; `connector/` never does."""
