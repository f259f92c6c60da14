"""GPU variant of replay and fuzz: the KV rows live in CUDA memory, the DMA read is an async device-to-
host copy completed by a CUDA event, loads land in CUDA rows through the real Mooncake client.
Marker `gpu`: skipped without CUDA (this CPU machine has none)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.engine import export as ex
from conformance.engine import replay as rp
from conformance.engine.fuzz import oracle_machine
from conformance.kvdriver import KVDriver

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
CFG = Path(__file__).parent / "kv" / "MC_replay_tiny.cfg"


@pytest.fixture(scope="module")
def kv_export(tmp_path_factory) -> ex.Export:
    return ex.export(ROOT / "tla", "KVLedger", str(CFG), num=200, depth=40, seed=1,
                     out=tmp_path_factory.mktemp("gpu") / "kv.json", log=print)


def test_replay_on_cuda_kv(kv_export: ex.Export, mooncake_backend) -> None:
    drv = KVDriver(mooncake_backend, kv_export.consts, device="cuda")
    rep = rp.replay_export(kv_export, drv, stop_after=3)
    print(rep.line())
    assert rep.ok and rep.behaviours == len(kv_export.behaviours), "\n".join(map(str, rep.divergences))
    assert drv.kv.is_cuda


def test_fuzz_on_cuda_kv(kv_export: ex.Export, mooncake_backend) -> None:
    machine = oracle_machine(kv_export, lambda: KVDriver(mooncake_backend, kv_export.consts, device="cuda"))
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=40))
