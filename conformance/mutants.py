"""Runtime mutants: seeded bugs in kvledger (the ledgers, the store-code classification) and in the
connector (its step functions in kvledger_connector/worker/: saves.py, loads.py, sent.py; the worker metadata
merge, the KV cache copy plans, the store keys, reset_cache's pattern, the runtime directory, the embedded
master's identity), applied by monkeypatching at run time (the source is never edited). Each patches a
function the connector's own threads or vLLM call.

Every mutant must be killed: a named check fails under it, in the fast stages, and its shows-probe
(conformance/probes_shows.py: the mutated function observed directly) sees the change. The named checks:

    a probe           ProbeFailed, or an invariant the runtime names (LedgerInvariantError):
                      conformance/kvprobes.py (the step functions, the ledgers) and probes_parts.py (copy
                      plans, keys, reset pattern, runtime dir), run on real parts
    replay            TLC's behaviours of the small configs below, through the driver on a loopback
                      Mooncake master, as `make verify`'s replay: a field that differs from TLC's state, a
                      refusal (the system refused a step the model takes, or a refusal probe of
                      ProbingDriver), or an invariant of check_invariants (S1-S9 on the real parts)

Any other exception inside the code under test is a CRASH: reported in its own column, never a kill.

    python -m conformance.mutants [--cfg CFG ...]   (default: the three small configs below)

prints the kill table: mutant, killed?, shows?, seconds, crash, by what (probe name and what it saw, or
config / behaviour / step / action and what differed).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import kvledger.codes
import kvledger.worker
import kvledger_connector.shape.engine_facts
import kvledger_connector.worker.loads
import kvledger_connector.worker.saves
import kvledger_connector.shape.keys
import kvledger_connector.shape.kvlayout
import kvledger_connector.scheduler.reset
import kvledger_connector.scheduler.plan
from conformance.surface import PATCHED, surface_name
from conformance import (kvprobes, probes_edge, probes_identity, probes_parts, probes_rules, probes_sched,
                         probes_specs)
from conformance.engine import export as ex
from conformance.engine import replay as rp
from conformance.engine.tlc import PARALLEL_RUNS
from conformance.kvdriver import KVDriver, MooncakeBackend
from kvledger.codes import NO_AVAILABLE_HANDLE, PutOutcome
from kvledger.errors import LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.scheduler import SchedulerLedger
from kvledger.worker import Verdict, WorkerLedger
from kvledger_connector.store import rendezvous
from kvledger_connector.shape.integrity import IntegrityKey
from kvledger_connector.worker.loads import LoadSteps
from kvledger_connector.worker.saves import SavePlan, SaveSteps
from kvledger_connector.worker.sent import SentBlocks
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.metadata import KVLedgerWorkerMetadata
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.io import StoreIO

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
PROBES: list[kvprobes.Probe] = (kvprobes.PROBES + probes_parts.PROBES + probes_sched.PROBES
                                 + probes_edge.PROBES + probes_specs.PROBES + probes_identity.PROBES
                                 + probes_rules.PROBES)
# what a replay counts as a named check besides a field diff and Refused
REPLAY_CHECKS: tuple[type[BaseException], ...] = (LedgerInvariantError,)


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`obj.name` replaced by `make(original)` for the block; only a name of the stated surface
    (conformance/surface.py), so a refactor knows what it must keep."""
    orig = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)  # a gone target: KeyError here
    if surface_name(obj, name) not in PATCHED:
        raise LookupError(f"{surface_name(obj, name)} is not on the patched surface (conformance/surface.py)")
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


def _failing_subbatch_unreported(orig):  # a sub-batch's failed keys are marked failed (the load can finish)
    def record_results(self, load_id, block_ids, codes, key_bytes):  # but never handed to vLLM
        reported = set(self._errors)
        bad = orig(self, load_id, block_ids, codes, key_bytes)
        self._errors = reported
        return bad
    return record_results


def _positive_put_code_stored(orig):  # only a negative put code fails: a positive one (no put result) stored
    def classify_put(codes, num_keys):
        out = orig(codes, num_keys)
        bad = tuple(c for c in codes if c < 0)
        return PutOutcome(stored=not bad, pressure=out.pressure, failed_codes=bad)
    return classify_put


def _answer_length_unchecked(orig):  # a store answer of the wrong length is zipped against the keys
    def check_count(field, codes, num_keys):
        return None
    return check_count


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


def _save_report_skipped_after_failure(orig_fail):  # the report is on the success path only: a job
    def fail_save(self, job_id):                      # whose handler raised is failed, never reported
        vars(self).setdefault("_mutant_unreported", set()).add(job_id)
        return orig_fail(self, job_id)
    return fail_save


def _report_skips_failed_by_exception(orig):
    def report_save(self, job_id):
        if job_id in vars(self).get("_mutant_unreported", ()):
            return None
        return orig(self, job_id)
    return report_save


def _load_unfinished_on_exception(orig):  # a load whose key building raises is dropped, never finished
    def run_load(self, req_id, block_ids, block_hashes, sync=False, groups=()):
        try:
            self._key_list(block_hashes)
        except Exception as e:
            self.note_error(f"load {req_id}: {e}")
            return None
        return orig(self, req_id, block_ids, block_hashes, sync, groups)
    return run_load


def _no_load_pin(orig):  # EmitLoad pins nothing: an aborted request's blocks are reused under the load
    def pin_load(self, req_id, block_ids):
        self._touch = lambda blocks: None  # the ledger's pin is its bound BlockPool.touch
        try:
            orig(self, req_id, block_ids)
        finally:
            self._touch = self._pool.touch
        self._loads[req_id][-1][0] = []  # keep the ledger's books consistent with "no pin": nothing to free
        for b in block_ids:
            del self._load_dest[b]
    return pin_load


def _load_pin_released_at_first_rank(orig):  # a load's ranks_left starts at 1: the first rank's
    def pin_load(self, req_id, block_ids):   # report would drop the pins while other ranks still write
        orig(self, req_id, block_ids)
        self._loads[req_id][-1][1] = 1
    return pin_load


# ---------------------------------------------------------------- KV cache copy plans, keys, reset, runtime dir
def _last_run_dropped(orig):  # a layer split into several runs per block loses its last run
    def _layer_runs(name, t, layout, block_size):
        ratio, runs, stride = orig(name, t, layout, block_size)
        return ratio, runs[:-1] if len(runs) > 1 else runs, stride
    return _layer_runs


def _stride_per_kernel_block(orig):  # a block split into kernel blocks moves by one kernel block
    def _layer_runs(name, t, layout, block_size):
        ratio, runs, stride = orig(name, t, layout, block_size)
        return ratio, runs, stride // ratio
    return _layer_runs


def _lhbnc_token_major(orig):  # LHBNC's block read in N, H, C order (the NHD layouts' order)
    return {**orig, "LHBNC": ("N", "H", "C")}


def _key_without_pp_stage(orig):  # the key names the tp shard but not the pipeline stage
    def __init__(self, layout, max_key_bytes=512, namespace=""):
        orig(self, layout, max_key_bytes, namespace)
        self.prefix = self.prefix.replace(f"-pp{layout.pp_rank}of{layout.pp_size}/", "/")
    return __init__


def _digest_without_layout(orig):  # the layout digest leaves out the KV cache layout
    def digest(self):
        return orig(dataclasses.replace(self, kv_layout="any"))
    return digest


def _tail_hash_without_tokens(orig):  # a partial tail hashed by its parent and length only
    def partial_tail_hash(parent_hash, tokens):
        return orig(parent_hash, [0] * len(tokens))
    return partial_tail_hash


def _reset_pattern_unanchored(orig):  # the reset pattern without its ^: it also matches inside other keys
    def engine_key_regex(key_builders):
        return orig(key_builders).removeprefix("^")
    return engine_key_regex


def _reset_pattern_first_shard(orig):  # the reset pattern of the first shard only: other ranks' keys stay
    def engine_key_regex(key_builders):
        return orig(list(key_builders)[:1])
    return engine_key_regex


def _runtime_dir_any_directory(orig):  # a refused runtime dir accepted whenever it is a directory at all
    def runtime_dir(*args):
        try:
            return orig(*args)
        except rendezvous.RendezvousError:
            d = os.environ.get(rendezvous.RUNTIME_DIR_ENV, "")
            if os.path.isdir(d):
                return d
            raise
    return runtime_dir


def _sweep_ignores_liveness(orig):  # the sweep takes every owner for dead: a live engine's file removed
    def _alive(pid):
        orig(pid)
        return False
    return _alive


def _every_replica_puts_all(orig):  # ranks sharing keys each put every key (k copies of each put)
    def put_positions(start, end, replica, replicas):
        return orig(start, end, 0, 1)
    return put_positions


def _replicas_ignore_heads(orig):  # every TP group counted as replicas, as if each model were MLA
    def kv_replicas(vllm_config):
        orig(vllm_config)
        return vllm_config.parallel_config.tensor_parallel_size
    return kv_replicas


def _mismatch_loaded(orig):  # the tag is computed and compared, and a mismatching block loaded all the same
    def _verified(self, slot, keys, block_ids, res, parts=None):
        yield from orig(self, slot, keys, block_ids, res, parts)
        return res
    return _verified


def _bind_ignores_key(orig):  # the tag binds the bytes and the nonce, not the key: a block loads under any key
    def bind(self, key, nonce):
        return orig(self, "", nonce)
    return bind


def _start_time_unread(orig):  # liveness by pid alone: a reused pid keeps a dead owner's file
    def _start_time(pid):
        orig(pid)
        return None
    return _start_time


# ---------------------------------------------------------------- worker side: TP-shared blocks, SentBlocks, removal
def _shared_block_one_key(orig):  # the load begun without the rank's keys per block: a TP-shared block
    def begin_load(self, req_id, block_ids):  # counts loaded after its first head shard's key
        loads = self.loads
        begin = loads.begin_load
        loads.begin_load = lambda r, ids, keys_per_block=1: begin(r, ids, keys_per_block=1)
        try:
            return orig(self, req_id, block_ids)
        finally:
            del loads.begin_load
    return begin_load


def _record_ok_per_key(orig):  # LoadLedger.record_ok loads a block on any key read, whatever keys_per_block
    def record_ok(self, load_id, block_ids):
        ld = self._load(load_id)
        k, ld.keys_per_block = ld.keys_per_block, 1
        try:
            return orig(self, load_id, block_ids)
        finally:
            ld.keys_per_block = k
    return record_ok


def _null_before_ignored(orig):  # SentBlocks keeps every id an earlier spec sent (null_before not applied)
    def resolve(self, spec):
        return orig(self, dataclasses.replace(spec, null_before=()))
    return resolve


def _null_before_wrong_index(orig):  # null_before applied at ids[b + grp], not ids[b * num_groups + grp]
    def resolve(self, spec):
        ids, hashes = orig(self, dataclasses.replace(spec, null_before=()))
        ids = list(ids)
        table = self._tables[spec.req_id][1]
        for grp, below in enumerate(spec.null_before):
            for b in range(min(below, len(self._tables[spec.req_id][2]))):
                ids[b + grp] = table[b + grp] = 0
        return tuple(ids), hashes
    return resolve


def _mismatch_not_removed(orig):  # a mismatched object is reported and left in the store (the removal forgotten)
    def remove(self, keys):
        return []
    return remove


def _mismatch_removed_unforced(orig):  # without force: a reader's lease keeps the object, which then fails
    def remove(self, keys):             # every later load of its key
        for k in keys:
            self.store.remove(k)
        return []
    return remove


def _mismatch_removes_batch(orig):  # a mismatch removes every key of the batch, the good ones too
    def _verified(self, slot, keys, block_ids, res, parts=None):
        out = yield from orig(self, slot, keys, block_ids, res, parts)
        if any(c == int(StoreCode.INTEGRITY_MISMATCH) for c in out):
            for k, c in zip(keys, out):
                if c != int(StoreCode.INTEGRITY_MISMATCH):
                    self.queue_removal(k)
        return out
    return _verified


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
    "put_positive_code_stored": [(kvledger.codes, "classify_put", _positive_put_code_stored)],
    "answer_length_unchecked": [(kvledger.codes, "check_count", _answer_length_unchecked)],
    "get_short_read_loaded": [(kvledger.codes, "is_loaded", _any_bytes_loaded)],
    "exist_error_means_present": [(kvledger.codes, "missing", _exist_error_means_present)],
    "failing_subbatch_unreported": [(LoadLedger, "record_results", _failing_subbatch_unreported)],
    # the connector's step functions
    "register_generation_dropped": [(SaveSteps, "receive", _generation_dropped_on_register)],
    "stale_job_runs": [(SavePlan, "run", _stale_job_runs)],
    "skipped_job_runs": [(SavePlan, "run", _skipped_job_runs)],
    "put_resumes_past_offset": [(SaveSteps, "begin_save", _resume_past_offset)],
    "load_ids_not_rotated": [(kvledger_connector.worker.loads, "load_pairs", _ids_not_rotated)],
    "save_report_skipped_on_exception": [(SaveSteps, "fail_save", _save_report_skipped_after_failure),
                                         (SaveSteps, "report_save", _report_skips_failed_by_exception)],
    "load_unfinished_on_exception": [(LoadSteps, "run_load", _load_unfinished_on_exception)],
    # KV cache copy plans
    "layout_last_run_dropped": [(kvledger_connector.shape.kvlayout, "_layer_runs", _last_run_dropped)],
    "layout_stride_per_kernel_block": [(kvledger_connector.shape.kvlayout, "_layer_runs", _stride_per_kernel_block)],
    "layout_lhbnc_token_major": [(kvledger_connector.shape.kvlayout, "LAYOUT_HNC_ORDER", _lhbnc_token_major)],
    # keys (the scheduler side builds tail hashes through its own binding of partial_tail_hash)
    "key_without_pp_stage": [(KeyBuilder, "__init__", _key_without_pp_stage)],
    "key_digest_without_layout": [(KeyLayout, "digest", _digest_without_layout)],
    # identical KV stored once: who puts a shared key, which ranks share keys
    "replicas_put_every_key": [(kvledger_connector.worker.saves, "put_positions", _every_replica_puts_all),
                               (kvledger.worker, "put_positions", _every_replica_puts_all)],
    "replicas_share_distinct_heads": [(kvledger_connector.shape.engine_facts, "kv_replicas", _replicas_ignore_heads)],
    "tail_hash_without_tokens": [(kvledger_connector.shape.keys, "partial_tail_hash", _tail_hash_without_tokens),
                                 (kvledger_connector.scheduler.plan, "partial_tail_hash",
                                  _tail_hash_without_tokens)],
    # integrity tags
    "integrity_mismatch_loaded": [(LoadSteps, "_verified", _mismatch_loaded)],
    "integrity_tag_ignores_key": [(IntegrityKey, "bind", _bind_ignores_key)],
    "integrity_mismatch_not_removed": [(StoreIO, "remove", _mismatch_not_removed)],
    "integrity_mismatch_removed_unforced": [(StoreIO, "remove", _mismatch_removed_unforced)],
    "integrity_mismatch_removes_whole_batch": [(LoadSteps, "_verified", _mismatch_removes_batch)],
    # the TP-shared layout (a block as a key per head shard), SentBlocks of several KV cache groups
    "shared_block_loaded_at_first_key": [(LoadSteps, "begin_load", _shared_block_one_key)],
    "load_ledger_ignores_keys_per_block": [(LoadLedger, "record_ok", _record_ok_per_key)],
    "sent_null_before_ignored": [(SentBlocks, "resolve", _null_before_ignored)],
    "sent_null_before_wrong_group": [(SentBlocks, "resolve", _null_before_wrong_index)],
    # reset_cache's pattern
    "reset_pattern_unanchored": [(kvledger_connector.scheduler.reset, "engine_key_regex", _reset_pattern_unanchored)],
    "reset_pattern_first_shard_only": [(kvledger_connector.scheduler.reset, "engine_key_regex", _reset_pattern_first_shard)],
    # the embedded master's runtime directory
    "runtime_dir_any_directory": [(rendezvous, "runtime_dir", _runtime_dir_any_directory)],
    "sweep_ignores_liveness": [(rendezvous, "_alive", _sweep_ignores_liveness)],
    "liveness_ignores_start_time": [(rendezvous, "_start_time", _start_time_unread)],
}
# the scheduler side's steps (kvledger_connector/scheduler/): pin choice, tail, deferral, collect,
# finish notices of a reused req_id, generations, loaded blocks, lookups
MUTANTS.update(probes_sched.MUTANTS)
# the edges only integration tests reached before (conformance/probes_edge.py): the integrity
# secret's mode, the replicated KV head's owner, the breaker's backoff, the lookup deadline, the rendezvous
# metadata URL, the embedded master's supervision, the weights-version switch at reset
MUTANTS.update(probes_edge.MUTANTS)
# what a rank accepts (conformance/probes_specs.py): every spec checked whole before anything of it runs
MUTANTS.update(probes_specs.MUTANTS)
# the embedded master's identity (conformance/probes_identity.py): its listener's inode, not its port
MUTANTS.update(probes_identity.MUTANTS)
# rules only integration tests held (conformance/probes_rules.py): the integrity mode's choice and the secret's
# source, every part of a key's identity, the tier sweep's own directories, tail-first release at shutdown
MUTANTS.update(probes_rules.MUTANTS)


@contextlib.contextmanager
def applied(name: str) -> Iterator[None]:
    """Mutant ``name``'s patches in place for the block."""
    with contextlib.ExitStack() as stack:
        for obj, attr, make in MUTANTS[name]:
            stack.enter_context(patched(obj, attr, make))
        yield


class ProbingDriver(KVDriver):
    """The KV driver plus named checks where the model has no edge. After every step, the driver's
    check_invariants (S1-S9 on the real parts). Right after every EmitStore (when a pinned job is sure to
    exist), two refusal probes: a report count above a pinned job's ranks_left must be refused (S5) and
    change nothing; at the pin cap, one more job must be deferred (S6's exact boundary; the job pins no
    block, so the block cap, PinCap * NumBlocks here, cannot defer it instead)."""

    def apply(self, a: dict[str, Any], pre: dict[str, Any], post: dict[str, Any]) -> None:
        super().apply(a, pre, post)
        self.check_invariants()

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


@contextlib.contextmanager
def mooncake_backend() -> Iterator[MooncakeBackend]:
    """A loopback Mooncake master (testbed.procs.mooncake_servers) and the driver's backend, as the replay
    stage uses."""
    from testbed.procs import mooncake_servers

    with mooncake_servers(rpc_timeout_ms=2000) as mc, MooncakeBackend.on_master(mc) as backend:
        yield backend


@dataclasses.dataclass
class Row:
    """One mutant's line of the table."""
    name: str
    by: str | None = None  # the named check that killed it
    crash: str | None = None  # the first crash seen (where: probe name or replay step; what)
    shows: str | None = None  # None: its shows-probe saw the change; else what it saw instead
    behaviours: int = 0  # replayed
    seconds: float = 0.0

    @property
    def killed(self) -> bool:
        return self.by is not None

    @property
    def ok(self) -> bool:
        return self.killed and self.shows is None


class KillTable(dict[str, bool]):
    """mutant -> killed (a named check failed under it); ``rows`` has the rest of each line."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, Row] = {}

    def add(self, row: Row) -> None:
        self.rows[row.name] = row
        self[row.name] = row.killed

    @property
    def crashed(self) -> list[str]:
        """Mutants that only crashed: no named check failed."""
        return [n for n, r in self.rows.items() if r.crash and not r.killed]

    @property
    def unshown(self) -> list[str]:
        return [n for n, r in self.rows.items() if r.shows is not None]

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows.values())


def _finding(cfg: str, d: rp.Divergence) -> str:
    where = f"replay {cfg} behaviour {d.behaviour} step {d.step}/{d.length} {d.action}"
    if d.kind == "state":
        f, (m, i) = next(iter(d.fields.items()))
        more = f" (+{len(d.fields) - 1} fields)" if len(d.fields) > 1 else ""
        return f"{where}: {f} model {m!r} impl {i!r}{more}"
    return f"{where}: {d.kind}: {d.error}"


def _shows(name: str) -> str | None:
    from conformance.probes_shows import SHOWS

    show = SHOWS.get(name)
    if show is None:
        return "no shows-probe"
    try:
        with kvprobes.quiet():
            show()
    except kvprobes.ProbeFailed:
        return None
    except Exception as e:  # noqa: BLE001 - reported as what the shows-probe saw
        return f"crashed: {rp.raised(e)}"
    return "NO: the mutated function behaves as the shipped one"


def judge(row: Row, exps: list[ex.Export], backend: Any, probes: bool = True) -> Row:
    """Fill ``row`` for the runtime as it is now patched: the first probe that fails a named check, else
    the first replayed behaviour that diverges with a finding; crashes on the way are kept."""
    if probes:
        run = kvprobes.run_probes(PROBES)
        if run.crashes:
            row.crash = f"probe {run.crashes[0][0]}: {run.crashes[0][1]}"
        if run.failed is not None:
            row.by = f"probe {run.failed[0]}: {run.failed[1].splitlines()[0]}"
            return row
    for e in exps:
        cfg = Path(e.cfg).stem
        rep = rp.replay_export(e, ProbingDriver(backend, e.consts), checks=REPLAY_CHECKS, crashes_stop=False)
        row.behaviours += rep.behaviours
        if rep.crashes and row.crash is None:
            c = rep.crashes[0]
            row.crash = f"replay {cfg} behaviour {c.behaviour} step {c.step} {c.action}: {c.error}"
        if rep.findings:
            row.by = _finding(cfg, rep.findings[0])
            return row
    return row


def _cell(text: str | None, width: int) -> str:
    text = "-" if text is None else text.splitlines()[0]
    return text if len(text) <= width else text[:width - 3] + "..."


def kill_table(exps: ex.Export | list[ex.Export], log: Callable[[str], None] = print, *,
               probes: bool = True, backend: Any = None, names: Sequence[str] | None = None,
               summary: bool = True) -> KillTable:
    """Probe, then replay every export, under each mutant (``probes=False``: replay only, to see what the
    model's behaviours alone catch; ``names``: these mutants only). The replays run on ``backend``, a
    MooncakeBackend; None: a loopback master started here. The unmutated runtime must pass every probe and
    conform first, without a crash."""
    exps = [exps] if isinstance(exps, ex.Export) else list(exps)
    if backend is None:
        with mooncake_backend() as be:
            return kill_table(exps, log, probes=probes, backend=be, names=names, summary=summary)
    t_all = time.monotonic()
    base = judge(Row("(unmutated)"), exps, backend)
    if base.by is not None or base.crash is not None:
        raise RuntimeError(f"the unmutated runtime fails; fix that first: {base.by or base.crash}")
    table = KillTable()
    if summary:
        log(TABLE_HEADER)
    for name in (MUTANTS if names is None else names):
        row = Row(name)
        t0 = time.monotonic()
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(applied(name))
            except Exception as e:  # noqa: BLE001 - a patch that cannot be applied: its target is gone
                row.crash = f"patch: {rp.raised(e)}"
            else:
                row.shows = _shows(name)
                judge(row, exps, backend, probes)
        row.seconds = time.monotonic() - t0
        table.add(row)
        by = row.by or f"survived {'every probe and ' if probes else ''}{row.behaviours} behaviours"
        log(f"{name:<34} {'yes' if row.killed else 'NO':<6} {'yes' if row.shows is None else 'NO':<5} "
            f"{row.seconds:5.2f}  {_cell(row.crash, 30):<30} {_cell(by, 150)}")
    if summary:
        log_summary(table, exps, probes, time.monotonic() - t_all, log)
    return table


TABLE_HEADER = f"{'mutant':<34} {'killed':<6} {'shows':<5} {'s':>5}  {'crash':<30} by"


def log_summary(table: KillTable, exps: list[ex.Export], probes: bool, seconds: float,
                log: Callable[[str], None]) -> None:
    for r in table.rows.values():
        if r.crash:
            log(f"  crash {r.name}: {r.crash}")
        if r.shows is not None:
            log(f"  shows {r.name}: {r.shows}")
    log(f"[mutants] {sum(table.values())}/{len(table)} killed, {len(table.crashed)} crashed without a kill, "
        f"{len(table.unshown)} not shown by their shows-probe, in {seconds:.1f} s "
        f"({'probes + ' if probes else ''}replay on Mooncake of {sum(len(e.behaviours) for e in exps)} "
        f"behaviours of {', '.join(Path(e.cfg).stem for e in exps)})")


def _kill_shard(exps: list[ex.Export], names: list[str]) -> list[Row]:
    return list(kill_table(exps, log=lambda s: print(s, flush=True), names=names, summary=False).rows.values())


def kill_table_sharded(exps: list[ex.Export], shards: int, log: Callable[[str], None] = print) -> KillTable:
    """`kill_table` with the mutants dealt to `shards` processes, each on its own loopback master (a
    mutant is a patch of this process's modules, so each shard patches its own), rows in the table's order."""
    if shards <= 1:
        return kill_table(exps, log)
    t_all = time.monotonic()
    names = list(MUTANTS)
    log(TABLE_HEADER)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no patch or thread of this one
    with concurrent.futures.ProcessPoolExecutor(shards, mp_context=ctx) as pool:
        futures = [pool.submit(_kill_shard, exps, names[k::shards]) for k in range(shards)]
        rows = {r.name: r for f in futures for r in f.result()}
    table = KillTable()
    for name in names:
        table.add(rows[name])
    log_summary(table, exps, True, time.monotonic() - t_all, log)
    return table


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
    exps = exports(a.cfg or [str(c) for c in DEFAULT_CFGS], a.num)
    res = kill_table(exps, probes=False) if a.replay_only else kill_table_sharded(exps, PARALLEL_RUNS)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
