"""The torch kernels of the integrity tags, run where the KV cache lives (kvledger_connector/shape/integrity.py
defines the tags and calls these). Torch only, no project import: scripts/gpu-check.sh ships this file to
a CUDA machine and checks the mm8 tag there against its definition.

A block's object is read through views ``[num_blocks, count, nbytes]`` of its KV cache storage, each at an
offset in the object (integrity.BlockSeal builds them from a copy plan)."""
from __future__ import annotations

import torch

LANES = 8  # mm8: the tag's uint64 lanes
CHUNK = 512  # mm8: bytes per first-level sum: 512 * 128 * 128 = 2**23, exact in int32 and in float32


@torch.jit.script
def gather_rows(views: list[torch.Tensor], offsets: list[int], block_ids: list[int], out: torch.Tensor) -> None:
    """Block ``block_ids[i]`` of the views into row i of ``out`` (int8), in object order: one strided copy per
    block and view, all in one call, which TorchScript runs with the GIL released once."""
    for i in range(len(block_ids)):
        row = out[i]
        b = block_ids[i]
        for j in range(len(views)):
            v = views[j]
            n = v.size(1) * v.size(2)
            row[offsets[j]:offsets[j] + n].view([v.size(1), v.size(2)]).copy_(v[b])


@torch.jit.script
def mm8_digests_few(views: list[torch.Tensor], block_ids: list[int], a: torch.Tensor, u: torch.Tensor,
                    pad: int) -> torch.Tensor:
    """mm8's T of a few blocks (int64 [n, LANES]) in one call: TorchScript runs the whole graph with the GIL
    released once; the same arithmetic as `mm8_digests`. ``pad``: zero bytes to whole chunks."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=a.device)
    n = ids.size(0)
    parts = [v.index_select(0, ids).reshape(n, -1) for v in views]
    if pad > 0:
        parts.append(torch.zeros((n, pad), dtype=torch.int8, device=ids.device))
    x = torch.cat(parts, dim=1).reshape(-1, a.size(0))
    if x.is_cuda and x.size(0) <= 16:  # the int8 kernel's smallest m on CUDA; float32 is exact here too
        h = (x.to(torch.float32) @ a.to(torch.float32)).to(torch.int32)
    else:
        h = torch._int_mm(x, a)
    return (h.reshape(n, -1, a.size(1)).to(torch.int64) * u).sum(dim=1)


def int8_matmul(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [m, CHUNK] int8 @ a [CHUNK, LANES] int8 -> int32, exact either way."""
    try:
        return torch._int_mm(x, a)
    except RuntimeError:  # shapes or a device the int8 kernel does not take: float32 holds every value exactly
        return (x.to(torch.float32) @ a.to(torch.float32)).to(torch.int32)


def mm8_digests(buf: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """mm8's T (int64 [n, LANES], on buf's device) of objects ``buf`` (int8 [n, whole chunks], zero-padded)."""
    n, width = buf.shape
    h = int8_matmul(buf.view(n * (width // CHUNK), CHUNK), a).view(n, width // CHUNK, LANES)
    return (h.to(torch.int64) * u).sum(dim=1)  # int64 arithmetic wraps: mod 2**64
