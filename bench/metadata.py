"""Scheduler -> worker metadata bytes per engine step: the pickled size of `KVLedgerConnectorMetadata`.

vLLM ships each step's connector metadata to every worker process inside the SchedulerOutput (the
multiprocess executor's message queue pickles it), so the pickled size is what crosses the process
boundary. Workload: long decoding requests through vLLM 0.32's real Scheduler (bench/sched_step.py: real
KVCacheManager, BlockPool and Requests, the workers played by the bench, lookups off), N requests running
at once, a prompt of P blocks, exactly D generated tokens each, `save_decode` off (only the prompt's blocks
are saved) and on (every block a decode step fills opens a job). A job may read every block [0, end) of
its request, but its SaveSpec carries only the ids and hashes no earlier job of the generation sent (each
rank keeps the rest, `jobs.SentBlocks`): the "ids/job" column (sent) against "reads/job" (the blocks
[0, end) the job may read) shows what that saves. Upstream's MooncakeStoreConnectorMetadata of the same steps (its ReqMeta carries the whole
table and the request's block hashes per save; the metadata also carries the set of every unfinished
request id) is measured in the same run, for scale.

    python -m bench.metadata [--quick]
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import sys
from typing import Any

from bench.sched_step import BenchError, StepRecord, Workload, run


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _probe(rec: StepRecord) -> None:
    ours, up = rec.metas["ours"], rec.metas["upstream"]
    rec.extra = {"ours_bytes": _size(ours), "up_bytes": _size(up),
                 "ids_sent": sum(len(s.block_ids) for s in ours.saves),
                 "ids_read": sum(s.end_block for s in ours.saves),
                 "save_bytes": sum(_size(s) for s in ours.saves)}


def workloads(quick: bool) -> list[Workload]:
    out = 256 if quick else 1024
    return [Workload(max_num_seqs=32, prompt_blocks=16, max_tokens=out, fixed_tokens=True, num_requests=32,
                     save_decode=sd) for sd in (False, True)]


def measure(w: Workload) -> dict[str, float]:
    r = run(w, probe=_probe)
    steps = r.steps
    ob = [s.extra["ours_bytes"] for s in steps]
    ub = [s.extra["up_bytes"] for s in steps]
    with_saves = [s for s in steps if s.jobs["ours"]]
    jobs = r.jobs_total["ours"]
    p90 = sorted(ob)[int(0.9 * (len(ob) - 1))]
    return {"steps": len(steps), "jobs": jobs, "steps_with_saves": len(with_saves),
            "mean": statistics.fmean(ob), "median": statistics.median(ob), "p90": p90, "max": max(ob),
            "total": sum(ob), "up_mean": statistics.fmean(ub), "up_max": max(ub), "up_total": sum(ub),
            "ids_per_job": sum(s.extra["ids_sent"] for s in steps) / jobs if jobs else 0.0,
            "reads_per_job": sum(s.extra["ids_read"] for s in steps) / jobs if jobs else 0.0,
            "bytes_per_save": sum(s.extra["save_bytes"] for s in steps) / jobs if jobs else 0.0,
            "mean_with_saves": statistics.fmean(s.extra["ours_bytes"] for s in with_saves) if with_saves else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.metadata", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 generated tokens per request instead of 1024")
    a = ap.parse_args([] if argv is None else argv)
    print("connector metadata per engine step, pickled (protocol 5) as vLLM ships it: vLLM 0.32's Scheduler, "
          "long decoding requests (bench/metadata.py); bytes of ours' KVLedgerConnectorMetadata, upstream's "
          "MooncakeStoreConnectorMetadata of the same steps for scale")
    print(f"{'N':>3} {'P':>3} {'D':>5} {'sd':>2} {'steps':>5} {'jobs':>5} | {'mean B':>7} {'median':>7} {'p90':>7} "
          f"{'max':>7} {'w/ saves':>8} {'total KB':>9} | {'ids/job':>7} {'reads/job':>9} {'B/save':>7} | "
          f"{'upstream mean':>13} {'max':>7} {'total KB':>9}")
    try:
        for w in workloads(a.quick):
            m = measure(w)
            print(f"{w.max_num_seqs:3d} {w.prompt_blocks:3d} {w.max_tokens:5d} {int(w.save_decode):2d} "
                  f"{m['steps']:5d} {m['jobs']:5d} | {m['mean']:7.0f} {m['median']:7.0f} {m['p90']:7.0f} "
                  f"{m['max']:7.0f} {m['mean_with_saves']:8.0f} {m['total'] / 1024:9.1f} | "
                  f"{m['ids_per_job']:7.1f} {m['reads_per_job']:9.1f} {m['bytes_per_save']:7.0f} | "
                  f"{m['up_mean']:13.0f} {m['up_max']:7.0f} {m['up_total'] / 1024:9.1f}", flush=True)
    except BenchError as e:
        print(f"bench.metadata: FAILED consistency check: {e}")
        return 1
    print("ids/job: block ids (and as many hashes) a SaveSpec carries; reads/job: the blocks [0, end) the job "
          "may read (each rank resolves the ones earlier specs sent); B/save: pickled bytes of one SaveSpec "
          "alone; w/ saves: mean bytes of steps that opened a job")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
