"""The rooms of `kvledger_connector/` import only downwards:

    config, metadata, ownfile, upstream_keys     the contracts: settings and the scheduler -> worker metadata
    shape/                                       key layouts and builders, engine facts, copy plans, integrity
    telemetry/                                   the one counter recorder, KV cache events, the trace file
    store/                                       the Mooncake client, its breaker and call wrapper, the master
    scheduler/  |  worker/                       the two sides, neither importing the other
    connector, plugin                            what vLLM loads

A room may import a room of a lower floor or itself; the contracts may import each other. The pure core
(`kvledger`) is below them all (tests/unit/test_layers.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvledger_connector"
FLOOR = {"config": 0, "metadata": 0, "ownfile": 0, "upstream_keys": 0, "shape": 1, "telemetry": 2, "store": 3,
         "scheduler": 4, "worker": 4, "connector": 5, "plugin": 5}


def _room(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_rooms(path: Path) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        mods: list[str] = []
        if isinstance(n, ast.Import):
            mods = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            mods = [n.module] if n.module != PKG.name else [f"{PKG.name}.{a.name}" for a in n.names]
        out += [(n.lineno, m.split(".")[1]) for m in mods if m.startswith(PKG.name + ".")]
    return out


def _files() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if p.name != "__init__.py" or p.parent != PKG]


def test_every_room_has_a_floor() -> None:
    rooms = {_room(p) for p in _files()}
    assert rooms - {"__init__"} <= set(FLOOR), sorted(rooms - set(FLOOR))


def test_no_room_imports_a_room_above_or_beside_it() -> None:
    bad = []
    for p in _files():
        me = _room(p)
        for line, other in _imported_rooms(p):
            ok = other == me or FLOOR[other] < FLOOR[me] or FLOOR[other] == FLOOR[me] == 0
            if not ok:
                bad.append(f"{p.relative_to(ROOT)}:{line} ({me}, floor {FLOOR[me]}) imports {other} "
                           f"(floor {FLOOR[other]})")
    assert bad == []


def test_the_sub_packages_faces_define_nothing() -> None:
    """A sub-package's __init__ only says what the room holds: importing a room runs none of its modules.
    config's, a contract every room and driver imports by the package's name, also hands on its modules'
    names: imports from its own modules and `__all__`, nothing defined."""
    for init in sorted(PKG.glob("*/__init__.py")):
        body = ast.parse(init.read_text()).body
        assert len(body) >= 1 and isinstance(body[0], ast.Expr), init
        if init.parent.name != "config":
            assert len(body) == 1, init
            continue
        for n in body[1:]:
            handed_on = isinstance(n, ast.ImportFrom) and n.level == 0 and n.module is not None and (
                n.module.startswith(f"{PKG.name}.config.") or n.module == f"{PKG.name}.upstream_keys")
            names = isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["__all__"]
            assert handed_on or names, f"{init.relative_to(ROOT)}:{n.lineno} defines or runs something"
