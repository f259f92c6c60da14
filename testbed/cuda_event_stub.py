"""Test double, CPU only: a no-op stand-in for ``torch.cuda.Event``, for upstream's connector in bench.engine.

vLLM 0.32's `MooncakeStoreConnector` orders its saves after the forward with a CUDA event: its worker's
`wait_for_save` creates ``torch.cuda.Event()`` and records it, and the save thread calls ``synchronize()``
before reading the blocks. On a CPU-only torch that constructor raises ("Tried to instantiate dummy base
class Event"), so upstream cannot run in the CPU engine at all. On CPU there is no stream to order: the
forward has finished writing the KV cache when `wait_for_save` runs, so an event that records, waits and
synchronizes nothing keeps upstream's semantics there. `install()` replaces ``torch.cuda.Event`` with
`CudaEventStandIn` in the calling process only; bench.engine asks testbed/engine_run.py to call it in the
upstream engine's own subprocess (spec key ``preload``), never in ours or the no-connector one. Where CUDA
is available it installs nothing (the real event is needed there, and works).
"""
from __future__ import annotations

from typing import Any


class CudaEventStandIn:
    """Records nothing, waits for nothing; queried, it is always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def install() -> str:
    """What was done, for the run's result."""
    import torch
    if torch.cuda.is_available():
        return "not installed: CUDA is available"
    torch.cuda.Event = CudaEventStandIn  # type: ignore[misc,assignment]
    return "torch.cuda.Event -> testbed.cuda_event_stub.CudaEventStandIn"
