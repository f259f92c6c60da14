"""Every runtime mutant in the table (monkeypatched, never edited into the source) is killed by the fast
stages: a probe of the connector's step functions or replay of TLC's behaviours of the small KVLedger
configs (store faults; unannounced preemption; two ranks at the pin cap). The unmutated runtime passes
every probe and conforms (checked inside kill_table before any mutant runs)."""
from __future__ import annotations

from pathlib import Path

from conformance.engine import export as ex
from conformance import mutants

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutant_killed(tmp_path: Path) -> None:
    exps = [ex.export(ROOT / "tla", "KVLedger", str(c), num=100, depth=40, seed=1,
                      out=tmp_path / f"{c.stem}.json", log=lambda _: None) for c in mutants.DEFAULT_CFGS]
    lines: list[str] = []
    res = mutants.kill_table(exps, log=lines.append)
    assert set(res) == set(mutants.MUTANTS) and len(res) >= 20
    survivors = [n for n, killed in res.items() if not killed]
    assert survivors == [], "\n".join(lines)
    assert lines[-1].startswith(f"[mutants] {len(res)}/{len(res)} killed")
    # the weak places of the data path and the orchestration each have their own mutant
    for name in ("put_partial_batch_ok", "get_short_read_loaded", "cow_tail_unpinned", "rank_reports_overwritten",
                 "reports_counted_twice", "pin_cap_admits_one_over", "pin_block_cap_one_short",
                 "register_generation_dropped", "load_ids_not_rotated", "save_report_skipped_on_exception",
                 "load_unfinished_on_exception"):
        assert name in res


def test_a_surviving_mutant_is_reported(tmp_path: Path, monkeypatch) -> None:
    """The table tells a survivor apart: a "mutant" that changes nothing survives every probe and replay."""
    exp = ex.export(ROOT / "tla", "KVLedger", str(mutants.DEFAULT_CFG), num=5, depth=20, seed=1,
                    out=tmp_path / "tiny.json", log=lambda _: None)
    monkeypatch.setattr(mutants, "MUTANTS", {"identity": [(mutants.WorkerSteps, "receive", lambda f: f)]})
    lines: list[str] = []
    assert mutants.kill_table([exp], log=lines.append) == {"identity": False}
    assert "NO" in lines[1] and "survived every probe" in lines[1]
