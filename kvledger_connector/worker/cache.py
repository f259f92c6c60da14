"""`RegisteredCache`: the KV cache a rank's steps read and write, one value built once when vLLM registers its
caches (`WorkerSide.register_kv_caches`), or by a driver over its own buffers. The steps are built from it
whole (kvledger_connector/worker/steps.py); nothing of it changes afterwards."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvledger.errors import LedgerInputError

if TYPE_CHECKING:
    from kvledger_connector.shape.integrity import BlockSeal

# (ptrs, sizes) per (block id, part of a block), as the store's batch calls take them: the connector's KV cache
# plans (`PartBuffers`), or a driver's
Buffers = Callable[[list[int], list[int]], tuple[list[list[int]], list[list[int]]]]


@dataclass(frozen=True)
class RegisteredCache:
    """Where a rank's blocks lie and what one key's object is.

    ``buffers``: each entry's (block id, part) to its segments. ``num_blocks``: the cache's blocks, the range a
    spec's block ids are checked against (None: a driver's own buffers, ids not bounded above).
    ``key_bytes``: one key's object, its integrity trailer included. ``seal``: the integrity tags
    (kvledger_connector/shape/integrity.py); None: off. ``sub_batch``: keys per batch get (`load_batch_keys`);
    None: the config's ``load_sub_batch_keys``. ``is_cuda``: the cache is on a CUDA device (a put then waits
    for the forward's event)."""
    buffers: Buffers
    num_blocks: int | None
    key_bytes: int = 0
    seal: BlockSeal | None = None
    sub_batch: int | None = None
    is_cuda: bool = False

    def __post_init__(self) -> None:
        if not callable(self.buffers):
            raise LedgerInputError("buffers", type(self.buffers).__name__, "must be callable (block ids, parts)")
        if self.num_blocks is not None and (self.num_blocks.__class__ is not int or self.num_blocks < 0):
            raise LedgerInputError("num_blocks", self.num_blocks, "must be an int >= 0, or None (not bounded)")
        if self.key_bytes.__class__ is not int or self.key_bytes < 0:
            raise LedgerInputError("key_bytes", self.key_bytes, "must be an int >= 0")
        if self.sub_batch is not None and (self.sub_batch.__class__ is not int or self.sub_batch < 1):
            raise LedgerInputError("sub_batch", self.sub_batch, "must be an int >= 1, or None (the config's)")
