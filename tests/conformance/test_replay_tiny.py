"""The replay machinery on the tiny spec: TLC's behaviours replayed against kvledger on vLLM's real
BlockPool conform; a broken ledger (injected by monkeypatching, never by editing the source)
yields a divergence report naming behaviour, step, action and the differing field."""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.engine import export as ex
from conformance.engine import replay as rp
from vllm.v1.core.block_pool import BlockPool

from tiny_driver import TinyPinDriver  # tests/conformance is on sys.path (rootdir mode)

TINY = Path(__file__).parent / "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ex.Export:
    out = tmp_path_factory.mktemp("export") / "tiny.json"
    return ex.export(TINY, "TinyPin", "MC_tiny.cfg", num=100, depth=14, seed=1, out=out, log=lambda _: None)


def test_every_behaviour_conforms(tiny: ex.Export) -> None:
    rep = rp.replay_export(tiny, TinyPinDriver(), stop_after=None)
    assert rep.behaviours == len(tiny.behaviours) and rep.behaviours > 100
    assert rep.ok, "\n".join(str(d) for d in rep.divergences[:3])
    assert rep.conforming == rep.behaviours


def test_no_pin_diverges_on_refcount(tiny: ex.Export, monkeypatch) -> None:
    # MUTANT: EmitStore pins nothing
    monkeypatch.setattr(BlockPool, "touch", lambda self, blocks: None)
    rep = rp.replay_export(tiny, TinyPinDriver(), stop_after=1)
    assert not rep.ok
    d = rep.divergences[0]
    assert d.action.startswith("EmitStore(") and "block_ref" in d.fields
    assert d.fields["block_ref"] == (2, 1)
