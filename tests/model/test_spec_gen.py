"""spec/gen.py: tla/JobLifecycle.tla is generated from spec/machines.json and must not drift."""
import json
import subprocess
import sys

from spec import gen


def test_committed_lifecycle_module_is_fresh():
    p = subprocess.run([sys.executable, "-m", "spec.gen", "--check"], cwd=gen.REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_check_fails_with_one_clear_line_when_stale(tmp_path):
    data = json.loads(gen.MACHINES.read_text())
    data["machines"]["StoreJob"]["transitions"].append(
        {"trigger": "Report", "source": "running", "dest": "reported"})
    m = tmp_path / "machines.json"
    m.write_text(json.dumps(data))
    out = tmp_path / "JobLifecycle.tla"
    out.write_text(gen.OUT.read_text())  # the committed module, now stale
    assert gen.main(["--check", "--machines", str(m), "--out", str(out)]) == 1
    assert gen.main(["--machines", str(m), "--out", str(out)]) == 0
    assert '<<"running", "reported", "Report">>' in out.read_text()
    assert gen.main(["--check", "--machines", str(m), "--out", str(out)]) == 0


def test_every_transition_becomes_a_triple():
    machines = gen.load_machines()
    text = gen.render(machines)
    for name, m in machines.items():
        for t in m["transitions"]:
            for s in (t["source"] if isinstance(t["source"], list) else [t["source"]]):
                assert f'<<"{s}", "{t["dest"]}", "{t["trigger"]}">>' in text


def test_unknown_state_is_rejected(tmp_path):
    data = json.loads(gen.MACHINES.read_text())
    data["machines"]["StoreJob"]["transitions"].append({"trigger": "Put", "source": "running", "dest": "nowhere"})
    m = tmp_path / "machines.json"
    m.write_text(json.dumps(data))
    assert gen.main(["--machines", str(m), "--out", str(tmp_path / "x.tla")]) == 2
    assert not (tmp_path / "x.tla").exists()
