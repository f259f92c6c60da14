"""Every runtime mutant in the table (monkeypatched, never edited into the source) is killed by a named
check of the fast stages: a probe (the connector's step functions; its copy plans, keys, reset pattern,
runtime dir) or replay on Mooncake of TLC's behaviours of the small KVLedger configs (store faults;
unannounced preemption; two ranks at the pin cap). The unmutated runtime passes every probe and conforms
(checked inside kill_table before any mutant runs). A mutant that only crashes is reported as a crash,
never as killed."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conformance import mutants
from conformance.engine import export as ex
from kvledger_connector.worker.saves import SaveSteps

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> ex.Export:
    """The first 60 behaviours of the tiny config: enough to Receive, store, load and fail."""
    out = tmp_path_factory.mktemp("mutants") / "tiny.json"
    e = ex.export(ROOT / "tla", "KVLedger", str(mutants.DEFAULT_CFG), num=60, depth=20, seed=1, out=out,
                  log=lambda _: None)
    return dataclasses.replace(e, behaviours=e.behaviours[:60])


def test_every_mutant_killed(tmp_path: Path, mooncake_backend) -> None:
    exps = [ex.export(ROOT / "tla", "KVLedger", str(c), num=100, depth=40, seed=1,
                      out=tmp_path / f"{c.stem}.json", log=lambda _: None) for c in mutants.DEFAULT_CFGS]
    lines: list[str] = []
    res = mutants.kill_table(exps, log=lines.append, backend=mooncake_backend)
    assert set(res) == set(mutants.MUTANTS) and len(res) >= 36
    survivors = [n for n, killed in res.items() if not killed]
    assert survivors == [] and res.crashed == [] and res.unshown == [] and res.ok, "\n".join(lines)
    assert lines[-1].startswith(f"[mutants] {len(res)}/{len(res)} killed, 0 crashed")
    assert all(r.seconds < 60 for r in res.rows.values()), "\n".join(lines)
    # the weak places of the data path and the orchestration each have their own mutant
    for name in ("put_partial_batch_ok", "get_short_read_loaded", "cow_tail_unpinned", "rank_reports_overwritten",
                 "reports_counted_twice", "pin_cap_admits_one_over", "pin_block_cap_one_short",
                 "register_generation_dropped", "load_ids_not_rotated", "save_report_skipped_on_exception",
                 "load_unfinished_on_exception", "no_load_pin", "failing_subbatch_unreported"):
        assert name in res
    # no_load_pin's kill shows the hazard it creates: an aborted request's blocks free under its load
    assert "S9 LoadsPinned" in res.rows["no_load_pin"].by  # type: ignore[operator]


def test_a_surviving_mutant_is_reported(small_export: ex.Export, mooncake_backend, monkeypatch) -> None:
    """The table tells a survivor apart: a "mutant" that changes nothing survives every probe and replay,
    and its shows-probe sees no change."""
    monkeypatch.setattr(mutants, "MUTANTS", {"identity": [(SaveSteps, "receive", lambda f: f)]})
    lines: list[str] = []
    res = mutants.kill_table([small_export], log=lines.append, backend=mooncake_backend)
    assert res == {"identity": False} and not res.ok
    assert "NO" in lines[1] and "survived every probe" in lines[1]


def test_a_crash_is_no_kill(small_export: ex.Export, mooncake_backend, monkeypatch) -> None:
    """A patch that merely breaks the code (an attribute it renamed: every Receive raises AttributeError)
    is a crash, in its own column, not a kill; the replay goes on looking for a named check."""
    def renamed(orig):
        def receive(self, req_id, job_id, generation):
            return self.no_such_ledger.register(req_id, job_id, generation)
        return receive
    monkeypatch.setattr(mutants, "MUTANTS", {"crashes": [(SaveSteps, "receive", renamed)]})
    lines: list[str] = []
    res = mutants.kill_table([small_export], log=lines.append, backend=mooncake_backend, probes=False)
    assert res == {"crashes": False} and res.crashed == ["crashes"] and not res.ok
    row = res.rows["crashes"]
    assert row.by is None and "AttributeError" in (row.crash or "") and "no_such_ledger" in (row.crash or "")
    assert any(line.startswith("  crash crashes: replay MC_replay_tiny") for line in lines), "\n".join(lines)
    assert "1 crashed without a kill" in lines[-1]


def test_a_patch_whose_target_is_gone_is_a_crash(small_export: ex.Export, mooncake_backend, monkeypatch) -> None:
    monkeypatch.setattr(mutants, "MUTANTS", {"gone": [(SaveSteps, "no_such_step", lambda f: f)]})
    res = mutants.kill_table([small_export], log=lambda _: None, backend=mooncake_backend)
    assert res.crashed == ["gone"] and "patch: KeyError" in (res.rows["gone"].crash or "")
