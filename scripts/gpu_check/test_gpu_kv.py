"""The GPU check (runs from the packed folder on a CUDA machine: torch, pytest; no vLLM, no Mooncake).

Caches are built on the device with exactly the geometry vLLM 0.32's allocator gives (geometry.json,
recorded with vLLM by `scripts/gpu-check.sh pack`): one uint8 backing buffer, per layer a view with the
allocator's dtype, shape, strides and offset. The connector's copy plan (shape/kvlayout.py, the project's own
module) must address exactly each block's bytes, in the layout's order, on device memory; a read
ordered after the forward by a CUDA event (as the worker's store thread does) sees the forward's writes;
and the integrity tag CUDA KV gets (shape/tagkernel.py, the project's own: mm8, an int8 matmul and a 64-bit
multiply-sum) is exact on the device, by both of its paths, against its definition computed on the host.
One test measures, and prints, the tag's rate on the device against a device-to-host copy of the same bytes
(what a host-side hash would have to move first); nothing timed is asserted.
`GPU_CHECK_DEVICE=cpu` runs the same checks on CPU (the project's CI does, to keep the pack honest).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kvlayout  # noqa: E402  (kvledger_connector/shape/kvlayout.py, copied by the pack)
import tagkernel  # noqa: E402  (kvledger_connector/shape/tagkernel.py, copied by the pack)

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
CASES = json.loads((Path(__file__).parent / "geometry.json").read_text())
HNC = {"LBHNC": "HNC", "LBNHC": "NHC", "LHBNC": "HNC", "BLHNC": "HNC", "BLNHC": "NHC", "BHLNC": "HNC"}

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.exit("GPU_CHECK_DEVICE=cuda but torch sees no CUDA device", returncode=3)


def _build(case: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    buf = torch.zeros(case["buffer_bytes"], dtype=torch.uint8, device=DEVICE)
    dtype = getattr(torch, case["dtype"])
    es = torch.empty((), dtype=dtype).element_size()
    typed = buf.view(dtype)
    views = {n: torch.as_strided(typed, v["shape"], v["stride"], v["offset_bytes"] // es)
             for n, v in case["views"].items()}
    return buf, views


def _fill(views: dict[str, torch.Tensor], num_blocks: int, salt: int = 0) -> None:
    """Distinct bytes through the views: the block id in the top bits, (layer, h, token, byte) below."""
    for li, name in enumerate(sorted(views, key=kvlayout.natural_key)):
        t8 = views[name].view(torch.uint8)
        B, H, N, C = t8.shape
        r = B // num_blocks
        kb = torch.arange(B, device=DEVICE).view(B, 1, 1, 1)
        blk, tok = kb // r, (kb % r) * N + torch.arange(N, device=DEVICE).view(1, 1, N, 1)
        h = torch.arange(H, device=DEVICE).view(1, H, 1, 1)
        c = torch.arange(C, device=DEVICE).view(1, 1, 1, C)
        low = (li * 7 + h * 5 + tok * 3 + c + salt) % 16
        t8.copy_((blk % 16) * 16 + low)


def _canonical(views: dict[str, torch.Tensor], layout: str, m: int, num_blocks: int) -> torch.Tensor:
    """Block m's object computed through the views alone: per layer (natural order), the layout's (H, N, C)
    order with the block's tokens in order."""
    parts = []
    for name in sorted(views, key=kvlayout.natural_key):
        t8 = views[name].view(torch.uint8)
        r = t8.shape[0] // num_blocks
        blk = t8[m * r:(m + 1) * r]  # (r, H, N, C)
        order = (0, 2, 1, 3) if HNC[layout] == "NHC" else (1, 0, 2, 3)  # (r,N,H,C) or (H,r,N,C)
        parts.append(blk.permute(*order).reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['layout']}-{c['dtype']}-k{c['kernel']}-"
                                                       f"{'mla' if c['mla'] else 'mha'}-L{c['layers']}")
def test_copy_plan_addresses_exactly_each_block_on_the_device(case: dict) -> None:
    buf, views = _build(case)
    nb = case["num_blocks"]
    _fill(views, nb)
    plan = kvlayout.plan_block_copies(views, layout=case["layout"], block_size=case["block_size"], num_blocks=nb)
    assert plan.is_cuda == (DEVICE == "cuda")
    base = buf.data_ptr()
    ptrs_all, sizes_all = plan.batch_buffers(list(range(nb)))
    for m in range(nb):
        got = torch.cat([buf[p - base:p - base + n] for p, n in zip(ptrs_all[m], sizes_all[m])])
        assert got.numel() == plan.block_bytes
        assert torch.equal(got, _canonical(views, case["layout"], m, nb)), f"block {m}"
        assert bool(((got // 16) == m % 16).all()), f"block {m} holds bytes of another block"


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA event ordering")
def test_a_read_after_the_forwards_event_sees_the_forwards_writes() -> None:
    case = next(c for c in CASES if c["layers"] == 32 and c["layout"] == "LBNHC")
    buf, views = _build(case)
    nb = case["num_blocks"]
    plan = kvlayout.plan_block_copies(views, layout=case["layout"], block_size=case["block_size"], num_blocks=nb)
    for salt in range(1, 6):
        _fill(views, nb, salt)  # the "forward": kernels queued on the current stream
        event = torch.cuda.Event()
        event.record()
        seen: list[torch.Tensor] = []

        def store_thread() -> None:  # the worker's store thread: wait for the event, then read the block
            event.synchronize()
            ptrs, sizes = plan.buffers(3)
            seen.append(torch.cat([buf[p - buf.data_ptr():p - buf.data_ptr() + n] for p, n in zip(ptrs, sizes)]).cpu())

        th = threading.Thread(target=store_thread)
        th.start()
        th.join(60)
        assert seen and torch.equal(seen[0], _canonical(views, case["layout"], 3, nb).cpu()), f"salt {salt}"


# ---------------------------------------------------------------- the integrity tag of CUDA KV (mm8)
def _segment_views(buf: torch.Tensor, plan) -> tuple[list[torch.Tensor], list[int]]:
    """One [blocks, 1, nbytes] view per segment of the plan over the backing buffer, and its offset in the
    object: what the connector's seal reads a block through (it merges evenly spaced segments; the same bytes)."""
    flat, base = buf.view(torch.int8), buf.data_ptr()
    views, offsets, at = [], [], 0
    for seg in plan.segments:
        views.append(flat.as_strided((plan.num_blocks, 1, seg.nbytes), (seg.block_stride, seg.nbytes, 1),
                                     seg.base - base))
        offsets.append(at)
        at += seg.nbytes
    return views, offsets


def _mm8_material(num_chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (tagkernel.CHUNK, tagkernel.LANES), generator=g, dtype=torch.int8)
    u = torch.randint(-2**63, 2**63 - 1, (num_chunks, tagkernel.LANES), generator=g, dtype=torch.int64)
    return a, u


def _mm8_definition(obj: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """T of one object (host, int64 arithmetic, which wraps: mod 2**64): the definition in
    kvledger_connector/shape/integrity.py."""
    n = u.shape[0]
    b = torch.zeros(n * tagkernel.CHUNK, dtype=torch.int64)
    b[:obj.numel()] = obj.view(torch.int8).to(torch.int64)
    h = b.view(n, tagkernel.CHUNK) @ a.to(torch.int64)  # exact: |h| < 2**23
    return (h * u).sum(dim=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['layout']}-{c['dtype']}-k{c['kernel']}-"
                                                       f"{'mla' if c['mla'] else 'mha'}-L{c['layers']}")
def test_the_mm8_tag_on_the_device_is_its_definition(case: dict) -> None:
    buf, views = _build(case)
    nb = case["num_blocks"]
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(nb)))
    plan = kvlayout.plan_block_copies(views, layout=case["layout"], block_size=case["block_size"], num_blocks=nb)
    chunks = -(-plan.block_bytes // tagkernel.CHUNK)
    a, u = _mm8_material(chunks, seed=len(plan.segments))
    seg_views, offsets = _segment_views(buf, plan)
    ids = list(range(1, nb))
    few = tagkernel.mm8_digests_few(seg_views, ids, a.to(DEVICE), u.to(DEVICE),
                                    chunks * tagkernel.CHUNK - plan.block_bytes).cpu()
    rows = torch.zeros((len(ids), chunks * tagkernel.CHUNK), dtype=torch.int8, device=DEVICE)
    tagkernel.gather_rows(seg_views, offsets, ids, rows)
    gathered = tagkernel.mm8_digests(rows, a.to(DEVICE), u.to(DEVICE)).cpu()
    base = buf.data_ptr()
    for i, m in enumerate(ids):
        ptrs, sizes = plan.buffers(m)
        obj = torch.cat([buf[p - base:p - base + n] for p, n in zip(ptrs, sizes)]).cpu()
        want = _mm8_definition(obj, a, u)
        assert torch.equal(few[i], want), f"block {m}: the one-call kernel"
        assert torch.equal(gathered[i], want), f"block {m}: gather + int8 matmul"


def test_the_mm8_tag_rate_on_the_device(capsys: pytest.CaptureFixture) -> None:
    """Prints, per realistic case (2 MiB blocks), the tag's GB/s on the device by each path and a
    device-to-host copy's of the same bytes; medians of 20 (of 3 on CPU, where it only proves the pack), nothing
    asserted."""
    import time
    reps = 20 if DEVICE == "cuda" else 3
    lines = []
    for case in [c for c in CASES if c["layers"] == 32]:
        buf, views = _build(case)
        nb = case["num_blocks"]
        plan = kvlayout.plan_block_copies(views, layout=case["layout"], block_size=case["block_size"],
                                          num_blocks=nb)
        chunks = -(-plan.block_bytes // tagkernel.CHUNK)
        a, u = (t.to(DEVICE) for t in _mm8_material(chunks, seed=1))
        seg_views, offsets = _segment_views(buf, plan)
        ids = list(range(1, nb))
        rows = torch.zeros((len(ids), chunks * tagkernel.CHUNK), dtype=torch.int8, device=DEVICE)
        host = torch.empty(rows.shape, dtype=torch.int8, pin_memory=DEVICE == "cuda")
        pad = chunks * tagkernel.CHUNK - plan.block_bytes
        ways = {"one call": lambda: tagkernel.mm8_digests_few(seg_views, ids, a, u, pad).cpu(),
                "gather+matmul": lambda: (tagkernel.gather_rows(seg_views, offsets, ids, rows),
                                          tagkernel.mm8_digests(rows, a, u).cpu()),
                "D2H copy": lambda: host.copy_(rows)}
        got = []
        for name, way in ways.items():
            way()
            ts = []
            for _ in range(reps):
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                way()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            got.append(f"{name} {len(ids) * plan.block_bytes / sorted(ts)[reps // 2] / 1e9:.1f}")
        lines.append(f"mm8 tag rate {case['layout']} ({len(ids)} x {plan.block_bytes >> 20} MiB, "
                     f"{len(plan.segments)} segments), GB/s: " + ", ".join(got))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
