"""conformance.witness: a hazard no config reaches fails the stage and names its invariant (real TLC on a
tiny counter, not the full stage); config rewriting; every CI invariant has a witness in tla/Witness.tla."""
import re
from pathlib import Path

from conformance import witness as wt

HERE = Path(__file__).parent / "tla"
TINY = {"TinyA": HERE / "WitnessTiny.cfg", "TinyB": HERE / "WitnessTiny.cfg"}


def test_unreached_hazard_fails_and_names_its_invariant(capsys, tmp_path):
    ws = [wt.Witness("Two", "TypeOK", "x reaches 2"),
          wt.Witness("Seven", "TypeOK", "x reaches 7"),
          wt.Witness("Inc", "StepsByOne", "x steps by one", step=True),
          wt.Witness("Jump", "StepsByOne", "x jumps by two", step=True)]
    code = wt.main(["--xmx", "256m", "--timeout", "120"], witnesses=ws, configs=TINY,
                   spec=HERE / "WitnessTiny.tla", cfg_dir=tmp_path)
    out = capsys.readouterr().out
    assert code == 1
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("Two ", "Seven ", "Inc ", "Jump "))}
    assert rows["Two"].split()[-3:-1] == ["TinyA", "3"]        # reached in the first config, 3 states
    assert rows["Inc"].split()[-3:-1] == ["TinyA", "2"]        # a step witness: Init and one step
    assert "NOT REACHED" in rows["Seven"] and "NOT REACHED" in rows["Jump"]
    assert "VACUOUS: TypeOK: no CI config reaches its hazard (x reaches 7); tried TinyA, TinyB" in out
    assert "VACUOUS: StepsByOne: no CI config reaches its hazard (x jumps by two)" in out
    assert "2/4 hazards reached" in out
    assert not list(tmp_path.iterdir())                        # generated configs are removed


def test_all_reached_exits_zero(capsys, tmp_path):
    ws = [wt.Witness("Two", "TypeOK", "x reaches 2"), wt.Witness("Inc", "StepsByOne", "x steps", step=True)]
    assert wt.main(["--xmx", "256m"], witnesses=ws, configs=TINY, spec=HERE / "WitnessTiny.tla",
                   cfg_dir=tmp_path) == 0


def test_invariant_without_witness_is_named():
    assert wt.unwitnessed(TINY, [wt.Witness("Two", "TypeOK", "x")]) == ["StepsByOne"]


def test_witness_cfg_keeps_the_model_and_replaces_the_checks():
    text = (wt.TLA / "MC_safety.cfg").read_text()
    assert {"NoPollution", "BoundedPins", "NoStaleEffect", "LifecycleConforms"} <= wt.checked_names(text)
    state = wt.witness_cfg(text, wt.Witness("S1", "NoPollution", "h"))
    step = wt.witness_cfg(text, wt.Witness("S4", "NoStaleEffect", "h", step=True))
    for cfg in (state, step):
        assert "NumBlocks = 1" in cfg and "SPECIFICATION Spec" in cfg and "VIEW View" in cfg
        assert "NoPollution" not in cfg and "LifecycleConforms" not in cfg and "\\*" not in cfg
    assert state.strip().endswith("INVARIANT NotWitness_S1")
    assert step.strip().endswith("PROPERTY NotWitness_S4")


def test_every_ci_invariant_has_a_witness_defined_in_the_module():
    cfgs = wt.ci_safety_configs()
    assert set(cfgs) >= {"MC_safety", "MC_lag", "MC_nonotice"}
    assert wt.unwitnessed(cfgs, wt.WITNESSES) == []
    for w in wt.WITNESSES:
        module = (wt.TLA / f"{w.spec}.tla").read_text()  # Witness.tla, or the model the witness belongs to
        assert re.search(rf"^Witness_{w.name} ==", module, re.M), w.name
        kind = r"\[\]\[~" if w.step else "~"
        assert re.search(rf"^NotWitness_{w.name} == {kind}Witness_{w.name}\b", module, re.M), w.name
        assert wt.order(w, cfgs), f"{w.name}: no CI config checks {w.guards}"
    stale = next(w for w in wt.WITNESSES if w.name == "StaleDmaRead")
    assert wt.order(stale, cfgs) == ["MC_nonotice"]
