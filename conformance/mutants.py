"""Runtime mutants: seeded bugs in kvledger (the ledgers, the store-code classification) and in the
connector's orchestration (kvledger_connector/jobs.py, the worker metadata merge), applied by
monkeypatching at run time (the source is never edited). Every one must be killed by the fast stages:
the probes (conformance/kvprobes.py: the step functions on a scripted store, also run by
tests/unit/test_jobs.py) or replay of TLC's behaviours through the driver, which calls the connector's
own step functions (with refusal probes where the model has no edge).

    python -m conformance.mutants [--cfg CFG ...]   (default: the three small configs below)

prints the kill table: mutant, killed?, by what (probe name, or config / behaviour / step / action), seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import kvledger.codes
import kvledger_connector.jobs
from conformance.engine import export as ex
from conformance import kvprobes
from conformance.engine import replay as rp
from conformance.kvdriver import KVDriver, MemStoreBackend
from kvledger.codes import NO_AVAILABLE_HANDLE, PutOutcome
from kvledger.errors import LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.scheduler import SchedulerLedger
from kvledger.worker import Verdict, WorkerLedger
from kvledger_connector.jobs import SavePlan, WorkerSteps
from kvledger_connector.metadata import KVLedgerWorkerMetadata

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / ".tlc-out"
KV_CFGS = ROOT / "tests" / "conformance" / "kv"
DEFAULT_CFG = KV_CFGS / "MC_replay_tiny.cfg"
# unannounced preemption: where a worker ledger that ignores generations goes wrong (with in-order
# notices a req_id-keyed ledger is indistinguishable from the fixed one)
NONOTICE_CFG = KV_CFGS / "MC_replay_nonotice.cfg"
# two ranks at the pin cap: a count of 2 reports in one Collect, a pin released after one rank's report
TWORANKS_CFG = KV_CFGS / "MC_replay_2ranks.cfg"
DEFAULT_CFGS = (DEFAULT_CFG, NONOTICE_CFG, TWORANKS_CFG)


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    orig = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


# ---------------------------------------------------------------- the scheduler ledger (pins, cap)
def _no_pin(orig):  # EmitStore pins nothing (vLLM #52360)
    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        self._touch = lambda blocks: None
        try:
            j = orig(self, req_id, block_ids, tail_block_ids, **kw)
        finally:
            self._touch = self._pool.touch
        if j is not None:  # keep the ledger's own books consistent with "no pin": nothing to free later
            self._pinned[j][0] = []
        return j
    return open_job


def _release_one_report_early(orig):  # ranks_left starts one rank short
    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        j = orig(self, req_id, block_ids, tail_block_ids, **kw)
        if j is not None:
            self._pinned[j][1] -= 1
        return j
    return open_job


def _tail_unpinned(orig):  # the copy-on-write tail is dropped: blocks outside the table stay unpinned
    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        return orig(self, req_id, block_ids, (), **kw)
    return open_job


def _cap_admits_one_over(orig):  # `njobs > max` instead of `>=`: one job past the in-flight cap
    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        self._max_jobs += 1
        try:
            return orig(self, req_id, block_ids, tail_block_ids, **kw)
        finally:
            self._max_jobs -= 1
    return open_job


def _block_cap_one_short(orig):  # `pins >= max` instead of `>`: a job reaching the block cap exactly deferred
    def open_job(self, req_id, block_ids, tail_block_ids=(), **kw):
        self._max_pins -= 1
        try:
            return orig(self, req_id, block_ids, tail_block_ids, **kw)
        finally:
            self._max_pins += 1
    return open_job


def _over_report_ignored(orig):  # a count above ranks_left is clamped instead of raising S5
    def collect(self, completed):
        fixed = {j: min(n, self._pinned[j][1]) if j in self._pinned else n for j, n in completed.items()}
        return orig(self, fixed)
    return collect


# ---------------------------------------------------------------- the worker ledger, reports
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


def _reports_not_cleared(orig):  # take_completed hands the reports out again next step (double count)
    def take_completed(self):
        return dict(self._completed)
    return take_completed


def _merge_overwrites(orig):  # the ranks' reports merged with dict.update: a count of 2 becomes 1
    def aggregate(self, other):
        self.completed_saves.update(other.completed_saves)
        return self
    return aggregate


# ---------------------------------------------------------------- store-code classification
def _partial_put_ok(orig):  # a put batch counts as stored if any key is
    def classify_put(codes, num_keys):
        out = orig(codes, num_keys)
        return dataclasses.replace(out, stored=not codes or 0 in codes)
    return classify_put


def _pressure_first_key_only(orig):  # only the first key's code is checked for NO_AVAILABLE_HANDLE
    def classify_put(codes, num_keys):
        out = orig(codes, num_keys)
        return PutOutcome(out.stored, bool(codes) and codes[0] == NO_AVAILABLE_HANDLE, out.failed_codes)
    return classify_put


def _any_bytes_loaded(orig):  # the drifted copy: code >= 0 counts as loaded (a short read too)
    def is_loaded(code, key_bytes):
        return code >= 0
    return is_loaded


def _exist_error_means_present(orig):  # batch_is_exist: only 0 is missing, an error code skips the put
    def missing(codes, num_keys):
        orig(codes, num_keys)
        return [i for i, c in enumerate(codes) if c == 0]
    return missing


def _failing_subbatch_unreported(orig):  # failed keys of a sub-batch are not reported
    def record_results(self, load_id, block_ids, codes, key_bytes):
        self.record_ok(load_id, [b for b, c in zip(block_ids, codes) if c == key_bytes])
        return []
    return record_results


# ---------------------------------------------------------------- the connector's orchestration
def _generation_dropped_on_register(orig):  # the worker's Receive step does not pass the job's generation
    def receive(self, req_id, job_id, generation):
        return orig(self, req_id, job_id, None)
    return receive


def _stale_job_runs(orig):  # the plan only checks SKIP: a stale job reads and puts
    return property(lambda self: self.verdict is not Verdict.SKIP)


def _skipped_job_runs(orig):  # the plan only checks STALE: a pressure-skipped job puts anyway
    return property(lambda self: self.verdict is not Verdict.STALE)


def _resume_past_offset(orig):  # the put resumes one block after the saved offset
    def begin_save(self, job_id, end_block):
        plan = orig(self, job_id, end_block)
        return dataclasses.replace(plan, start=min(plan.start + 1, plan.end)) if plan.start else plan
    return begin_save


def _ids_not_rotated(orig):  # the keys are rotated by tp_rank, their block ids are not
    def load_pairs(keys, block_ids, tp_rank):
        pairs = orig(keys, block_ids, tp_rank)
        return [(k, block_ids[i]) for i, (k, _b) in enumerate(pairs)]
    return load_pairs


def _save_report_not_in_finally(orig):  # the report is the try's last line: an exception skips it
    def run_save(self, req_id, job_id, end_block, block_ids, block_hashes, before_read=None):
        try:
            plan = self.begin_save(job_id, end_block)
            if plan.run:
                pos = list(plan.positions)
                keys = self._key_list([block_hashes[i] for i in pos])
                res = self.put(keys, [block_ids[i] for i in pos], before_read)
                self.record_put(job_id, res, len(keys), end_block * self.block_size)
            self.report_save(job_id)
        except Exception as e:
            self.note_error(f"save job {job_id}: {e}")
    return run_save


def _load_unfinished_on_exception(orig):  # a load whose key building raises is dropped, never finished
    def run_load(self, req_id, block_ids, block_hashes):
        try:
            self._key_list(block_hashes)
        except Exception as e:
            self.note_error(f"load {req_id}: {e}")
            return None
        return orig(self, req_id, block_ids, block_hashes)
    return run_load


def _no_load_pin(orig):  # EmitLoad pins nothing: an aborted request's blocks are reused under the load
    def pin_load(self, req_id, block_ids):
        self._pool.touch = lambda blocks: None
        try:
            orig(self, req_id, block_ids)
        finally:
            del self._pool.touch
        self._loads[req_id][-1][0] = []  # nothing to free later either
        for b in block_ids:
            del self._load_dest[b]
    return pin_load


def _load_pin_released_at_first_rank(orig):  # a load's ranks_left starts at 1: the first rank's
    def pin_load(self, req_id, block_ids):   # report would drop the pins while other ranks still write
        orig(self, req_id, block_ids)
        self._loads[req_id][-1][1] = 1
    return pin_load


Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    # scheduler ledger
    "no_pin": [(SchedulerLedger, "open_job", _no_pin)],
    "pin_released_one_report_early": [(SchedulerLedger, "open_job", _release_one_report_early)],
    "cow_tail_unpinned": [(SchedulerLedger, "open_job", _tail_unpinned)],
    "pin_cap_admits_one_over": [(SchedulerLedger, "open_job", _cap_admits_one_over)],
    "pin_block_cap_one_short": [(SchedulerLedger, "open_job", _block_cap_one_short)],
    "over_report_ignored": [(SchedulerLedger, "collect", _over_report_ignored)],
    "no_load_pin": [(SchedulerLedger, "pin_load", _no_load_pin)],
    "load_pin_released_at_first_rank": [(SchedulerLedger, "pin_load", _load_pin_released_at_first_rank)],
    # worker ledger, reports across ranks
    "worker_keyed_by_req_id": [(WorkerLedger, "register", _keyed_by_req_id),
                               (WorkerLedger, "drop_generation", _keyed_by_req_id_drop)],
    "no_report_when_store_raises": [(WorkerLedger, "finish", _no_report_when_store_raises)],
    "reports_counted_twice": [(WorkerLedger, "take_completed", _reports_not_cleared)],
    "rank_reports_overwritten": [(KVLedgerWorkerMetadata, "aggregate", _merge_overwrites)],
    # store-code classification (kvledger.codes, LoadLedger)
    "put_partial_batch_ok": [(kvledger.codes, "classify_put", _partial_put_ok)],
    "put_pressure_first_key_only": [(kvledger.codes, "classify_put", _pressure_first_key_only)],
    "get_short_read_loaded": [(kvledger.codes, "is_loaded", _any_bytes_loaded)],
    "exist_error_means_present": [(kvledger.codes, "missing", _exist_error_means_present)],
    "failing_subbatch_unreported": [(LoadLedger, "record_results", _failing_subbatch_unreported)],
    # the connector's step functions
    "register_generation_dropped": [(WorkerSteps, "receive", _generation_dropped_on_register)],
    "stale_job_runs": [(SavePlan, "run", _stale_job_runs)],
    "skipped_job_runs": [(SavePlan, "run", _skipped_job_runs)],
    "put_resumes_past_offset": [(WorkerSteps, "begin_save", _resume_past_offset)],
    "load_ids_not_rotated": [(kvledger_connector.jobs, "load_pairs", _ids_not_rotated)],
    "save_report_skipped_on_exception": [(WorkerSteps, "run_save", _save_report_not_in_finally)],
    "load_unfinished_on_exception": [(WorkerSteps, "run_load", _load_unfinished_on_exception)],
}


class ProbingDriver(KVDriver):
    """The KV driver plus refusal probes where the model has no edge, run right after every EmitStore
    (when a pinned job is sure to exist): a report count above a pinned job's ranks_left must be refused
    (S5) and change nothing; at the pin cap, one more job must be deferred (S6's exact boundary; the job
    pins no block, so the block cap, PinCap * NumBlocks here, cannot defer it instead)."""

    def do_EmitStore(self, a: dict[str, Any]) -> None:
        super().do_EmitStore(a)
        inflight = self.sched.inflight_jobs()
        if len(inflight) >= self.pin_cap:  # a job pinning nothing: only the job cap can defer it
            extra = self.sched.open_job(a["r"], [])
            if extra is not None:
                raise rp.Refused(f"pin-cap probe: job {extra} admitted with {len(inflight)} jobs in flight at "
                                 f"PinCap={self.pin_cap}")
        for j in inflight:
            left = self.sched.ranks_left(j)
            try:
                self.sched.collect({j: left + 1})
            except LedgerInvariantError:
                continue
            raise rp.Refused(f"over-report probe: collect({{{j}: {left + 1}}}) with ranks_left={left} "
                             "was accepted (the model has no such step)")


def _killer(exps: list[ex.Export], probes: bool = True) -> tuple[str | None, int]:
    """What kills the runtime as it is now patched: the first failing probe, else the first export that
    diverges. Returns (what, behaviours replayed)."""
    hit = kvprobes.run_probes() if probes else None
    if hit is not None:
        return f"probe {hit[0]}: {hit[1].splitlines()[0][:90]}", 0
    seen = 0
    for e in exps:
        rep = rp.replay_export(e, ProbingDriver(MemStoreBackend(), e.consts))
        seen += rep.behaviours
        if rep.divergences:
            d = rep.divergences[0]
            return f"replay {Path(e.cfg).stem} behaviour {d.behaviour} step {d.step}: {d.action}", seen
    return None, seen


def kill_table(exps: ex.Export | list[ex.Export], log: Callable[[str], None] = print, *,
               probes: bool = True) -> dict[str, bool]:
    """Probe, then replay every export, under each mutant; a mutant is killed by the first probe that
    fails or export that diverges (``probes=False``: replay only, to see what the model's behaviours
    alone catch). The stores are in memory (the mutants are in the runtime, not the store). The
    unmutated runtime must pass every probe and conform first."""
    exps = [exps] if isinstance(exps, ex.Export) else list(exps)
    t_all = time.monotonic()
    base, _ = _killer(exps)
    if base is not None:
        raise RuntimeError(f"the unmutated runtime fails; fix that first: {base}")
    results: dict[str, bool] = {}
    log(f"{'mutant':<34} {'killed':<6} {'s':>5}  by")
    for name, patches in MUTANTS.items():
        t0 = time.monotonic()
        with contextlib.ExitStack() as stack:
            for obj, attr, make in patches:
                stack.enter_context(patched(obj, attr, make))
            what, seen = _killer(exps, probes)
        results[name] = what is not None
        log(f"{name:<34} {'yes' if what else 'NO':<6} {time.monotonic() - t0:5.2f}  "
            f"{what or ('survived every probe and ' if probes else 'survived ') + f'{seen} behaviours'}")
    log(f"[mutants] {sum(results.values())}/{len(results)} killed in {time.monotonic() - t_all:.1f} s "
        f"({'probes + ' if probes else ''}replay of {sum(len(e.behaviours) for e in exps)} behaviours of "
        f"{', '.join(Path(e.cfg).stem for e in exps)})")
    return results


def exports(cfgs: list[str], num: int = 100, log: Callable[[str], None] = print) -> list[ex.Export]:
    out = OUT_DIR
    return [ex.export(ROOT / "tla", "KVLedger", str(c), num=num, depth=40, seed=1,
                      out=out / f"mutants.{Path(c).stem}.json", log=log) for c in cfgs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kill table of the runtime mutants")
    ap.add_argument("--cfg", action="append", help="a TLC config (repeatable)")
    ap.add_argument("--num", type=int, default=200)
    ap.add_argument("--replay-only", action="store_true", help="no probes: what replay alone kills")
    a = ap.parse_args(argv)
    res = kill_table(exports(a.cfg or [str(c) for c in DEFAULT_CFGS], a.num), probes=not a.replay_only)
    return 0 if all(res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
