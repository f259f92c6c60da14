"""The GPU check (runs from the packed folder on a CUDA machine: torch, pytest; no vLLM, no Mooncake).

Caches are built on the device with exactly the geometry vLLM 0.32's allocator gives (geometry.json,
recorded with vLLM by `scripts/gpu-check.sh pack`): one uint8 backing buffer, per layer a view with the
allocator's dtype, shape, strides and offset. The connector's copy plan (kvlayout.py, the project's own
module) must address exactly each block's bytes, in the layout's order, on device memory; and a read
ordered after the forward by a CUDA event (as the worker's store thread does) sees the forward's writes.
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
import kvlayout  # noqa: E402  (kvledger_connector/kvlayout.py, copied by the pack)

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
