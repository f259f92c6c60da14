"""Drivers of real runs: KV caches from vLLM's own allocator, the emulated model, the engine driver and its
stand-in worker class (`emu_worker`, the only module here that vLLM loads: as `worker_cls`).
`tests/`, `bench/` and `conformance/` import from here; `kvledger_connector/` never does."""
