"""The packages form layers, each importing only those below it:

    kvledger  <  kvledger_connector  <  testbed  <  conformance, bench, tests

`kvledger_connector/` is what vLLM loads: no driver, test double or checker may ship in it, and nothing imports
upward (a layer above is run as a program, e.g. the demo runs `python -m conformance.runlog`)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABOVE = {
    "kvledger": {"kvledger_connector", "testbed", "conformance", "bench", "tests", "spec"},
    "kvledger_connector": {"connector", "testbed", "conformance", "bench", "tests"},
    "testbed": {"conformance", "bench", "tests"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out.append((n.lineno, n.module))
    return out


def test_no_package_imports_a_layer_above_it() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for pkg, above in ABOVE.items() for p in sorted((ROOT / pkg).rglob("*.py"))
           for line, mod in _imports(p) if mod.split(".")[0] in above]
    assert bad == []


def test_connector_ships_no_driver_or_test_double() -> None:
    names = {p.stem for p in (ROOT / "kvledger_connector").rglob("*.py")}
    assert not names & {"faults", "demo", "harness", "emu_worker"}, names


def test_old_module_path_is_only_a_shim() -> None:
    # `connector.connector` (the module path configs used before the rename) re-exports, nothing more.
    shim = ROOT / "connector"
    assert sorted(p.name for p in shim.glob("*.py")) == ["__init__.py", "connector.py"]
    assert [m for _, m in _imports(shim / "connector.py")] == ["kvledger_connector.connector"]
