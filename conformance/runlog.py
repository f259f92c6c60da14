"""Trace validation of logs of real runs (the connector's `trace_path`) against the model, with TLC.

A real run's log (vLLM's real Scheduler and BlockPool, the ranks, Mooncake; written through
`kvledger_connector.telemetry.tracefile`, one file per process) is checked by `tla/TraceRuntime.tla`: every ledger event is
the model's own action on the model's state, with the observed values compared after each step (see that
module for what is and is not compared). `normalize` maps the log into the model's vocabulary:

    runtime                                 TraceRuntime's event record
    actor "w<k>"                            w = "w<k>"; Ranks = w0..w<n-1>, n = the EmitStore's ranks_left
    req_id (one lifetime: admission to      r = a model request "q<k>", reused once a lifetime is over
      Finish; an id can come back)          (finished, every notice dropped, every job released); the
                                            model never reuses a finished request, so a reused slot's
                                            generations continue above its last one (a fresh state, as
                                            the runtime's). Keeps Req (and TLC's states) small: a log of
                                            hundreds of requests needs about max_num_seqs slots
    job id                                  job = id - (first EmitStore's id) + 1: ids must be consecutive
    EmitStore blocks, tail                  blocks (without the tail), tail (the one partial tail block
                                            pinned last, 0 = none or a log without the field)
    generation (0-based num_preemptions)    g = slot base + generation + 1 (the model counts admissions)
    DropGeneration                          matched to the rank's oldest pending notice of (req_id, g, kind)
    Collect completed {job: n}              reported <<job, n>>; ranks_left -> left; unknown -> a count
    Put dest stored / failed (+pressure)    outcome ok / pressure / fail
    worker HandleLoadErrors (take_errors)   blocks handed to the scheduler
    EmitLoad / CollectLoad (load pins)      lp = the k-th pinned load of the log; a CollectLoad's
                                            {req_id: n} applies to that req_id's oldest pinned load; a
                                            rank's Load event names the load it wrote (S9: still pinned)

The model's constants come from the log: its requests, ranks, jobs, largest block id; `pin_cap` is the
connector's `max_inflight_jobs` when known (BoundedPins), else the number of jobs.

    python -m conformance.runlog LOG.ndjson [...] [--pin-cap N] [--no-rest]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.engine import tracecheck as tc

SPEC = "TraceRuntime"
_SCHED_ONLY = {"Admit", "Compute", "Lookup", "Evict", "StoreFail", "StoreRestart", "ReleaseHeld"}


@dataclass(eq=False)
class Lifetime:
    """One lifetime of one req_id (admission .. Finish), mapped to a model request slot."""
    req_id: str
    slot: str
    base: int  # model generation = base + runtime generation + 1
    jobs: set[int] = field(default_factory=set)  # emitted, not yet released
    notices: int = 0  # notices sent to ranks and not yet dropped
    finished: bool = False

    def over(self) -> bool:
        return self.finished and not self.jobs and not self.notices


@dataclass
class Normalized:
    events: list[dict[str, Any]]       # TraceRuntime records
    consts: dict[str, Any] = field(default_factory=dict)


class RunLogNormalizer:
    """Runtime events of a real run -> TraceRuntime records (module doc). Stateful, in log order."""

    def __init__(self) -> None:
        self.first_job: int | None = None
        self.job_life: dict[int, Lifetime] = {}  # model job -> its request's lifetime
        self.current: dict[str, Lifetime] = {}  # req_id -> its scheduler-side lifetime
        self.slots: dict[str, Lifetime] = {}  # model request -> its latest lifetime
        self.slot_gen: dict[str, int] = {}  # model request -> highest model generation used
        self.pending: dict[str, list[tuple[Lifetime, int, str]]] = {}  # rank -> [(lifetime, gen, kind)]
        self.world: int | None = None
        self.max_block = 1
        self.max_gen = 1
        self.reqs: set[str] = set()
        self.ranks: set[str] = set()
        # load pins: EmitLoad numbers each pinned load 1, 2, ..; req_id -> its pinned loads, oldest first
        self.num_loads = 0
        self.load_fifo: dict[str, list[int]] = {}

    # -- names
    def _sched_life(self, req_id: str) -> Lifetime:
        """The scheduler's current lifetime of req_id; a new one (in a free slot) after its Finish."""
        life = self.current.get(req_id)
        if life is None or life.finished:
            slot = next((s for s, last in self.slots.items() if last.over()), f"q{len(self.slots) + 1}")
            life = Lifetime(req_id, slot, self.slot_gen.get(slot, 0))
            self.current[req_id] = self.slots[slot] = life
            self.reqs.add(slot)
        return life

    @staticmethod
    def _real_gen(ev: dict[str, Any], key: str) -> int:
        g = ev.get(key)
        if g.__class__ is not int or g < 0:
            raise tc.TraceCheckError(f"{ev['action']} of {ev.get('req_id')!r}: {key} {g!r} is not a "
                                     "generation (a log of an older connector, or a notice nobody planned)")
        return g

    def _gen(self, life: Lifetime, ev: dict[str, Any], key: str = "generation") -> int:
        g = life.base + self._real_gen(ev, key) + 1
        self.slot_gen[life.slot] = max(self.slot_gen.get(life.slot, 0), g)
        self.max_gen = max(self.max_gen, g)
        return g

    def _job(self, ev: dict[str, Any], real: Any = None) -> int:
        """The model id of the event's job (or of `real`, a job id the event lists)."""
        real = ev["job"] if real is None else real
        if self.first_job is None or real.__class__ is not int or real < self.first_job:
            raise tc.TraceCheckError(f"{ev['action']} on {ev.get('actor')}: job {real!r} was never emitted")
        return real - self.first_job + 1

    def _rank(self, actor: str) -> str:
        if not (actor.startswith("w") and actor[1:].isdigit()):
            raise tc.TraceCheckError(f"actor {actor!r} is neither 'sched' nor a rank 'w<k>'")
        self.ranks.add(actor)
        return actor

    def _job_life(self, j: int, ev: dict[str, Any]) -> Lifetime:
        life = self.job_life.get(j)
        if life is None:
            raise tc.TraceCheckError(f"{ev['action']} on {ev.get('actor')}: job {ev['job']} was never emitted")
        if "req_id" in ev and ev["req_id"] != life.req_id:
            raise tc.TraceCheckError(f"{ev['action']}: job {ev['job']} belongs to {life.req_id!r}, "
                                     f"not {ev['req_id']!r}")
        return life

    # -- events
    def __call__(self, ev: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._map(ev["action"], ev.get("actor", ""), ev)
        except KeyError as e:
            raise tc.TraceCheckError(f"{ev.get('action')} event lacks the field {e}") from None

    def _map(self, a: str, actor: str, ev: dict[str, Any]) -> dict[str, Any]:
        if a == "EmitStore":
            if self.first_job is None:
                self.first_job = ev["job"]
            if self.world is None:
                self.world = ev["ranks_left"]
            life = self._sched_life(ev["req_id"])
            j = self._job(ev)
            self.job_life[j] = life
            life.jobs.add(j)
            self.max_block = max([self.max_block, *ev["blocks"]])
            blocks, tail = self._split_tail(ev)
            return {"action": a, "r": life.slot, "g": self._gen(life, ev), "job": j, "blocks": blocks,
                    "tail": tail, "left": ev["ranks_left"], "pinned_jobs": ev["pinned_jobs"],
                    "pinned_blocks": ev["pinned_blocks"]}
        if a == "EmitLoad":
            if self.world is None:
                self.world = ev["ranks_left"]
            self.num_loads += 1
            self.load_fifo.setdefault(ev["req_id"], []).append(self.num_loads)
            self.max_block = max([self.max_block, *ev["blocks"]])
            return {"action": a, "lp": self.num_loads, "left": ev["ranks_left"],
                    "pinned_loads": ev["pinned_loads"]}
        if a == "CollectLoad":
            reported, released, left = [], [], []
            for req_id, n in ev["completed"].items():
                fifo = self.load_fifo.get(req_id) or [0]  # 0: no pinned load; TLC rejects the event
                reported.append([fifo[0], n])
            for req_id in ev["released"]:
                fifo = self.load_fifo.get(req_id)
                released.append(fifo.pop(0) if fifo else 0)
            for req_id, n in ev["ranks_left"].items():
                left.append([(self.load_fifo.get(req_id) or [0])[0], n])
            return {"action": a, "reported": reported, "released": released, "left": left,
                    "unknown": len(ev["unknown"]), "pinned_loads": ev["pinned_loads"]}
        if a in ("Preempt", "Finish"):
            life = self._sched_life(ev["req_id"])
            g, kind = self._gen(life, ev), "finish" if a == "Finish" else "preempt"
            for w in self._all_ranks():
                self.pending.setdefault(w, []).append((life, g, kind))
                life.notices += 1
            if a == "Finish":
                life.finished = True
            return {"action": a, "r": life.slot, "g": g}
        if a == "Receive":
            j = self._job(ev)
            life = self._job_life(j, ev)
            return {"action": a, "w": self._rank(actor), "job": j, "r": life.slot,
                    "g": self._gen(life, ev), "live": [self._job(ev, x) for x in ev["live"]],
                    "stale": bool(ev["stale_on_arrival"])}
        if a == "DropGeneration":
            w = self._rank(actor)
            kind = "finish" if ev["finished"] else "preempt"
            queue = self.pending.get(w, [])
            real = self._real_gen(ev, "notice_generation")
            match = next((n for n in queue if n[0].req_id == ev["req_id"] and n[2] == kind
                          and n[1] == n[0].base + real + 1), None)
            if match is not None:
                queue.remove(match)
                life, g = match[0], match[1]
                life.notices -= 1
            else:  # no such notice was sent: TLC rejects the step (DropNotice needs it)
                life = self.current.get(ev["req_id"]) or self._sched_life(ev["req_id"])
                g = self._gen(life, ev, "notice_generation")
            return {"action": a, "w": w, "r": life.slot, "g": g, "kind": kind, "dest": ev["dest"],
                    "live": [self._job(ev, x) for x in ev["live"]]}
        if a in ("DmaRead", "Put", "Report"):
            j = self._job(ev)
            self._job_life(j, ev)
            rec: dict[str, Any] = {"action": a, "w": self._rank(actor), "job": j}
            if a == "DmaRead":
                rec["outcome"] = ev["dest"]
            elif a == "Put":
                rec["outcome"] = "ok" if ev["dest"] == "stored" else ("pressure" if ev["pressure"] else "fail")
                rec["live"] = bool(ev["live"])
            else:
                rec["from"] = ev["from"]
                rec["live"] = [self._job(ev, x) for x in ev["live"]]
            return rec
        if a == "Collect":
            completed = sorted((int(k), v) for k, v in ev["completed"].items())
            released = [self._job(ev, x) for x in ev["released"]]
            for j in released:
                if j in self.job_life:
                    self.job_life[j].jobs.discard(j)
            return {"action": a, "released": released,
                    "reported": [[self._job(ev, k), n] for k, n in completed],
                    "left": [[self._job(ev, int(k)), n] for k, n in sorted(ev["ranks_left"].items())],
                    "unknown": len(ev["unknown"]), "pinned_jobs": ev["pinned_jobs"],
                    "pinned_blocks": ev["pinned_blocks"]}
        if a == "Load":
            # lp: the req's oldest pinned load, which this rank finished writing (S9: it must still be
            # pinned); 0 = none. strict: the log has the scheduler's load pins (an older log does not)
            fifo = self.load_fifo.get(ev["req_id"])
            return {"action": a, "w": self._rank(actor), "attempted": list(ev["attempted"]),
                    "loaded": list(ev["loaded"]), "failed": list(ev["failed"]),
                    "lp": fifo[0] if fifo else 0, "strict": self.num_loads > 0}
        if a == "HandleLoadErrors" and actor != "sched":
            return {"action": a, "w": self._rank(actor), "blocks": list(ev["blocks"])}
        if a in _SCHED_ONLY or a == "HandleLoadErrors":
            raise tc.TraceCheckError(f"{a}: an event of the conformance driver, not of a real run's log "
                                     "(check it with conformance.kvtrace)")
        raise tc.UnknownActionError(f"action {a!r} is not in the shared vocabulary")

    @staticmethod
    def _split_tail(ev: dict[str, Any]) -> tuple[list[int], int]:
        """An EmitStore's pinned ids as the model's job: its blocks, and its partial tail (0 = none), which
        the ledger pins last. A log without the field (older connectors) has no tail. A block stored as
        several keys has a tail block per KV cache group, all pinned last: the model's one tail is the last
        of them, the others count among its blocks (the pin order, and the release order, is the same)."""
        blocks, tail = list(ev["blocks"]), list(ev.get("tail", []))
        if blocks[len(blocks) - len(tail):] != tail:
            raise tc.TraceCheckError(f"EmitStore of job {ev['job']}: tail {tail} is not pinned last "
                                     f"(blocks {blocks})")
        return blocks[:len(blocks) - 1] if tail else blocks, (tail[-1] if tail else 0)

    def _all_ranks(self) -> list[str]:
        if self.world is None:
            raise tc.TraceCheckError("a notice before any EmitStore: the number of ranks is unknown "
                                     "(a run that saved nothing has nothing to check)")
        return [f"w{k}" for k in range(self.world)]

    def constants(self, num_jobs: int, num_events: int, pin_cap: int | None) -> dict[str, Any]:
        ranks = sorted(self.ranks | set(self._all_ranks()))
        if len(ranks) != self.world:
            raise tc.TraceCheckError(f"ranks {ranks} in the log, but EmitStore says {self.world} ranks_left")
        max_jobs = max(num_jobs, 1)
        return {"Req": sorted(self.reqs), "Ranks": ranks, "NoReq": "NoReq", "NumBlocks": self.max_block,
                "NumChunks": 1, "MaxGen": self.max_gen, "MaxJobs": max_jobs,
                "PinCap": pin_cap if pin_cap is not None else max_jobs,
                # Finish is never taken here (a logged Finish is the notice: Announce), so no bound
                "MaxHeld": len(self.reqs), "MaxFaults": num_events + 1,
                "FaultKinds": ["dma", "put", "pressure"], "SubBatch": 1, "PreemptNotices": True,
                "LateNotices": True, "PartialTail": True, "Stripe": False, "Legacy": False, "Mutant": "none"}


def normalize(events: list[dict[str, Any]], pin_cap: int | None = None) -> Normalized:
    norm = RunLogNormalizer()
    # the number of ranks is the whole log's: a notice can come first (a request aborted before any save)
    norm.world = next((ev["ranks_left"] for ev in events
                       if ev.get("action") in ("EmitStore", "EmitLoad") and "ranks_left" in ev), None)
    out = [norm(ev) for ev in events]  # one record per event: record k is line k of the log
    if norm.world is None:
        raise tc.TraceCheckError("the log has no EmitStore: nothing to check")
    jobs = sum(1 for e in out if e["action"] == "EmitStore")
    return Normalized(out, norm.constants(jobs, len(out), pin_cap))


def trace_cfg(consts: dict[str, Any], expect_rest: bool) -> str:
    lines = ["CONSTANTS"] + [f"    {k} = {tc.to_tla_const(v)}" for k, v in consts.items()]
    lines += [f"    ExpectRest = {tc.to_tla_const(expect_rest)}",
              "SPECIFICATION TraceSpec",
              "INVARIANT TypeOK ReportedOnce BoundedPins DmaReadsPinned",
              "PROPERTY NoStaleEffect LifecycleConforms",
              "CONSTRAINT Furthest", ""]
    return "\n".join(lines)


def check_events(events: list[dict[str, Any]], *, pin_cap: int | None = None, expect_rest: bool = True,
                 timeout: float = 600) -> tc.TraceVerdict:
    """TLC's verdict on a real run's log (events as the connector wrote them)."""
    nz = normalize(events, pin_cap)
    v = tc.check_events(nz.events, SPEC, f"{SPEC}.cfg", cfg_text=trace_cfg(nz.consts, expect_rest),
                        timeout=timeout, xmx="2g", done_marker="matched")
    v.seqs = list(range(1, len(nz.events) + 1))
    v.seq_name = "line"
    return v


def check_log(path: Path, **kw: Any) -> tc.TraceVerdict:
    return check_events(tc.read_log(Path(path)), **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check logs of real runs (connector trace_path) against "
                                             "tla/KVLedger.tla's job lifecycle with TLC")
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--pin-cap", type=int, default=None, help="the connector's max_inflight_jobs")
    ap.add_argument("--no-rest", action="store_true", help="the run did not drain: skip the end-state check")
    a = ap.parse_args(argv)
    bad = tc.check_many(a.logs, lambda log: check_log(log, pin_cap=a.pin_cap, expect_rest=not a.no_rest))
    print(f"[runlog] {len(a.logs) - bad}/{len(a.logs)} logs of real runs accepted by TLC")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
