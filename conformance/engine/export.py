"""Export TLC's view of the model for conformance testing.

Two products, both from the CI config of the model (`tla/MC_conformance.cfg`):

  graph       the full labelled state graph (`-dump dot,actionlabels`): every reachable state and
              every (state, action, successor) edge. Edge labels carry only the operator name, so the
              action's parameters are read from the successor's `lastAction` variable.
  behaviours  (a) random behaviours from `-simulate file=...,num=N -depth D -seed S` (one worker, so a
              seed gives byte-identical output), and (b) *covering* behaviours computed from the
              graph: paths from an initial state that together take every edge. Random simulation
              alone reaches few of the rare edges (store restart in the middle of a load, ...); the
              covering paths are still behaviours of the model, found by TLC, just chosen by us.

Compact JSON in `.tlc-out/` (see `write_export`):

  {"module", "cfg", "vars": [v...], "states": [[value per var]...], "init": [i...],
   "edges": [[src, dst, action]...], "behaviours": [{"origin": "simulate"|"cover", "states": [i...]}]}

A value is TLC's value made plain: sets -> sorted lists, sequences -> lists, records and functions
-> objects with string keys, model values -> strings.

The coverage line counts the graph's distinct (state, action) edges that the exported behaviours
take. With `lastAction` in the state, a (state, successor) pair names its action, so an edge is
identified by (src, dst).

    python -m conformance.engine.export [--cfg tla/MC_conformance.cfg] [--num 1000] [--depth 40] [--seed 1]
"""
from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from conformance.engine import tlc

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is conformance/engine/)
OUT = ROOT / ".tlc-out"


class ExportError(RuntimeError):
    """TLC did not produce what the export needs (bad exit code, missing or unparsable output)."""


# ------------------------------------------------------------------------------------ values
def plain(v: Any) -> Any:
    """A TLC value (as conformance.engine.tlc parses it) made plain JSON (see module doc)."""
    if isinstance(v, frozenset):
        return sorted((plain(x) for x in v), key=_sort_key)
    if isinstance(v, tuple):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {_key(plain(k)): plain(x) for k, x in v.items()}
    if isinstance(v, tlc.ModelValue):
        return str(v)
    return v


def _key(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _sort_key(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def parse_plain_value(text: str) -> Any:
    """`tlc.parse_value`, made plain JSON (see `plain`); bad syntax is an ExportError."""
    try:
        return plain(tlc.parse_value(text))
    except tlc.TLCValueError as e:
        raise ExportError(str(e)) from None


_INTERVAL = re.compile(r"(?<![\w.])(-?\d+)\.\.(-?\d+)(?![\w.])")


def _expand_intervals(text: str) -> str:
    """TLC prints a set of consecutive ints as `a..b`; write it as the set it is."""
    return _INTERVAL.sub(lambda m: "{" + ", ".join(str(i) for i in range(int(m.group(1)),
                                                                        int(m.group(2)) + 1)) + "}", text)


def parse_plain_state(text: str) -> dict[str, Any]:
    """`tlc.parse_state` after expanding `a..b` intervals, values made plain; bad syntax is an ExportError."""
    try:
        return {k: plain(v) for k, v in tlc.parse_state(_expand_intervals(text)).items()}
    except tlc.TLCValueError as e:
        raise ExportError(str(e)) from None


def run_tlc_ok(spec_dir: Path, module: str, cfg: str, *extra: str, xmx: str = "1g",
               timeout: float = 900) -> tlc.TLCResult:
    """TLC on one core, bounded heap; a verdict other than ok is an ExportError."""
    cfg_path = Path(cfg) if Path(cfg).is_absolute() else spec_dir / cfg
    res = tlc.run_tlc(spec_dir / f"{module}.tla", cfg_path, xmx=xmx, timeout=timeout,
                      extra_args=["-deadlock", *extra])
    if res.exit_code != 0:
        raise ExportError(f"TLC on {module}/{cfg} {' '.join(extra[:2])} exited {res.exit_code} "
                          f"({res.outcome}{': ' + res.violated if res.violated else ''})")
    return res


def _scratch(name: str) -> Path:
    """A fresh directory for one TLC run's output, unique to this call: two processes exporting the same
    config at once (a test run beside `make verify`) must not delete each other's files. Removed at exit."""
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=OUT))
    atexit.register(shutil.rmtree, work, True)
    return work


_CFG_KEYWORDS = {"SPECIFICATION", "INIT", "NEXT", "INVARIANT", "INVARIANTS", "PROPERTY", "PROPERTIES",
                 "CONSTRAINT", "CONSTRAINTS", "ACTION_CONSTRAINT", "ACTION_CONSTRAINTS", "VIEW", "SYMMETRY",
                 "CHECK_DEADLOCK", "ALIAS", "POSTCONDITION"}


def cfg_constants(path: Path) -> dict[str, Any]:
    """The `CONSTANTS name = value` assignments of a TLC config, values made plain (model values ->
    their names). The drivers take the model's bounds (MaxGen, PinCap, SubBatch, ...) from here."""
    consts: dict[str, Any] = {}
    in_consts = False
    for raw in Path(path).read_text().splitlines():
        line = raw.split("\\*", 1)[0].strip()
        if not line:
            continue
        word = line.split()[0]
        if word in ("CONSTANT", "CONSTANTS"):
            in_consts = True
            line = line[len(word):].strip()
            if not line:
                continue
        elif word in _CFG_KEYWORDS:
            in_consts = False
            continue
        if in_consts and "=" in line and "<-" not in line:
            name, _, value = line.partition("=")
            try:
                consts[name.strip()] = parse_plain_value(value.strip())
            except ExportError as e:
                raise ExportError(f"{Path(path).name}: constant {name.strip()}: {e}") from None
    return consts


# ------------------------------------------------------------------------------------ graph
_NODE = re.compile(r'^(-?\d+) \[label="((?:[^"\\]|\\.)*)"(.*)\];?$')
_EDGE = re.compile(r'^(-?\d+) -> (-?\d+)(?: \[label="((?:[^"\\]|\\.)*)"[^\]]*\])?;?$')


def _undot(label: str) -> str:
    return re.sub(r'\\(.)', lambda m: "\n" if m.group(1) == "n" else m.group(1), label)


@dataclass
class Graph:
    vars: list[str]
    states: list[list[Any]]
    init: list[int]
    edges: list[tuple[int, int, str]]
    index: dict[str, int] = field(default_factory=dict)  # canonical state -> position

    def state(self, i: int) -> dict[str, Any]:
        return dict(zip(self.vars, self.states[i]))

    def find(self, state: dict[str, Any]) -> int | None:
        return self.index.get(canon(state, self.vars))

    def out_edges(self) -> dict[int, list[tuple[int, str]]]:
        out: dict[int, list[tuple[int, str]]] = {}
        for s, d, a in self.edges:
            out.setdefault(s, []).append((d, a))
        return out


def canon(state: dict[str, Any], vars_: list[str]) -> str:
    return json.dumps([state[v] for v in vars_], sort_keys=True, separators=(",", ":"))


def parse_dot(path: Path) -> Graph:
    fp_to_i: dict[int, int] = {}
    states: list[dict[str, Any]] = []
    init: list[int] = []
    raw_edges: list[tuple[int, int, str]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        m = _EDGE.match(line)
        if m:
            raw_edges.append((int(m.group(1)), int(m.group(2)), m.group(3) or ""))
            continue
        m = _NODE.match(line)
        if m:
            fp = int(m.group(1))
            if fp in fp_to_i:
                continue
            fp_to_i[fp] = len(states)
            states.append(parse_plain_state(_undot(m.group(2))))
            if "style = filled" in m.group(3):
                init.append(fp_to_i[fp])
    if not states:
        raise ExportError(f"no states in TLC graph dump {path.name}")
    vars_ = sorted(states[0])
    seen: set[tuple[int, int, str]] = set()
    edges = []
    for s, d, label in raw_edges:
        # TLC labels an edge with the operator that fired, which for `\E x : A(x)` inside Next is
        # "Next"; the successor's lastAction names the real action.
        la = states[fp_to_i[d]].get("lastAction")
        a = la["name"] if isinstance(la, dict) and "name" in la else label
        e = (fp_to_i[s], fp_to_i[d], a)
        if e not in seen:
            seen.add(e)
            edges.append(e)
    g = Graph(vars_, [[st[v] for v in vars_] for st in states], init, edges)
    g.index = {canon(st, vars_): i for i, st in enumerate(states)}
    return g


def dump_graph(spec_dir: Path, module: str, cfg: str, xmx: str = "1g") -> tuple[Graph, tlc.TLCResult]:
    work = _scratch(f"graph-{module}-{Path(cfg).stem}")
    run = run_tlc_ok(spec_dir, module, cfg, "-dump", "dot,actionlabels", str(work / "graph.dot"), xmx=xmx)
    return parse_dot(work / "graph.dot"), run


# ------------------------------------------------------------------------------------ behaviours
_SIM_STATE = re.compile(r"^STATE_(\d+) ==\s*$", re.M)


def parse_sim_file(path: Path) -> list[dict[str, Any]]:
    parts = _SIM_STATE.split(path.read_text())[1:]
    states = sorted((int(n), body.split("\n=====")[0]) for n, body in zip(parts[0::2], parts[1::2]))
    return [parse_plain_state(body) for _, body in states]


def simulate(spec_dir: Path, module: str, cfg: str, graph: Graph, num: int, depth: int,
             seed: int, xmx: str = "1g") -> tuple[list[list[int]], tlc.TLCResult]:
    """`num` random behaviours of up to `depth` states, each mapped onto graph positions."""
    work = _scratch(f"sim-{module}-{Path(cfg).stem}")
    (work / "sim").mkdir()
    run = run_tlc_ok(spec_dir, module, cfg, "-simulate", f"file={work / 'sim' / 'b'},num={num}",
                     "-depth", str(depth), "-seed", str(seed), xmx=xmx)
    files = sorted((work / "sim").iterdir(), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)])
    behaviours = []
    for f in files:
        path = []
        for k, st in enumerate(parse_sim_file(f)):
            i = graph.find(st)
            if i is None:
                # TLC 2.15's -simulate does not stop at a CONSTRAINT the graph search respects: the
                # behaviour is cut before the first state outside the graph (never at Init)
                if k == 0:
                    raise ExportError(f"simulated initial state of {f.name} is not in the graph: {st}")
                break
            path.append(i)
        behaviours.append(path)
    return behaviours, run


def simulated_export(spec_dir: Path, module: str, cfg: str, num: int, depth: int, seed: int,
                     xmx: str = "1g", log=print) -> "Export":
    """Random behaviours of a config too big to dump: an Export whose graph holds only the states
    and steps the behaviours visit (so edge coverage means nothing here; replay works the same)."""
    consts = cfg_constants(Path(cfg) if Path(cfg).is_absolute() else spec_dir / cfg)
    work = _scratch(f"simonly-{module}-{Path(cfg).stem}")
    (work / "sim").mkdir()
    run = run_tlc_ok(spec_dir, module, cfg, "-simulate", f"file={work / 'sim' / 'b'},num={num}",
                     "-depth", str(depth), "-seed", str(seed), xmx=xmx)
    files = sorted((work / "sim").iterdir(), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)])
    states: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    behaviours: list[list[int]] = []
    vars_: list[str] = []
    for f in files:
        path = []
        for st in parse_sim_file(f):
            vars_ = vars_ or sorted(st)
            key = canon(st, vars_)
            if key not in index:
                index[key] = len(states)
                states.append(st)
            path.append(index[key])
        behaviours.append(path)
    if not behaviours:
        raise ExportError(f"TLC simulated no behaviour of {module}/{cfg}")
    edges = sorted({(b[k], b[k + 1], states[b[k + 1]]["lastAction"]["name"])
                    for b in behaviours for k in range(len(b) - 1)})
    g = Graph(vars_, [[st[v] for v in vars_] for st in states], sorted({b[0] for b in behaviours}), edges)
    g.index = index
    log(f"[export] simulate {module}/{Path(cfg).name} (no graph): {len(behaviours)} behaviours, depth <= {depth}, "
        f"seed {seed}, {len(states)} distinct states visited ({run.seconds:.1f}s)")
    return Export(module, cfg, g, [("simulate", b) for b in behaviours], consts)


def covering_paths(graph: Graph, max_len: int = 400) -> list[list[int]]:
    """Paths from an initial state that together take every reachable edge.

    Greedy: from an initial state, walk untaken edges; when the current state has none left, go on
    along a shortest path (through taken edges) to the nearest state that still has one, so a
    behaviour does not restart from Init for every rare edge. A path ends when nothing untaken is
    reachable from where it is or at max_len states (a replay failure stays short enough to read)."""
    out = graph.out_edges()
    succ = {s: sorted({d for d, _ in es}) for s, es in out.items()}
    # BFS tree from the initial states: parent pointers give a shortest prefix to any state.
    parent: dict[int, int | None] = {i: None for i in graph.init}
    q = deque(graph.init)
    while q:
        s = q.popleft()
        for d in succ.get(s, []):
            if d not in parent:
                parent[d] = s
                q.append(d)

    def prefix(s: int) -> list[int]:
        p: list[int] = []
        cur: int | None = s
        while cur is not None:
            p.append(cur)
            cur = parent[cur]
        return p[::-1]

    untaken: dict[int, list[int]] = {s: list(ds) for s, ds in succ.items() if s in parent and ds}

    def route(src: int, budget: int) -> list[int] | None:
        """States after src on a shortest path to a state with an untaken edge (None: none near)."""
        back: dict[int, int] = {src: src}
        frontier = [src]
        for _ in range(budget):
            nxt: list[int] = []
            for s in frontier:
                for d in succ.get(s, []):
                    if d in back:
                        continue
                    back[d] = s
                    if untaken.get(d):
                        path = [d]
                        while back[path[-1]] != src:
                            path.append(back[path[-1]])
                        return path[::-1]
                    nxt.append(d)
            if not nxt:
                return None
            frontier = nxt
        return None

    paths: list[list[int]] = []
    for s in sorted(untaken, key=lambda s: len(prefix(s))):
        while untaken.get(s):
            path = prefix(s)
            cur = s
            while len(path) < max_len:
                if not untaken.get(cur):
                    hop = route(cur, max_len - len(path) - 1)
                    if hop is None:
                        break
                    path += hop
                    cur = hop[-1]
                nxt = untaken[cur].pop()
                if not untaken[cur]:
                    del untaken[cur]
                path.append(nxt)
                cur = nxt
            paths.append(path)
    return paths


def edges_taken(behaviours: Iterable[list[int]]) -> set[tuple[int, int]]:
    return {(b[k], b[k + 1]) for b in behaviours for k in range(len(b) - 1)}


def coverage(graph: Graph, behaviours: Iterable[list[int]]) -> tuple[int, int]:
    """(distinct graph edges the behaviours take, distinct graph edges)."""
    all_edges = {(s, d) for s, d, _ in graph.edges}
    taken = edges_taken(behaviours)
    stray = taken - all_edges
    if stray:
        raise ExportError(f"behaviours take {len(stray)} steps that are not graph edges, e.g. {min(stray)}")
    return len(taken), len(all_edges)


# ------------------------------------------------------------------------------------ files
def write_export(path: Path, module: str, cfg: str, graph: Graph,
                 behaviours: list[tuple[str, list[int]]], consts: dict[str, Any] | None = None) -> None:
    doc = {"module": module, "cfg": cfg, "consts": consts or {}, "vars": graph.vars, "states": graph.states,
           "init": graph.init, "edges": graph.edges,
           "behaviours": [{"origin": o, "states": b} for o, b in behaviours]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")))


@dataclass
class Export:
    module: str
    cfg: str
    graph: Graph
    behaviours: list[tuple[str, list[int]]]
    consts: dict[str, Any] = field(default_factory=dict)  # the config's CONSTANTS

    def steps(self, b: list[int]) -> list[dict[str, Any]]:
        return [self.graph.state(i) for i in b]


def read_export(path: Path) -> Export:
    doc = json.loads(path.read_text())
    g = Graph(doc["vars"], doc["states"], doc["init"], [tuple(e) for e in doc["edges"]])
    g.index = {canon(g.state(i), g.vars): i for i in range(len(g.states))}
    return Export(doc["module"], doc["cfg"], g, [(b["origin"], b["states"]) for b in doc["behaviours"]],
                  doc.get("consts", {}))


def export(spec_dir: Path, module: str, cfg: str, num: int, depth: int, seed: int,
           out: Path | None = None, cover: bool = True, log=print) -> Export:
    """Graph + behaviours of one config, written to .tlc-out/<module>.<cfg>.json."""
    consts = cfg_constants(Path(cfg) if Path(cfg).is_absolute() else spec_dir / cfg)
    graph, grun = dump_graph(spec_dir, module, cfg)
    log(f"[export] graph {module}/{Path(cfg).name}: {len(graph.states)} states, {len(graph.edges)} edges "
        f"({grun.seconds:.1f}s)")
    sims, srun = simulate(spec_dir, module, cfg, graph, num, depth, seed)
    behaviours = [("simulate", b) for b in sims]
    sim_cov, total = coverage(graph, sims)
    log(f"[export] simulate: {len(sims)} behaviours, depth <= {depth}, seed {seed}: "
        f"{sim_cov}/{total} edges ({100 * sim_cov / max(total, 1):.1f}%) ({srun.seconds:.1f}s)")
    if cover:
        paths = covering_paths(graph)
        behaviours += [("cover", p) for p in paths]
        log(f"[export] covering paths: {len(paths)} behaviours")
    taken, total = coverage(graph, (b for _, b in behaviours))
    log(f"[export] coverage: {taken}/{total} distinct (state, action) edges taken by "
        f"{len(behaviours)} behaviours = {100 * taken / max(total, 1):.1f}%")
    path = out or OUT / f"{module}.{Path(cfg).stem}.json"
    write_export(path, module, cfg, graph, behaviours, consts)
    return Export(module, cfg, graph, behaviours, consts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec-dir", default="tla")
    ap.add_argument("--module", default="KVLedger")
    ap.add_argument("--cfg", default="MC_conformance.cfg")
    ap.add_argument("--num", type=int, default=1000)
    ap.add_argument("--depth", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-cover", action="store_true")
    a = ap.parse_args(argv)
    try:
        export(ROOT / a.spec_dir, a.module, Path(a.cfg).name, a.num, a.depth, a.seed, cover=not a.no_cover)
    except (ExportError, tlc.TLCSetupError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
