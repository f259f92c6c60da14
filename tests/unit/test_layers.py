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


#: the most lines a module of `kvledger_connector/` may have: past it, a module holds several subjects
MAX_MODULE_LINES = 600


def test_no_connector_module_is_over_the_size_limit() -> None:
    big = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "kvledger_connector").rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"modules over {MAX_MODULE_LINES} lines: {big}"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_the_connectors_modules_import_each_other_in_no_circle() -> None:
    """Module-level imports between the modules of `kvledger`, `kvledger_connector` (a TYPE_CHECKING import
    is no edge: it never runs) form no cycle."""
    files = {_module(p): p for pkg in ("kvledger", "kvledger_connector") for p in (ROOT / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for m, p in files.items():
        tree = ast.parse(p.read_text(), filename=str(p))
        for n in tree.body:  # module level only; `if TYPE_CHECKING:` blocks are skipped
            names = ([a.name for a in n.names] if isinstance(n, ast.Import)
                     else [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module else [])
            if isinstance(n, ast.ImportFrom) and n.module:
                names += [f"{n.module}.{a.name}" for a in n.names]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != m and not m.startswith(name + ".") and name != m.rpartition(".")[0]:
                    edges[m].add(name)
    seen: dict[str, int] = {}  # 1 on the path, 2 done

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        seen[m] = 1
        for t in sorted(edges[m]):
            if seen.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in seen and (c := cycle_from(t, path + [t])) is not None:
                return c
        seen[m] = 2
        return None
    cycles = [c for m in sorted(files) if m not in seen and (c := cycle_from(m, [m])) is not None]
    assert cycles == [], f"import circles: {cycles}"
