"""Replay of TLC behaviours of tla/KVLedger.tla (fixed design, the small config
tests/conformance/kv/MC_replay_tiny.cfg) against the real parts: kvledger's ledgers, vLLM's
BlockPool, a torch KV tensor and a real Mooncake master on 127.0.0.1 (started here, stopped by pid).
Every exported behaviour (seeded simulation + paths covering every graph edge) must conform; a
runtime mutant (applied by monkeypatching) must diverge."""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.engine import export as ex
from conformance.engine import replay as rp
from conformance.kvdriver import KVDriver, MooncakeBackend

ROOT = Path(__file__).resolve().parents[2]
CFG = Path(__file__).parent / "kv" / "MC_replay_tiny.cfg"


@pytest.fixture(scope="module")
def kv_export(tmp_path_factory) -> ex.Export:
    out = tmp_path_factory.mktemp("kv") / "kv.json"
    return ex.export(ROOT / "tla", "KVLedger", str(CFG), num=400, depth=40, seed=1, out=out, log=print)


def driver(backend, exp: ex.Export) -> KVDriver:
    return KVDriver(backend, exp.consts)  # MaxGen, PinCap, SubBatch, ... of the config


def test_export_covers_the_graph(kv_export: ex.Export) -> None:
    taken, total = ex.coverage(kv_export.graph, (b for _, b in kv_export.behaviours))
    assert total > 1000 and taken == total  # the covering paths take every edge
    assert len(kv_export.behaviours) >= 1000


def test_every_behaviour_conforms_on_mooncake(kv_export: ex.Export, mooncake_backend) -> None:
    rep = rp.replay_export(kv_export, driver(mooncake_backend, kv_export), stop_after=3)
    print(rep.line())
    assert rep.ok, "\n".join(str(d) for d in rep.divergences)
    assert rep.behaviours == len(kv_export.behaviours)
