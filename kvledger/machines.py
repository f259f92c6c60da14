"""The lifecycle machines StoreJob and StoreRequest, built at import from ``spec/machines.json``.

Two forms of one definition:

* :func:`build_machine` builds a ``transitions`` :class:`~transitions.Machine` (the *definition*: readable,
  drawable, the same data the TLA+ generator reads). A trigger with several possible destinations (``DmaRead``
  from ``queued`` goes to ``running``, ``stale``, ``skipped`` or ``failed``) is disambiguated by the
  destination the caller asks for, passed as ``dest=...``: a condition per transition checks it.
* :data:`TABLES` holds, per machine, a compiled dict ``(state, trigger) -> frozenset(dests)``. The ledgers'
  hot paths use it (:func:`step`): a dict lookup costs ~0.1 µs, a ``transitions`` trigger ~21 µs, which
  alone would be 3-4x the whole per-job budget of the scheduler step. ``tests/unit/test_machines.py`` proves
  the two forms equivalent over every (state, trigger, dest) triple.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from transitions import Machine, MachineError

from .errors import LedgerInvariantError

#: ``spec/machines.json``, found relative to this package (no machine paths): an installed wheel ships it as
#: ``kvledger/spec/machines.json`` (pyproject.toml), a checkout has it next to the package.
_PACKAGED_SPEC = Path(__file__).resolve().parent / "spec" / "machines.json"
SPEC_PATH = _PACKAGED_SPEC if _PACKAGED_SPEC.is_file() else Path(__file__).resolve().parent.parent / "spec" / "machines.json"


@dataclass(frozen=True)
class MachineSpec:
    name: str
    initial: str
    final: tuple[str, ...]
    states: tuple[str, ...]
    #: (trigger, source, dest, when), sources expanded
    transitions: tuple[tuple[str, str, str, str], ...]
    triggers: tuple[str, ...]


def load_specs(path: Path = SPEC_PATH) -> dict[str, MachineSpec]:
    """Parse ``machines.json``; reject a transition naming an unknown state."""
    raw = json.loads(Path(path).read_text())
    out: dict[str, MachineSpec] = {}
    for name, m in raw["machines"].items():
        states = tuple(m["states"])
        rows: list[tuple[str, str, str, str]] = []
        for t in m["transitions"]:
            sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
            for s in sources:
                for st in (s, t["dest"]):
                    if st not in states:
                        raise ValueError(f"{path}: machine {name}: transition {t['trigger']} names "
                                         f"unknown state {st!r}")
                rows.append((t["trigger"], s, t["dest"], t.get("when", "")))
        triggers = tuple(dict.fromkeys(r[0] for r in rows))
        out[name] = MachineSpec(name, m["initial"], tuple(m.get("final", ())), states, tuple(rows), triggers)
    return out


def compile_table(spec: MachineSpec) -> dict[tuple[str, str], frozenset[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for trigger, source, dest, _ in spec.transitions:
        table.setdefault((source, trigger), set()).add(dest)
    return {k: frozenset(v) for k, v in table.items()}


class _Model:
    """The object a definition machine drives (its ``state`` attribute)."""

    state: str


def _dest_is(dest: str):
    def cond(event: Any) -> bool:
        return event.kwargs.get("dest") == dest

    cond.__name__ = f"dest_is_{dest}"
    return cond


def build_machine(spec: MachineSpec, initial: str | None = None) -> tuple[Machine, _Model]:
    """A ``transitions`` machine for ``spec`` (no auto transitions), and its model. Fire a trigger with
    ``model.trigger(trigger, dest=...)``; it raises :class:`transitions.MachineError` when no transition
    from the current state has that trigger, and returns False when the asked ``dest`` is not allowed."""
    model = _Model()
    machine = Machine(
        model=model,
        states=list(spec.states),
        initial=initial or spec.initial,
        auto_transitions=False,
        send_event=True,
        transitions=[
            {"trigger": trig, "source": src, "dest": dst, "conditions": [_dest_is(dst)]}
            for trig, src, dst, _ in spec.transitions
        ],
    )
    return machine, model


def fire_definition(spec: MachineSpec, state: str, trigger: str, dest: str) -> str | None:
    """Run one trigger on a fresh definition machine in ``state``: the resulting state, or None when the
    definition refuses it. (For tests and tools; ~25 µs.)"""
    _, model = build_machine(spec, initial=state)
    try:
        ok = model.trigger(trigger, dest=dest)
    except MachineError:
        return None
    return model.state if ok else None


SPECS: dict[str, MachineSpec] = load_specs()
TABLES: dict[str, Mapping[tuple[str, str], frozenset[str]]] = {n: compile_table(s) for n, s in SPECS.items()}
STORE_JOB = TABLES["StoreJob"]
STORE_REQUEST = TABLES["StoreRequest"]
#: The same tables flattened to allowed (state, trigger, dest) triples: the hot path's membership test
#: (``(state, trigger, dest) in STORE_JOB_ALLOWED``), with :func:`step` raising on the error path.
STORE_JOB_ALLOWED = frozenset((s, t, d) for (s, t), ds in STORE_JOB.items() for d in ds)
STORE_REQUEST_ALLOWED = frozenset((s, t, d) for (s, t), ds in STORE_REQUEST.items() for d in ds)


def step(table: Mapping[tuple[str, str], frozenset[str]], machine: str, state: str, trigger: str,
         dest: str, subject: object) -> str:
    """The hot-path transition: ``dest`` if the machine allows ``trigger`` from ``state`` to ``dest``,
    else a :class:`LedgerInvariantError` naming the machine and the subject (job id or req_id)."""
    dests = table.get((state, trigger))
    if dests is None or dest not in dests:
        raise LedgerInvariantError(
            machine, f"{machine} lifecycle",
            f"{subject}: {trigger} from {state!r} to {dest!r} is not a transition of spec/machines.json "
            f"(allowed: {sorted(dests) if dests else 'none'})")
    return dest
