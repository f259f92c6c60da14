"""Every runtime mutant (monkeypatched, never edited into the source) is killed by replaying TLC's
behaviours of the two small KVLedger configs (store faults; unannounced preemption), and the
unmutated runtime conforms (checked inside kill_table before any mutant runs)."""
from __future__ import annotations

from pathlib import Path

from conformance import export as ex
from conformance import mutants

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutant_killed(tmp_path: Path) -> None:
    exps = [ex.export(ROOT / "tla", "KVLedger", str(c), num=100, depth=40, seed=1,
                      out=tmp_path / f"{c.stem}.json", log=lambda _: None) for c in mutants.DEFAULT_CFGS]
    lines: list[str] = []
    res = mutants.kill_table(exps, log=lines.append)
    assert len(res) >= 6
    assert all(res.values()), "\n".join(lines)
    assert lines[-1] == f"[mutants] {len(res)}/{len(res)} killed"
