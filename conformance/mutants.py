"""Runtime mutants: seeded bugs in kvledger, applied by monkeypatching at run time (the source is never
edited), each of which replay of TLC's behaviours (or a refusal probe where the model has no edge)
must kill.

    python -m conformance.mutants [--cfg CFG ...]   (default: the two small configs below)

prints the kill table: mutant, killed?, the first divergence (behaviour, step, action).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from conformance import export as ex
from conformance import replay as rp
from conformance.kvdriver import KVDriver, MemStoreBackend
from kvledger.errors import LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.scheduler import SchedulerLedger
from kvledger.worker import WorkerLedger

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / ".tlc-out"
DEFAULT_CFG = ROOT / "tests" / "conformance" / "kv" / "MC_replay_tiny.cfg"
# unannounced preemption: where a worker ledger that ignores generations goes wrong (with in-order
# notices a req_id-keyed ledger is indistinguishable from the fixed one)
NONOTICE_CFG = ROOT / "tests" / "conformance" / "kv" / "MC_replay_nonotice.cfg"
DEFAULT_CFGS = (DEFAULT_CFG, NONOTICE_CFG)


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def _no_pin(orig):  # EmitStore pins nothing (vLLM #52360)
    def open_job(self, req_id, block_ids, tail_block_ids=()):
        pool_touch = self._pool.touch
        self._pool.touch = lambda blocks: None
        try:
            j = orig(self, req_id, block_ids, tail_block_ids)
        finally:
            del self._pool.touch
        if j is not None:  # keep the ledger's own books consistent with "no pin": nothing to free later
            self._pinned[j][0] = []
        return j
    return open_job


def _release_one_report_early(orig):  # ranks_left starts one rank short
    def open_job(self, req_id, block_ids, tail_block_ids=()):
        j = orig(self, req_id, block_ids, tail_block_ids)
        if j is not None:
            self._pinned[j][1] -= 1
        return j
    return open_job


def _keyed_by_req_id(orig):  # the worker ledger ignores generations (vLLM #51637)
    def register(self, req_id, job_id, generation=None):
        return orig(self, req_id, job_id, None)
    return register


def _keyed_by_req_id_drop(orig):
    def drop_generation(self, req_id, *, finished, generation=None):
        return orig(self, req_id, finished=finished, generation=None)
    return drop_generation


def _no_report_when_store_raises(orig):  # a failed job never reaches the report (vLLM #43742)
    def finish(self, job_id):
        job = self._jobs.get(job_id)
        if job is not None and job.state == "failed":
            return None
        return orig(self, job_id)
    return finish


def _failing_subbatch_unreported(orig):  # failed keys of a sub-batch are not reported
    def record_results(self, load_id, block_ids, codes):
        ok = [b for b, c in zip(block_ids, codes) if c >= 0]
        self.record_ok(load_id, ok)
        return []
    return record_results


def _over_report_ignored(orig):  # a count above ranks_left is clamped instead of raising S5
    def collect(self, completed):
        fixed = {j: min(n, self._pinned[j][1]) if j in self._pinned else n for j, n in completed.items()}
        return orig(self, fixed)
    return collect


MUTANTS: dict[str, list[tuple[Any, str, Callable[..., Any]]]] = {
    "no_pin": [(SchedulerLedger, "open_job", _no_pin)],
    "pin_released_one_report_early": [(SchedulerLedger, "open_job", _release_one_report_early)],
    "worker_keyed_by_req_id": [(WorkerLedger, "register", _keyed_by_req_id),
                               (WorkerLedger, "drop_generation", _keyed_by_req_id_drop)],
    "no_report_when_store_raises": [(WorkerLedger, "finish", _no_report_when_store_raises)],
    "failing_subbatch_unreported": [(LoadLedger, "record_results", _failing_subbatch_unreported)],
    "over_report_ignored": [(SchedulerLedger, "collect", _over_report_ignored)],
}


class ProbingDriver(KVDriver):
    """The KV driver plus one refusal probe where the model has no edge: after every Collect, a report
    count above a pinned job's ranks_left must be refused (S5) and change nothing. It runs right
    after every EmitStore, when a pinned job is sure to exist."""

    def do_EmitStore(self, a: dict[str, Any]) -> None:
        super().do_EmitStore(a)
        for j in self.sched.inflight_jobs():
            left = self.sched.ranks_left(j)
            try:
                self.sched.collect({j: left + 1})
            except LedgerInvariantError:
                continue
            raise rp.Refused(f"over-report probe: collect({{{j}: {left + 1}}}) with ranks_left={left} "
                             "was accepted (the model has no such step)")


def kill_table(exps: ex.Export | list[ex.Export], log: Callable[[str], None] = print) -> dict[str, bool]:
    """Replay every export under each mutant; a mutant is killed by the first export that diverges.
    The stores are in-memory here (the mutants are in kvledger, not in the store)."""
    exps = [exps] if isinstance(exps, ex.Export) else list(exps)
    for e in exps:
        base = rp.replay_export(e, ProbingDriver(MemStoreBackend(), e.consts))
        if not base.ok:
            raise RuntimeError(f"the unmutated runtime diverges on {e.cfg}; fix that first:\n"
                               f"{base.divergences[0]}")
    results: dict[str, bool] = {}
    log(f"{'mutant':<32} {'killed':<7} first divergence")
    for name, patches in MUTANTS.items():
        first, seen = None, 0
        with contextlib.ExitStack() as stack:
            for obj, attr, make in patches:
                stack.enter_context(patched(obj, attr, make))
            for e in exps:
                rep = rp.replay_export(e, ProbingDriver(MemStoreBackend(), e.consts))
                seen += rep.behaviours
                if rep.divergences:
                    first = (Path(e.cfg).stem, rep.divergences[0])
                    break
        killed = first is not None
        results[name] = killed
        what = (f"{first[0]} behaviour {first[1].behaviour} step {first[1].step}: {first[1].action}"
                if first else f"survived {seen} behaviours")
        log(f"{name:<32} {'yes' if killed else 'NO':<7} {what}")
    log(f"[mutants] {sum(results.values())}/{len(results)} killed")
    return results


def exports(cfgs: list[str], num: int = 100, log: Callable[[str], None] = print) -> list[ex.Export]:
    out = OUT_DIR
    return [ex.export(ROOT / "tla", "KVLedger", str(c), num=num, depth=40, seed=1,
                      out=out / f"mutants.{Path(c).stem}.json", log=log) for c in cfgs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kill table of the runtime mutants")
    ap.add_argument("--cfg", action="append", help="a TLC config (repeatable)")
    ap.add_argument("--num", type=int, default=200)
    a = ap.parse_args(argv)
    res = kill_table(exports(a.cfg or [str(c) for c in DEFAULT_CFGS], a.num))
    return 0 if all(res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
