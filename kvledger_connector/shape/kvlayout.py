"""What a stored block is made of: the KV cache vLLM allocates, read as (address, length) segments.

vLLM 0.32's model runner hands `register_kv_caches` one 4-D view per layer, ``[B, H, N, C]`` (kernel
blocks, head slots, tokens per kernel block, content; full attention packs K and V in C), carved out of
one int8 backing allocation by `allocate_kv_cache`. Its strides follow a `KVCacheLayout` (LBHNC, LBNHC,
LHBNC, BLHNC, BLNHC, BHLNC), and a manager block may be split into ``ratio`` kernel blocks
(``B = num_blocks * ratio``, ``N * ratio = block_size``). Nothing here assumes a shape: every segment
comes from the views' own shapes and strides.

The object stored under a block's key (its byte order, which the key's layout digest names)::

    for each distinct layer, in natural name order (layers.2 before layers.10; aliased views once):
        the block's elements in the layout's physical order of (H, N, C), with N = all block_size
        tokens of the manager block (kernel block k, token n  ->  token k * N + n)

    LBNHC, 2 layers:       | L0: N H C (one run) | L1: N H C (one run) |          2 segments
    LHBNC, 2 layers, H=2:  | L0 h0: N C | L0 h1: N C | L1 h0: N C | L1 h1: N C |   4 segments
    BLNHC:                 | L0 L1 ... (adjacent in memory: merged) |           1 segment

So the bytes depend on the layout (it is in the key digest: engines with different layouts never
share keys) but not on the attention backend's kernel block size (a split block is read back in token
order), which the scheduler, which computes keys too, cannot know. Runs are found by coalescing the
innermost dims whose strides are dense; outer dims are enumerated; consecutive runs that touch in memory
and move by the same stride from block to block are merged. Block ``m``'s segment ``i`` lies at
``base_i + m * block_stride_i``. What cannot be read this way is refused with a `KVLayoutError` naming
the layer, the layout and why.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvledger.errors import LedgerInputError

#: the physical order of (H, N, C) inside a block, per vLLM 0.32 `KVCacheLayout` name (L and B dropped)
LAYOUT_HNC_ORDER: dict[str, tuple[str, ...]] = {
    "LBHNC": ("H", "N", "C"), "LBNHC": ("N", "H", "C"), "LHBNC": ("H", "N", "C"),
    "BLHNC": ("H", "N", "C"), "BLNHC": ("N", "H", "C"), "BHLNC": ("H", "N", "C"),
}
#: bound on segments per key (a block split into more runs than this is refused: a put of tiny runs)
MAX_SEGMENTS_PER_KEY = 1 << 14


class KVLayoutError(LedgerInputError):
    """The KV cache cannot be served (its config's groups and specs, or its tensors: shape, layout, aliasing);
    the message names the layer or group and why. ``field``, ``value``: what was refused, where known."""

    def __init__(self, message: str, field: str = "kv_cache", value: Any = None) -> None:
        super().__init__(field, value, message, message)


@dataclass(frozen=True)
class Segment:
    """Block m's bytes of this run: [base + m * block_stride, + nbytes)."""

    base: int
    block_stride: int
    nbytes: int


@dataclass(frozen=True)
class BlockCopyPlan:
    """Per-block copy plan over all layers: `buffers(block_id)` gives the (ptrs, sizes) of one key."""

    layout: str
    num_blocks: int
    kernel_ratio: int
    segments: tuple[Segment, ...]
    storages: tuple[tuple[int, int], ...]  # distinct backing allocations: (data_ptr, nbytes)
    layers: tuple[str, ...]  # distinct layers in object order
    is_cuda: bool
    segment_layers: tuple[str, ...] = ()  # the (first) layer of each segment, for error messages

    @property
    def block_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def buffers(self, block_id: int) -> tuple[list[int], list[int]]:
        if not 0 <= block_id < self.num_blocks:
            raise KVLayoutError(f"block_id={block_id}: not in 0..{self.num_blocks - 1}", "block_id", block_id)
        return ([s.base + block_id * s.block_stride for s in self.segments],
                [s.nbytes for s in self.segments])

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        return (np.array([s.base for s in self.segments], dtype=np.int64),
                np.array([s.block_stride for s in self.segments], dtype=np.int64),
                [s.nbytes for s in self.segments])

    def batch_buffers(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """`buffers` of many blocks in one vectorised step (a layout like LHBNC has hundreds of segments
        per key: a Python loop per segment costs a tenth of the put). The sizes list is shared by every
        key (read-only)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = [int(b) for b in ids if not 0 <= b < self.num_blocks]
            raise KVLayoutError(f"block_id={bad[0]}: not in 0..{self.num_blocks - 1}", "block_id", bad[0])
        bases, strides, sizes = self._arrays
        return (bases[None, :] + ids[:, None] * strides[None, :]).tolist(), [sizes] * len(ids)


def natural_key(name: str) -> tuple[Any, ...]:
    """'model.layers.10.attn' sorts after 'model.layers.2.attn' (numbers compare as numbers)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _layer_runs(name: str, t: torch.Tensor, layout: str, block_size: int,
                ) -> tuple[int, list[tuple[int, int]], int]:
    """(kernel ratio, [(offset from the block's first byte, nbytes)] in object order, block stride)."""
    if t.dim() != 4:
        raise KVLayoutError(f"layer {name!r}: a {t.dim()}-D tensor of shape {tuple(t.shape)} (layout {layout}); "
                            f"expected vLLM's per-layer [B, H, N, C] view (specs without layer views, e.g. "
                            f"Mamba state, are not supported)")
    B, H, N, C = (int(x) for x in t.shape)
    if N < 1 or block_size % N or B % (block_size // N):
        # an attention view has N * ratio = block_size tokens and B = num_blocks * ratio kernel blocks;
        # a state spec (Mamba: one state per block) fits neither
        raise KVLayoutError(f"layer {name!r}: shape {tuple(t.shape)} is not an attention view of block_size="
                            f"{block_size} (N={N} tokens per kernel block must divide it and B must count "
                            f"whole blocks; layout {layout}); state specs such as Mamba are not supported")
    ratio = block_size // N
    es = t.element_size()
    sB, sH, sN, sC = (int(s) * es for s in t.stride())
    # no two elements of the view share a byte (else two blocks could overlap): sort by stride, each
    # stride must clear the extent of the dims inside it
    extent = es
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, (sB, sH, sN, sC)) if s > 1),
                               key=lambda x: x[1]):
        if stride < extent:
            raise KVLayoutError(f"layer {name!r}: elements overlap (shape {tuple(t.shape)}, strides "
                                f"{tuple(t.stride())}, layout {layout}): blocks are not addressable as "
                                f"disjoint segments")
        extent = stride * int(size)
    dims = {"H": (H, sH), "C": (C, sC)}
    # N of the manager block = (kernel block k, token n): k outer
    order: list[tuple[int, int]] = []
    for d in LAYOUT_HNC_ORDER[layout]:
        if d == "N":
            order += [(ratio, sB), (N, sN)]
        else:
            order.append(dims[d])
    order = [(s, st) for s, st in order if s > 1]
    run = es
    while order and order[-1][1] == run:  # coalesce dense inner dims into one run
        run *= order.pop()[0]
    count = 1
    for s, _ in order:
        count *= s
    if count > MAX_SEGMENTS_PER_KEY:
        raise KVLayoutError(f"layer {name!r}: a block is {count} runs of {run} bytes (shape {tuple(t.shape)}, "
                            f"strides {tuple(t.stride())}, layout {layout}); more than "
                            f"MAX_SEGMENTS_PER_KEY={MAX_SEGMENTS_PER_KEY}")
    offsets = [sum(i * st for i, (_, st) in zip(idx, order))
               for idx in itertools.product(*(range(s) for s, _ in order))]
    return ratio, [(o, run) for o in offsets], ratio * sB


def plan_block_copies(kv_caches: Mapping[str, Any], *, layout: str, block_size: int,
                      num_blocks: int | None = None,
                      max_segments: int = MAX_SEGMENTS_PER_KEY) -> BlockCopyPlan:
    """The copy plan of vLLM's per-layer views. `layout`: the resolved `KVCacheLayout` name
    (`cache_config.get_resolved_kv_cache_layout().name`); `num_blocks`: the manager's block count
    (checked against the views when given)."""
    if layout not in LAYOUT_HNC_ORDER:
        raise KVLayoutError(f"KV cache layout {layout!r}: not one of {sorted(LAYOUT_HNC_ORDER)}", "layout",
                            layout)
    if not kv_caches:
        raise KVLayoutError("register_kv_caches: no KV cache tensors")
    seen_views: dict[tuple[Any, ...], str] = {}
    storages: dict[int, int] = {}
    segs: list[Segment] = []
    seg_layers: list[str] = []
    layers: list[str] = []
    nb: int | None = None
    ratio0: int | None = None
    cuda = False
    for name in sorted(kv_caches, key=natural_key):
        t = kv_caches[name]
        if not isinstance(t, torch.Tensor):
            raise KVLayoutError(f"layer {name!r}: a {type(t).__name__}, not a tensor (layout {layout}); "
                                f"state lists (Mamba, hybrid models) are not supported")
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in seen_views:  # vLLM aliases KV-sharing layers to their target's view: store it once
            continue
        seen_views[ident] = name
        ratio, runs, bstride = _layer_runs(name, t, layout, block_size)
        b = t.shape[0] // ratio
        if nb is None:
            nb, ratio0 = b, ratio
        elif b != nb:
            raise KVLayoutError(f"layer {name!r}: {b} blocks, layer {layers[0]!r} has {nb} (layout {layout})")
        elif ratio != ratio0:
            raise KVLayoutError(f"layer {name!r}: {ratio} kernel blocks per block, layer {layers[0]!r} has "
                                f"{ratio0} (layout {layout})")
        layers.append(name)
        base = t.data_ptr()
        for off, n in runs:
            last = segs[-1] if segs else None
            if last is not None and last.block_stride == bstride and last.base + last.nbytes == base + off:
                segs[-1] = Segment(last.base, bstride, last.nbytes + n)
            else:
                segs.append(Segment(base + off, bstride, n))
                seg_layers.append(name)
        st = t.untyped_storage()
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        cuda = cuda or t.is_cuda
    if nb is None or ratio0 is None:
        raise KVLayoutError("register_kv_caches: no KV cache tensors")
    if num_blocks is not None and nb != num_blocks:
        raise KVLayoutError(f"the views hold {nb} blocks, the KV cache config {num_blocks} (layout {layout})")
    if len(segs) > max_segments:
        raise KVLayoutError(f"a block is {len(segs)} segments over {len(layers)} layers (layout {layout}); "
                            f"more than max_segments={max_segments}")
    plan = BlockCopyPlan(layout=layout, num_blocks=nb, kernel_ratio=ratio0, segments=tuple(segs),
                         storages=tuple(sorted(storages.items())), layers=tuple(layers), is_cuda=cuda,
                         segment_layers=tuple(seg_layers))
    _check_disjoint(plan)
    return plan


def _check_disjoint(plan: BlockCopyPlan) -> None:
    """Layers alias nothing of one another: the segments of the first two and the last block are
    pairwise disjoint (within one layer the stride check already guarantees it; this catches two
    distinct views over the same bytes)."""
    spans = []
    for m in sorted({0, min(1, plan.num_blocks - 1), plan.num_blocks // 2, plan.num_blocks - 1}):
        ptrs, sizes = plan.buffers(m)
        spans += [(p, p + n, m, layer) for p, n, layer in zip(ptrs, sizes, plan.segment_layers)]
    spans.sort()
    for (a0, a1, ma, la), (b0, b1, mb, lb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise KVLayoutError(f"layers {la!r} and {lb!r} alias the same bytes (blocks {ma} and {mb}, layout "
                                f"{plan.layout}): two distinct views over one region cannot be stored as one block")


def plan_state_copies(kv_caches: Mapping[str, Any], *, page_bytes: int, num_blocks: int | None = None
                      ) -> BlockCopyPlan:
    """The copy plan of a Mamba group in vLLM's "align" mode: block m of each layer is one state page, its
    whole padded page (``page_bytes``, the spec's `page_size_bytes`: vLLM pads every group's page to one
    size, so an attention block and a state block of equal layer counts are equal bytes). A layer's view
    is what `allocate_kv_cache` gives a Mamba layer: one tensor whose first dim counts blocks, block m's
    state starting its page (``data_ptr + m * stride(0)``), the rest of the page vLLM's padding. Stored
    per layer in natural name order: | L0 page | L1 page | ..."""
    if page_bytes.__class__ is not int or page_bytes < 1:
        raise KVLayoutError(f"page_bytes={page_bytes!r}: must be an int >= 1", "page_bytes", page_bytes)
    if not kv_caches:
        raise KVLayoutError("register_kv_caches: no Mamba state views")
    segs: list[Segment] = []
    layers: list[str] = []
    storages: dict[int, int] = {}
    nb: int | None = None
    cuda = False
    for name in sorted(kv_caches, key=natural_key):
        t = kv_caches[name]
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise KVLayoutError(f"layer {name!r}: a {type(t).__name__}{' of shape ' + str(tuple(t.shape)) if isinstance(t, torch.Tensor) else ''}; "
                                f"expected the one tensor per Mamba layer that vLLM's allocator gives, blocks first")
        es = t.element_size()
        stride = int(t.stride(0)) * es
        content = t[0].numel() * es
        if stride != page_bytes or content > page_bytes or not t[0].is_contiguous():
            raise KVLayoutError(f"layer {name!r}: shape {tuple(t.shape)}, strides {tuple(t.stride())} of {t.dtype}: "
                                f"a block's state is not one dense run at the start of a {page_bytes}-byte page")
        st = t.untyped_storage()
        end = t.data_ptr() + (int(t.shape[0]) - 1) * stride + page_bytes
        if t.data_ptr() < st.data_ptr() or end > st.data_ptr() + st.nbytes():
            raise KVLayoutError(f"layer {name!r}: the last block's page runs past its allocation")
        if nb is None:
            nb = int(t.shape[0])
        elif int(t.shape[0]) != nb:
            raise KVLayoutError(f"layer {name!r}: {t.shape[0]} blocks, layer {layers[0]!r} has {nb}")
        layers.append(name)
        segs.append(Segment(t.data_ptr(), stride, page_bytes))
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        cuda = cuda or t.is_cuda
    if num_blocks is not None and nb != num_blocks:
        raise KVLayoutError(f"the Mamba views hold {nb} blocks, the KV cache config {num_blocks}")
    plan = BlockCopyPlan(layout="state", num_blocks=int(nb or 0), kernel_ratio=1, segments=tuple(segs),
                         storages=tuple(sorted(storages.items())), layers=tuple(layers), is_cuda=cuda,
                         segment_layers=tuple(layers))
    _check_disjoint(plan)
    return plan
