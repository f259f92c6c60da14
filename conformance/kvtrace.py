"""Trace validation of kvledger's NDJSON logs against tla/KVLedger.tla (via tla/TraceKVLedger.tla).

A log is what the runtime writes through `kvledger.trace` (schema in that module): the ledgers' own
events (EmitStore, Collect, EmitLoad, CollectLoad, Receive, DropGeneration, DmaRead, Put, Report, Load,
HandleLoadErrors) plus, in a log of the conformance driver, what vLLM's Scheduler and the store did
(Admit, Compute, Preempt, Finish, Lookup, HandleLoadErrors, Evict, StoreFail, StoreRestart).
`normalize` turns each event into the model's vocabulary:

    runtime                                   model (TraceKVLedger's event record)
    EmitStore blocks (all pinned ids), tail   blocks, tail (when logged: the job's partial tail block)
    actor "w<i>"                              w = the i-th rank of the config (sorted)
    offset (tokens)                           off = offset // the driver's block size (chunks)
    req_id                                    r (ids not in the config: the k-th new id -> k-th request)
    job ids                                   renumbered 1.. in order of first appearance (monotonic)
    generation / notice_generation            g
    DmaRead dest                              outcome (running | stale | skipped | failed)
    Put dest stored                           outcome ok
    Put dest failed, pressure true / false    outcome pressure / fail
    Collect completed {job: n}                reported <<job, n>>...; ranks_left -> left
    DropGeneration finished true / false      kind finish / preempt
    worker HandleLoadErrors (take_errors)     dropped: the failed blocks are in each Load event
    CollectLoad completed {req_id: n}         r (one request per event: the driver collects one load at a
                                              time), blocks = the released load's pinned blocks

The model constants come from a TLC config (default `tla/MC_conformance_sim.cfg`); requests, ranks and
the other model values become strings in the generated trace config.

    python -m conformance.kvtrace LOG.ndjson [...] [--cfg tla/MC_conformance.cfg]
    python -m conformance.kvtrace --record N [--cfg ...]   (replay N simulated behaviours with
                                                           the ledgers logging, then check the logs)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from conformance.engine import export as ex
from conformance.engine import tracecheck as tc
from conformance.kvdriver import BS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CFG = ROOT / "tla" / "MC_conformance_sim.cfg"
LOG_DIR = ROOT / ".tlc-out" / "traces"


def trace_cfg(consts: dict[str, Any]) -> str:
    """TraceKVLedger's config: the model's constants, model values as strings."""
    lines = ["CONSTANTS"] + [f"    {k} = {tc.to_tla_const(v)}" for k, v in consts.items()]
    lines += ["SPECIFICATION TraceSpec", "INVARIANT NotFullyMatched", "CONSTRAINT Furthest", ""]
    return "\n".join(lines)


class Normalizer:
    """Runtime events -> TraceKVLedger event records (see the module doc). Stateful: ids are
    mapped in order of first appearance."""

    def __init__(self, consts: dict[str, Any], block_size: int = BS) -> None:
        self.block_size = block_size  # the ledgers log offsets in tokens; a model chunk is one block
        self.ranks = sorted(consts["Ranks"])
        self.reqs = sorted(consts["Req"])
        self.req_map: dict[str, str] = {}
        self.job_map: dict[Any, int] = {}
        self.load_blocks: dict[str, list[int]] = {}  # req_id -> blocks of its pinned load (EmitLoad)

    def r(self, req_id: Any) -> str:
        if req_id not in self.req_map:
            if req_id in self.reqs:
                self.req_map[req_id] = req_id
            else:
                free = [r for r in self.reqs if r not in self.req_map.values()]
                if not free:
                    raise tc.TraceCheckError(f"request {req_id!r}: more requests than the config's "
                                             f"Req {self.reqs}")
                self.req_map[req_id] = free[0]
        return self.req_map[req_id]

    def j(self, job: Any) -> int:
        if job not in self.job_map:
            self.job_map[job] = len(self.job_map) + 1
        return self.job_map[job]

    def w(self, actor: str) -> str:
        try:
            return self.ranks[int(actor[1:])]
        except (ValueError, IndexError):
            raise tc.TraceCheckError(f"actor {actor!r} is no rank of the config ({self.ranks})") from None

    def __call__(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        a, actor = ev["action"], ev.get("actor", "")
        try:
            return self._map(a, actor, ev)
        except KeyError as e:
            raise tc.TraceCheckError(f"event seq {ev.get('seq')} ({a}) lacks the field {e}") from None

    def _map(self, a: str, actor: str, ev: dict[str, Any]) -> dict[str, Any] | None:
        if a == "ReleaseHeld":
            return None  # TraceKVLedger matches ReleaseHeld with the connector's Finish event of the step
        if a in ("Admit", "Preempt", "Finish"):
            return {"action": a, "r": self.r(ev["req_id"]), "g": ev["generation"]}
        if a == "Compute":
            return {"action": a, "r": self.r(ev["req_id"]), "c": ev["chunk"], "b": ev["block"]}
        if a == "Lookup":
            return {"action": a, "r": self.r(ev["req_id"]), "hits": ev["hits"]}
        if a == "EmitLoad":
            self.load_blocks[ev["req_id"]] = list(ev["blocks"])
            return {"action": a, "r": self.r(ev["req_id"]), "blocks": list(ev["blocks"])}
        if a == "CollectLoad":
            if len(ev["completed"]) != 1 or list(ev["completed"]) != list(ev["released"]):
                raise tc.TraceCheckError(f"event seq {ev.get('seq')}: CollectLoad must release exactly "
                                         f"the one load it reports (got {ev['completed']}, {ev['released']})")
            (req_id,) = ev["completed"]
            return {"action": a, "r": self.r(req_id), "blocks": self.load_blocks.pop(req_id, [])}
        if a == "HandleLoadErrors":
            if actor != "sched":
                return None  # a rank's take_errors: its failed blocks are checked in its Load event
            return {"action": a, "r": self.r(ev["req_id"]), "keep": ev["keep"]}
        if a == "EmitStore":
            rec = {"action": a, "r": self.r(ev["req_id"]), "job": self.j(ev["job"]),
                   "blocks": list(ev["blocks"]), "left": ev["ranks_left"], "pinned_jobs": ev["pinned_jobs"]}
            if "tail" in ev:  # the partial tail's ids, pinned after the blocks (older logs lack the field)
                rec["tail"] = list(ev["tail"])
            return rec
        if a == "Collect":
            completed = {int(k): v for k, v in ev["completed"].items()}
            return {"action": a, "released": [self.j(x) for x in ev["released"]],
                    "reported": [[self.j(k), n] for k, n in sorted(completed.items())],
                    "left": [[self.j(int(k)), n] for k, n in sorted(ev["ranks_left"].items())],
                    "pinned_jobs": ev["pinned_jobs"]}
        if a == "Receive":
            return {"action": a, "w": self.w(actor), "job": self.j(ev["job"]), "r": self.r(ev["req_id"]),
                    "g": ev["generation"], "live": [self.j(x) for x in ev["live"]],
                    "stale": bool(ev["stale_on_arrival"])}
        if a == "DropGeneration":
            g = ev["notice_generation"]
            if g is None:
                raise tc.TraceCheckError(f"event seq {ev.get('seq')}: DropGeneration without the "
                                         "scheduler's generation (notice_generation)")
            return {"action": a, "w": self.w(actor), "r": self.r(ev["req_id"]), "g": g,
                    "kind": "finish" if ev["finished"] else "preempt", "dest": ev["dest"],
                    "live": [self.j(x) for x in ev["live"]]}
        if a == "DmaRead":
            return {"action": a, "w": self.w(actor), "job": self.j(ev["job"]), "outcome": ev["dest"],
                    "off": ev["offset"] // self.block_size}
        if a == "Put":
            outcome = "ok" if ev["dest"] == "stored" else ("pressure" if ev["pressure"] else "fail")
            return {"action": a, "w": self.w(actor), "job": self.j(ev["job"]), "outcome": outcome,
                    "live": bool(ev["live"]), "off": ev["offset"] // self.block_size}
        if a == "Report":
            return {"action": a, "w": self.w(actor), "job": self.j(ev["job"]), "from": ev["from"],
                    "live": [self.j(x) for x in ev["live"]]}
        if a == "Load":
            return {"action": a, "w": self.w(actor), "r": self.r(ev["req_id"]),
                    "attempted": list(ev["attempted"]), "failed": list(ev["failed"])}
        if a == "Evict":
            r, c = ev["key"]
            return {"action": a, "k": [self.r(r), c]}
        if a in ("StoreFail", "StoreRestart"):
            return {"action": a}
        raise tc.UnknownActionError(f"event seq {ev.get('seq')}: action {a!r} is not in the shared vocabulary")


def check_events(events: list[dict[str, Any]], cfg: Path = DEFAULT_CFG, timeout: float = 300) -> tc.TraceVerdict:
    """TLC's verdict on a runtime log (events as the runtime wrote them)."""
    consts = ex.cfg_constants(cfg)
    norm = Normalizer(consts)
    pairs = [(e.get("seq"), m) for e, m in ((e, norm(e)) for e in events) if m is not None]
    v = tc.check_events([m for _, m in pairs], "TraceKVLedger", "TraceKVLedger.cfg",
                        cfg_text=trace_cfg(consts), timeout=timeout)
    v.seqs = [s for s, _ in pairs]
    return v


def check_log(path: Path, cfg: Path = DEFAULT_CFG) -> tc.TraceVerdict:
    return check_events(tc.read_log(Path(path)), cfg)


def record_logs(exp: ex.Export, backend: Any, out_dir: Path, behaviours: Iterable[int]) -> list[Path]:
    """Replay the given behaviours of `exp` with the ledgers (and the driver, for the scheduler's and
    the store's steps) logging NDJSON through `kvledger.trace.NdjsonTrace`; one log per behaviour.
    A behaviour that diverges is an error here (its log would prove nothing)."""
    from conformance.engine import replay as rp
    from conformance.kvdriver import KVDriver
    from kvledger.trace import NdjsonTrace

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for idx in behaviours:
        origin, b = exp.behaviours[idx]
        path = out_dir / f"{Path(exp.cfg).stem}-b{idx}.ndjson"
        with path.open("w", encoding="utf-8") as f:
            drv = KVDriver(backend, exp.consts, trace=NdjsonTrace(f))
            div = rp.replay_behaviour(drv, exp.steps(b), idx, origin)
            drv.close()  # jobs left under way end here, unlogged
        if div is not None:
            raise RuntimeError(f"cannot record a log of a diverging behaviour:\n{div}")
        paths.append(path)
    return paths


def interesting(exp: ex.Export, n: int) -> list[int]:
    """The n behaviours with the most distinct actions (then the longest): the logs worth checking."""
    def score(k: int) -> tuple[int, int]:
        names = {exp.graph.state(i)["lastAction"]["name"] for i in exp.behaviours[k][1]}
        return (len(names), len(exp.behaviours[k][1]))
    return sorted(range(len(exp.behaviours)), key=score, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check kvledger NDJSON logs against tla/KVLedger.tla with TLC")
    ap.add_argument("logs", nargs="*", type=Path)
    ap.add_argument("--cfg", type=Path, default=DEFAULT_CFG, help="the model config the logs ran under")
    ap.add_argument("--record", type=int, default=0, help="record and check N logs of simulated behaviours")
    a = ap.parse_args(argv)
    logs = list(a.logs)
    if a.record:
        from conformance.mutants import mooncake_backend
        exp = ex.simulated_export(a.cfg.parent, "KVLedger", a.cfg.name, num=max(50, a.record), depth=60, seed=1)
        with mooncake_backend() as backend:
            logs += record_logs(exp, backend, LOG_DIR, interesting(exp, a.record))
    if not logs:
        ap.error("no log to check (give paths or --record N)")
    bad = tc.check_many(logs, lambda log: check_log(log, a.cfg))
    print(f"[trace] {len(logs) - bad}/{len(logs)} logs accepted by TLC")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
