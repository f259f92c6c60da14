"""Engine steps under pool pressure through vLLM 0.32's real Scheduler: no connector vs ours vs upstream,
same harness, same run. Same-run ratios only, nothing asserted.

Every way runs in testbed/harness.py (vLLM's real `Scheduler` and `BlockPool` on CPU, two emulated TP
ranks, KV caches from vLLM's allocator, the stand-in forward that writes and checks every position's KV and
takes FORWARD_S per step, a stand-in for the model's time; the ranks' start_load_kv run in parallel):

  none        no kv_transfer_config
  ours        KVLedgerConnector, its defaults (the pin cap derived from max_model_len and the pool; loads of
              at most `sync_load_max_tokens` = 256 tokens inside the step that schedules the request, as
              under vLLM's default kv_load_failure_policy "fail"; beside this configured master, integrity
              "checksum", with the tag construction for host KV: kvledger_connector/shape/integrity.py)
  ours-async  the same with `sync_load_max_tokens` 0: every load asynchronous, the request waiting in
              WAITING_FOR_REMOTE_KVS (what ours did before sync loads, what upstream does, and what ours
              does under kv_load_failure_policy "recompute", where no load is sync)
  ours-mac    ours with integrity "mac" (a secret file written for the run, as an operator configures it
              beside a master; the embedded store's default)
  ours-off    ours with integrity "off" (no tag)
  upstream  vLLM 0.32's MooncakeStoreConnector (testbed/upstream.py: configured by its MOONCAKE_CONFIG_PATH
            file; test doubles there only: each rank's identity in vLLM's distributed groups for its
            constructor, and testbed/cuda_event_stub.py's no-op torch.cuda.Event)

on one Mooncake master on 127.0.0.1 that the bench starts. Each workload: the same prompts (shared-prefix,
68 tokens, 40 generated) in two passes with reset_prefix_cache() between them, so pass 2 finds its
prefixes in the store, not in vLLM's cache; each pass its own request ids ("p<n>-req-<i>"; bench/engine.py
says why upstream needs that). Workloads (--quick: fewer prompts), all under vLLM's default
kv_load_failure_policy "fail":

  pool48       120 prompts x 2 passes, 48-block pool
  storm28      200 prompts x 2 passes, 28-block pool (preemption storm)
  evict-fail   120 prompts x 2 passes, 48 blocks, every key a pass-2 load asks for removed just before
               the load (testbed.faults.RawClientFaults under both connectors): the requests end in errors
  slow-put     120 prompts x 2 passes, 48 blocks, every batch put call 20 ms slower (the same test double)
  loadbound28  200 prompts x 2 passes, 28-block pool, prompts of 4-24 blocks (up to ~85% of the pool) over the
               4 prefixes: a pass-2 request finds room for little besides itself, so it waits for its own
               load and load latency sets the wall time; ways none, ours, ours-mac, ours-off, upstream
  ttft28       60 prompts, 28-block pool, pass 2 open loop at 12.5 requests/s (below)
  ttft48       60 prompts, 48-block pool, pass 2 open loop at 20 requests/s

Open loop (a workload's `rate`): pass 1 runs closed loop as above (it fills the store), then after the
reset pass 2's request i ARRIVES i/rate seconds after the pass starts (a fixed schedule, the same for
every way): the driver adds each request between engine steps once its time has come, and sleeps until the
next arrival when the engine has nothing to do. Per request: TTFT (arrival -> the end of the step after
which the harness holds its first output token; the wait for the step in progress counts, as in an engine
that takes new requests between steps) and time per output token ((finish - first token) / (tokens - 1)),
their p50/p90/p99 over every round's requests pooled, for all requests, store hits (vLLM accepted
external tokens at admission) and misses, with ratios to upstream; beside them where the time goes: arrival
-> admission (the step that gives the request blocks), admission -> first token (ms and steps), the hits
loaded inside their admitting step (sync) and the steps a request waited for remote KV, pass 2's step
times, and those of the steps that admitted a request with the ranks' start_load_kv time in them (where a
sync load runs, on the model runner's thread).

Per way: engine steps, wall time (both passes' step loops), steps in which requests waited while blocks were
held only by save pins ("pin-wait steps"; with the mean of such blocks), store jobs and their pin hold time
(emit -> release, median and p99, ms and steps), the save queue wait (enqueue -> the store thread starts it,
median/p99 over ranks' jobs), request-steps waiting for remote KV (loads), deferrals under the caps (ours;
upstream has no cap), preemptions, store hits (requests and tokens vLLM accepted from the connector,
re-admissions after a preemption included), the keys pass 1 left in the store (`keys`: the master's key
count after pass 1's saves against before; `evict`: keys the master evicted meanwhile), the tokens pass 2's requests were given from the store when
first admitted (`p2 tok`; a request whose prefix another one is still loading loads it again, where a
load that ends in the step finds it in vLLM's cache instead), the prompt tokens pass 2 computed (`p2 comp`:
neither in vLLM's cache nor from the store at first admission), saves given up (`drop`, ours: `saves_dropped`),
wrong KV (positions read wrong before a compute, S7) and leaked blocks at rest. The instrumentation is the
bench's (`Probe`): it wraps instance attributes of the harness's objects and reads their state; nothing in
the shipped code is changed for it.

Each workload runs `--rounds` times (default 3), the ways in a rotating order within each round, so a burst
of load on a shared machine lands on one way's round, not on one way. Steps and wall are the medians over
the rounds (with the range); the other columns are the median-wall round's; the ratios are of the medians.

    python -m bench.scheduler [--quick | --prompts N] [--rounds N] [--only WORKLOAD ...] [--ways WAY ...]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOG_minloglevel", "2")

WAYS = ("none", "ours", "ours-async", "ours-mac", "ours-off", "upstream")
DEFAULT_WAYS = ("none", "ours", "ours-async", "upstream")
CONNECTOR = {"ours-async": "ours", "ours-mac": "ours", "ours-off": "ours"}  # what vLLM loads (default: its name)
OURS_EXTRA = {"ours-async": {"sync_load_max_tokens": 0}, "ours-off": {"integrity": "off"}}
#: same-run targets, printed, never asserted: ours's wall / upstream's per way
WALL_TARGETS = {"ours": 1.00, "ours-mac": 1.05}
FORWARD_S = 0.004  # the stand-in forward's time per step (a small model's decode step on a GPU)
MAX_TOKENS = 40
BLOCK_SIZE = 16
PROMPT = {"num_prefixes": 4, "prefix_len": 48, "suffix_len": 20}


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    quick_prompts: int
    num_blocks: int
    policy: str = "fail"  # vLLM's default kv_load_failure_policy
    fault: str | None = None  # "evict" (pass 2's loads) or "slow" (every put)
    seed: int = 0
    prompt_blocks: tuple[int, int] | None = None  # prompts of lo..hi blocks (default: PROMPT's fixed length)
    ways: tuple[str, ...] = DEFAULT_WAYS
    rate: float | None = None  # pass 2 open loop at this many requests/s (None: closed loop)


WORKLOADS = (
    Workload("pool48", 120, 24, 48, seed=1),
    Workload("storm28", 200, 40, 28, seed=2),
    Workload("evict-fail", 120, 24, 48, fault="evict", seed=3),
    Workload("slow-put", 120, 24, 48, fault="slow", seed=4),
    Workload("loadbound28", 200, 24, 28, seed=5, prompt_blocks=(4, 24),
             ways=("none", "ours", "ours-mac", "ours-off", "upstream")),
    Workload("ttft28", 60, 20, 28, seed=6, rate=12.5),
    Workload("ttft48", 60, 20, 48, seed=7, rate=20.0),
)
SLOW_PUT_S = 0.020


def master_key_counts(metrics_port: int) -> tuple[int, int]:
    """The keys the master holds now and the keys it has evicted so far (its `master_key_count` and
    `master_evicted_key_count` on its loopback metrics port)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        found = dict(line.split()[:2] for line in r.read().decode().splitlines()
                     if line.startswith(("master_key_count ", "master_evicted_key_count ")))
    if len(found) != 2:
        raise RuntimeError(f"master metrics on port {metrics_port}: no master_key_count/master_evicted_key_count")
    return int(float(found["master_key_count"])), int(float(found["master_evicted_key_count"]))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class PinClock(dict):
    """The connector's own pin table (ours: SchedulerLedger._pinned, upstream: _pinned_saves), as a dict
    that notes when each job id is first set (EmitStore) and deleted (released)."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __setitem__(self, k: Any, v: Any) -> None:
        if k not in self:
            self.probe.emitted[k] = (time.perf_counter(), self.probe.step)
        super().__setitem__(k, v)

    def __delitem__(self, k: Any) -> None:
        super().__delitem__(k)
        self.probe.released[k] = (time.perf_counter(), self.probe.step)

    def pop(self, k: Any, *d: Any) -> Any:
        had = k in self
        v = super().pop(k, *d)
        if had:
            self.probe.released[k] = (time.perf_counter(), self.probe.step)
        return v


@dataclass
class Probe:
    """The bench's instrumentation of one harness (see the module doc)."""
    h: Any
    step: int = 0
    emitted: dict[Any, tuple[float, int]] = field(default_factory=dict)
    released: dict[Any, tuple[float, int]] = field(default_factory=dict)
    enqueued: dict[tuple[int, Any], float] = field(default_factory=dict)
    started: dict[tuple[int, Any], float] = field(default_factory=dict)
    ended: dict[tuple[int, Any], float] = field(default_factory=dict)
    pin_wait_steps: int = 0
    pin_wait_blocks: int = 0
    pin_only_block_steps: int = 0
    remote_wait: int = 0
    empty_steps: int = 0
    hits: int = 0
    hit_tokens: int = 0
    p2_first_tokens: dict[str, int] = field(default_factory=dict)  # pass-2 request -> tokens at its admission
    admit_step: dict[str, int] = field(default_factory=dict)  # request -> the first step that gave it blocks
    remote_steps: Counter = field(default_factory=Counter)  # request -> steps it spent in WAITING_FOR_REMOTE_KVS
    load_ms: dict[int, float] = field(default_factory=dict)  # step -> ms in the ranks' start_load_kv (sync loads wait there)
    jobs_by_req: Counter = field(default_factory=Counter)

    def install(self) -> Probe:
        h = self.h
        sched = h.scheduler
        orig_schedule = sched.schedule

        def schedule(*a: Any, **kw: Any) -> Any:
            out = orig_schedule(*a, **kw)
            self.step += 1
            self._sample(out)
            return out
        sched.schedule = schedule
        conn = h.scheduler_connector
        if conn is None:
            return self
        orig_start_loads = h._start_loads

        def _start_loads() -> None:
            t = time.perf_counter()
            try:
                orig_start_loads()
            finally:
                self.load_ms[self.step] = (time.perf_counter() - t) * 1e3
        h._start_loads = _start_loads
        orig_alloc = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens > 0:
                self.hits += 1
                self.hit_tokens += num_external_tokens
            if request.request_id.startswith("p2-"):  # a re-admission after preemption loads again: not new
                self.p2_first_tokens.setdefault(request.request_id, num_external_tokens)
            return orig_alloc(request, blocks, num_external_tokens)
        conn.update_state_after_alloc = update_state_after_alloc
        if h.connector_kind == "ours":
            ledger = conn.scheduler_side.steps.ledger
            assert not ledger._pinned
            ledger._pinned = self.pins = PinClock(self)
            for r, w in enumerate(h.workers):
                self._wrap_ours(r, w.worker_side)
        else:
            cs = conn.connector_scheduler
            assert not cs._pinned_saves
            cs._pinned_saves = self.pins = PinClock(self)
            for r, w in enumerate(h.workers):
                self._wrap_upstream(r, w.connector_worker.kv_send_thread)
        return self

    def _wrap_ours(self, r: int, ws: Any) -> None:
        orig_offer, orig_handle = ws._offer, ws._handle_save

        def _offer(q: Any, item: Any) -> Any:
            if q is ws._store_q:
                self.enqueued[(r, item[0].job_id)] = time.perf_counter()  # a jobs.SaveJob
                if r == 0:
                    self.jobs_by_req[item[0].req_id] += 1
            return orig_offer(q, item)

        def _handle_save(job: Any, event: Any) -> Any:
            self.started[(r, job.job_id)] = time.perf_counter()
            try:
                return orig_handle(job, event)
            finally:
                self.ended[(r, job.job_id)] = time.perf_counter()
        ws._offer, ws._handle_save = _offer, _handle_save

    def _wrap_upstream(self, r: int, st: Any) -> None:
        orig_add, orig_handle = st.add_request, st._handle_request

        def add_request(req: Any) -> Any:
            self.enqueued[(r, req.store_job_id)] = time.perf_counter()
            if r == 0:
                self.jobs_by_req[req.req_id] += 1
            return orig_add(req)

        def _handle_request(req: Any) -> Any:
            self.started[(r, req.store_job_id)] = time.perf_counter()
            try:
                return orig_handle(req)
            finally:
                self.ended[(r, req.store_job_id)] = time.perf_counter()
        st.add_request, st._handle_request = add_request, _handle_request

    def _sample(self, out: Any) -> None:
        from vllm.v1.request import RequestStatus
        if not out.num_scheduled_tokens:
            self.empty_steps += 1
        for rid in out.num_scheduled_tokens:
            self.admit_step.setdefault(rid, self.step)
        waiting = remote = 0
        for req in self.h.scheduler.requests.values():
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                waiting += 1
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                remote += 1
                self.remote_steps[req.request_id] += 1
                self.admit_step.setdefault(req.request_id, self.step)  # its blocks came with an async load
        self.remote_wait += remote
        pins = getattr(self, "pins", None)
        if not pins:
            return
        per_block: Counter = Counter()
        for rec in pins.values():
            for b in rec[0]:
                per_block[b if isinstance(b, int) else b.block_id] += 1
        blocks = self.h.block_pool.blocks
        pin_only = sum(1 for b, n in per_block.items() if blocks[b].ref_cnt <= n)
        self.pin_only_block_steps += pin_only
        if waiting and pin_only:
            self.pin_wait_steps += 1
            self.pin_wait_blocks += pin_only

    def hold(self) -> tuple[list[float], list[int]]:
        ms, steps = [], []
        for j, (t0, s0) in self.emitted.items():
            if j in self.released:
                t1, s1 = self.released[j]
                ms.append((t1 - t0) * 1e3)
                steps.append(s1 - s0)
        return ms, steps

    def queue_wait_ms(self) -> list[float]:
        return [(self.started[k] - t) * 1e3 for k, t in self.enqueued.items() if k in self.started]

    def run_ms(self) -> list[float]:
        return [(self.ended[k] - t) * 1e3 for k, t in self.started.items() if k in self.ended]

    def report_to_release_ms(self) -> list[float]:
        """Last rank's handler end -> the pin's release (waiting for the next step's collect)."""
        out = []
        for j, (t1, _) in self.released.items():
            ends = [t for (r, jj), t in self.ended.items() if jj == j]
            if ends:
                out.append((t1 - max(ends)) * 1e3)
        return out


def arrival_schedule(n: int, rate: float) -> list[float]:
    """Open loop: request i arrives i/rate seconds after its pass starts (fixed, so every way and round sees
    the same arrivals)."""
    if not rate > 0:
        raise ValueError(f"Workload.rate must be a positive number of requests/s, got {rate!r}")
    return [i / rate for i in range(n)]


@dataclass
class RequestTimes:
    """One open-loop request: its times (s after its pass started) and the engine steps around them."""
    arrival: float  # its scheduled arrival
    arrival_step: int  # steps the engine had taken when it was added
    first: float | None = None  # end of the step after which it had its first output token
    first_step: int | None = None
    finish: float | None = None  # end of the step after which it had finished
    tokens: int = 0
    hit: bool = False  # took tokens from the store at admission (vLLM's accepted external tokens)
    admit: float | None = None  # start of the step that first gave it blocks
    admit_step: int | None = None
    remote_steps: int = 0  # steps in WAITING_FOR_REMOTE_KVS (0 for a hit: loaded inside its admitting step)

    @property
    def ttft_ms(self) -> float:
        return (self.first - self.arrival) * 1e3  # type: ignore[operator]

    @property
    def tpot_ms(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.finish - self.first) / (self.tokens - 1) * 1e3  # type: ignore[operator]


def run_open_loop(h: Any, probe: Probe, reqs: list[tuple[str, list[int]]], rate: float, *,
                  timeout_s: float = 900.0) -> tuple[dict[str, RequestTimes], dict[int, float]]:
    """Run ``reqs`` to the end, each added between steps once its arrival (`arrival_schedule`) has come,
    sleeping until the next arrival while the engine has nothing (`Harness.step` False). Returns each
    request's times (first token and finish read from the harness's outputs after every step) and every
    step's wall time (probe step number -> ms)."""
    arrivals = arrival_schedule(len(reqs), rate)
    times: dict[str, RequestTimes] = {}
    no_token: set[str] = set()  # added, no output token yet
    running: set[str] = set()  # added, not finished
    step_ms: dict[int, float] = {}
    step_start: dict[int, float] = {}  # probe step number -> its start (s after the pass started)
    nxt = 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        while nxt < len(reqs) and arrivals[nxt] <= now:
            rid, prompt = reqs[nxt]
            h.add_request(rid, prompt, MAX_TOKENS)
            times[rid] = RequestTimes(arrivals[nxt], probe.step)
            no_token.add(rid)
            running.add(rid)
            nxt += 1
        before, start = probe.step, time.perf_counter() - t0
        if not h.step():  # nothing left in the engine
            if nxt == len(reqs):
                break
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        end = time.perf_counter() - t0
        if probe.step > before:
            step_start[probe.step] = start
            step_ms[probe.step] = (end - start) * 1e3
        for rid in [r for r in no_token if h.stats.outputs.get(r)]:
            times[rid].first, times[rid].first_step = end, probe.step
            no_token.discard(rid)
        for rid in [r for r in running if r in h.stats.finished]:
            times[rid].finish = end
            times[rid].tokens = len(h.stats.outputs[rid])
            running.discard(rid)
        if end > timeout_s:
            raise TimeoutError(f"open loop still busy after {timeout_s:.0f} s: {len(running)} requests running")
    for rid, rt in times.items():
        rt.hit = probe.p2_first_tokens.get(rid, 0) > 0
        rt.admit_step = probe.admit_step.get(rid)
        rt.admit = step_start.get(rt.admit_step) if rt.admit_step is not None else None
        rt.remote_steps = probe.remote_steps.get(rid, 0)
    return times, step_ms


def _wrap_raw(h: Any, **kw: Any) -> list[Any]:
    """Put RawClientFaults under every worker rank's store calls (ours or upstream)."""
    from testbed.faults import wrap_raw_clients
    return wrap_raw_clients(h, **kw)


def prompts_of(wl: Workload, n: int) -> list[list[int]]:
    """The workload's prompts: PROMPT's shared-prefix prompts, or with ``prompt_blocks`` each of PROMPT's
    prefixes followed by a unique suffix to a length drawn uniformly from lo..hi blocks (deterministic)."""
    from testbed.harness import shared_prefix_prompts
    if wl.prompt_blocks is None:
        return shared_prefix_prompts(n, seed=wl.seed, **PROMPT)
    lo, hi = (b * BLOCK_SIZE for b in wl.prompt_blocks)
    rng = random.Random(wl.seed)
    base = shared_prefix_prompts(n, seed=wl.seed, **{**PROMPT, "suffix_len": hi - PROMPT["prefix_len"]})
    return [p[:rng.randint(lo, hi)] for p in base]


def _extra(way: str, workdir: str) -> dict[str, Any] | None:
    """The way's kv_connector_extra_config (ours-mac: a secret file written into the run's private workdir)."""
    if way == "upstream":
        return {"cache_prefix": uuid.uuid4().hex[:8]}  # upstream's keys: this run's
    if way == "ours-mac":
        path = os.path.join(workdir, "integrity.secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        return {"integrity_secret_file": path}
    return OURS_EXTRA.get(way)


def run_way(way: str, wl: Workload, n: int, store_config: Any, workdir: str, *,
            reuse_ids: bool = False, count_keys: Callable[[], tuple[int, int]] | None = None) -> dict[str, Any]:
    from testbed.harness import Harness, expected_output
    prompts = prompts_of(wl, n)
    extra = _extra(way, workdir)
    res: dict[str, Any] = {"way": way}
    connector = CONNECTOR.get(way, way)
    with Harness(store_config, tp_size=2, num_blocks=wl.num_blocks, policy=wl.policy, max_num_seqs=8,
                 max_num_batched_tokens=128, connector=connector, extra=extra, workdir=workdir,
                 stall_timeout_s=60, forward_s=FORWARD_S, block_size=BLOCK_SIZE) as h:
        probe = Probe(h).install()
        raws = _wrap_raw(h, put_delay_s=SLOW_PUT_S) if wl.fault == "slow" and way != "none" else []
        wall = 0.0
        keys0 = count_keys() if count_keys else (0, 0)
        keys = evicted = 0
        for p in (1, 2):
            if p == 2:
                h.reset_prefix_cache_when_idle()  # idle: every save of pass 1 has ended
                if count_keys:
                    now = count_keys()
                    keys, evicted = now[0] - keys0[0], now[1] - keys0[1]
                if wl.fault == "evict" and way != "none":
                    raws = _wrap_raw(h, evict_before_get=True)
            ids = [f"req-{i}" if reuse_ids else f"p{p}-req-{i}" for i in range(len(prompts))]
            t = time.perf_counter()
            if p == 2 and wl.rate is not None:
                times, step_ms = run_open_loop(h, probe, list(zip(ids, prompts)), wl.rate)
                admitting = {rt.admit_step for rt in times.values()}
                res["open_loop"], res["step_ms"] = list(times.values()), list(step_ms.values())
                res["admit_step_ms"] = [ms for k, ms in step_ms.items() if k in admitting]
                res["admit_load_ms"] = [probe.load_ms[k] for k in step_ms if k in admitting and k in probe.load_ms]
            else:
                for rid, pr in zip(ids, prompts):
                    h.add_request(rid, pr, MAX_TOKENS)
                t = time.perf_counter()
                h.run(max_steps=200_000, timeout_s=900)
            wall += time.perf_counter() - t
        wrong_out = errors = 0
        for p in ((2,) if reuse_ids else (1, 2)):
            for i, pr in enumerate(prompts):
                rid = f"req-{i}" if reuse_ids else f"p{p}-req-{i}"
                reason = h.stats.finished.get(rid)
                if reason == "error":
                    errors += 1
                elif h.stats.outputs.get(rid) != expected_output(pr, MAX_TOKENS):
                    wrong_out += 1
        problems = h.check_at_rest()
        ms, steps = probe.hold()
        qw, run, rel = probe.queue_wait_ms(), probe.run_ms(), probe.report_to_release_ms()
        ours = connector == "ours"
        ikey = h.scheduler_connector.integrity if ours else None
        res.update({
            "integrity": f"{ikey.mode}, {ikey.construction}" if ikey is not None and ikey.enabled else
            ("off" if ours else None),
            "steps": h.stats.steps, "wall": wall, "empty_steps": probe.empty_steps,
            "pin_wait_steps": probe.pin_wait_steps,
            "pin_wait_blocks": probe.pin_wait_blocks / probe.pin_wait_steps if probe.pin_wait_steps else 0.0,
            "pin_only_block_steps": probe.pin_only_block_steps,
            "jobs": len(probe.emitted), "hold_ms": ms, "hold_steps": steps,
            "queue_ms": qw, "run_ms": run, "collect_ms": rel,
            "remote_wait": probe.remote_wait,
            "deferrals": h.scheduler_connector.stats.total("deferrals") if ours else None,
            "sync_loads": h.scheduler_connector.scheduler_side.steps.stats.total("sync_loads") if ours else None,
            "pin_cap": (h.scheduler_connector.scheduler_side.steps.max_pinned_blocks if ours else None),
            "preemptions": h.stats.preemptions, "hits": probe.hits, "hit_tokens": probe.hit_tokens,
            "keys": keys, "evicted": evicted, "p2_tokens": sum(probe.p2_first_tokens.values()),
            "p2_computed": sum(len(pr) - h.stats.local_hit_tokens.get(f"p2-req-{i}", 0)
                               - probe.p2_first_tokens.get(f"p2-req-{i}", 0) for i, pr in enumerate(prompts))
            if not reuse_ids else None,
            "saves_dropped": h.scheduler_connector.scheduler_side.steps.stats.total("saves_dropped") if ours else None,
            "wrong_kv": len(h.garbage), "wrong_out": wrong_out, "errors": errors,
            "leaked": h.num_blocks - 1 - h.block_pool.get_num_free_blocks(), "at_rest": problems,
            "jobs_per_req": (statistics.mean(probe.jobs_by_req.values()) if probe.jobs_by_req else 0.0),
            "push_work_steps": h.stats.push_work_steps,
            "faults": sum(r.num_delayed_puts + r.num_evicted_keys for r in raws),
        })
    return res


def _f(v: Any, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else format(v, f">{width}{spec}")


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's rounds as one row: the median-wall round's figures, with steps and wall the medians over
    the rounds and their ranges kept; a way that failed in any round is failed."""
    failed = [r for r in runs if "failed" in r]
    if failed:
        return failed[0]
    by_wall = sorted(runs, key=lambda r: r["wall"])
    row = dict(by_wall[(len(by_wall) - 1) // 2])
    row["steps"] = int(statistics.median(r["steps"] for r in runs))
    row["wall"] = statistics.median(r["wall"] for r in runs)
    row["steps_range"] = (min(r["steps"] for r in runs), max(r["steps"] for r in runs))
    row["wall_range"] = (by_wall[0]["wall"], by_wall[-1]["wall"])
    row["rounds"] = len(runs)
    for k in ("wrong_kv", "wrong_out", "leaked", "errors"):  # worst round: a fault in any round shows
        row[k] = max(r[k] for r in runs)
    row["at_rest"] = next((r["at_rest"] for r in runs if r["at_rest"]), [])
    if "open_loop" in row:  # open loop: every round's requests and steps pooled
        row["ttft_p50_rounds"] = [_pct([rt.ttft_ms for rt in r["open_loop"] if rt.first is not None], .5)
                                  for r in runs]
        row["open_loop"] = [rt for r in runs for rt in r["open_loop"]]
        row["step_ms"] = [ms for r in runs for ms in r["step_ms"]]
        row["admit_step_ms"] = [ms for r in runs for ms in r["admit_step_ms"]]
        row["admit_load_ms"] = [ms for r in runs for ms in r["admit_load_ms"]]
    return row


def print_table(wl: Workload, n: int, rows: dict[str, dict[str, Any]]) -> None:
    rounds = max((r.get("rounds", 1) for r in rows.values()), default=1)
    lengths = ("prompts of %d-%d blocks" % wl.prompt_blocks if wl.prompt_blocks else
               f"prompts of {PROMPT['prefix_len'] + PROMPT['suffix_len']} tokens")
    print(f"\n{wl.name}: {n} prompts x 2 passes, {wl.num_blocks}-block pool, {lengths}, policy {wl.policy}"
          + (f", fault {wl.fault}" if wl.fault else "") + (f", pass 2 open loop at {wl.rate:g}/s" if wl.rate else "")
          + f" (2 ranks, max_num_seqs 8, 128 tokens/step; "
          f"steps and wall: medians of {rounds} rounds)")
    hdr = (f"{'way':<11}{'steps':>7}{'wall s':>8}{'empty':>7}{'pinwait':>8}{'blk':>5}{'jobs':>6}{'j/req':>6}"
           f"{'hold ms p50':>12}{'p99':>8}{'hold st p50':>12}{'p99':>6}{'queue ms p50':>13}{'p99':>8}"
           f"{'remote':>7}{'sync':>6}{'defer':>6}{'preempt':>8}{'hits':>5}{'hit tok':>8}{'keys':>6}{'evict':>6}{'p2 tok':>7}{'p2 comp':>8}"
           f"{'drop':>5}{'wrongKV':>8}{'leak':>5}{'err':>5}")
    print(hdr)
    for way in WAYS:
        r = rows.get(way)
        if r is None:
            continue
        if "failed" in r:
            print(f"{way:<11} failed: {r['failed']}")
            continue
        print(f"{way:<11}{r['steps']:>7}{r['wall']:>8.1f}{r['empty_steps']:>7}{r['pin_wait_steps']:>8}"
              f"{r['pin_wait_blocks']:>5.1f}{r['jobs']:>6}{r['jobs_per_req']:>6.1f}"
              f"{_f(statistics.median(r['hold_ms']) if r['hold_ms'] else None, '.1f', 12)}"
              f"{_f(_pct(r['hold_ms'], .99), '.1f', 8)}"
              f"{_f(statistics.median(r['hold_steps']) if r['hold_steps'] else None, '.0f', 12)}"
              f"{_f(_pct(r['hold_steps'], .99), '.0f', 6)}"
              f"{_f(statistics.median(r['queue_ms']) if r['queue_ms'] else None, '.1f', 13)}"
              f"{_f(_pct(r['queue_ms'], .99), '.1f', 8)}"
              f"{r['remote_wait']:>7}{_f(r['sync_loads'], 'd', 6)}{_f(r['deferrals'], 'd', 6)}{r['preemptions']:>8}{r['hits']:>5}"
              f"{r['hit_tokens']:>8}{r['keys']:>6}{r['evicted']:>6}{r['p2_tokens']:>7}{_f(r['p2_computed'], 'd', 8)}{_f(r['saves_dropped'], 'd', 5)}"
              f"{r['wrong_kv'] + r['wrong_out']:>8}{r['leaked']:>5}{r['errors']:>5}")
        if r["run_ms"]:
            print(f"   {way}: store job run ms p50 {statistics.median(r['run_ms']):.1f} p99 "
                  f"{_pct(r['run_ms'], .99):.1f}; last report -> release ms p50 "
                  f"{statistics.median(r['collect_ms']) if r['collect_ms'] else 0:.1f} p99 "
                  f"{_pct(r['collect_ms'], .99) or 0:.1f}; pin-only block-steps {r['pin_only_block_steps']}; "
                  f"steps with only pins left {r['push_work_steps']}; wall per step "
                  f"{r['wall'] / r['steps'] * 1e3:.2f} ms")
        if r.get("rounds", 1) > 1:
            print(f"   {way}: over {r['rounds']} rounds steps {r['steps_range'][0]}-{r['steps_range'][1]}, "
                  f"wall {r['wall_range'][0]:.1f}-{r['wall_range'][1]:.1f} s")
        if r.get("integrity"):
            print(f"   {way}: integrity {r['integrity']}")
        if r["at_rest"]:
            print(f"   {way} not at rest: {r['at_rest'][:3]}")
    u = rows.get("upstream")
    for name in WAYS:
        o = rows.get(name)
        if CONNECTOR.get(name, name) == "ours" and o and u and "failed" not in o and "failed" not in u:
            target = WALL_TARGETS.get(name)
            print(f"{name}/upstream: steps {o['steps'] / u['steps']:.2f}, wall {o['wall'] / u['wall']:.2f}"
                  + (f" (target <= {target:.2f})" if target is not None else "")
                  + (f"; ours pin cap {o['pin_cap']} blocks" if name == "ours" else ""))


def ttft_summary(recs: list[RequestTimes]) -> dict[str, Any]:
    """Percentiles of one group of open-loop requests (ms; a request with no first token, e.g. one that
    ended in an error, is counted apart)."""
    done = [r for r in recs if r.first is not None]
    ttft = [r.ttft_ms for r in done]
    tpot = [x for x in (r.tpot_ms for r in done if r.finish is not None) if x is not None]
    wait = [(r.admit - r.arrival) * 1e3 for r in done if r.admit is not None]
    load = [(r.first - r.admit) * 1e3 for r in done if r.admit is not None]  # type: ignore[operator]
    load_steps = [float(r.first_step - r.admit_step) for r in done  # type: ignore[operator]
                  if r.admit_step is not None]
    hits = [r for r in done if r.hit]
    return {"n": len(recs), "no_token": len(recs) - len(done),
            **{f"ttft{q}": _pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"tpot{q}": _pct(tpot, q / 100) for q in (50, 90)},
            "wait50": _pct(wait, .5), "wait90": _pct(wait, .9), "load50": _pct(load, .5), "load90": _pct(load, .9),
            "load_steps50": _pct(load_steps, .5),
            "sync": sum(1 for r in hits if r.remote_steps == 0) if hits else None,
            "remote": statistics.mean(r.remote_steps for r in done) if done else None}


def _groups(recs: list[RequestTimes]) -> dict[str, list[RequestTimes]]:
    """All requests, store hits and misses (a group left out when empty)."""
    g = {"all": recs, "hit": [r for r in recs if r.hit], "miss": [r for r in recs if not r.hit]}
    return {k: v for k, v in g.items() if v}


def print_ttft_table(wl: Workload, n: int, rows: dict[str, dict[str, Any]]) -> None:
    """The open-loop figures of pass 2 per way and group, and their ratios to upstream."""
    rounds = max((r.get("rounds", 1) for r in rows.values()), default=1)
    print(f"\n{wl.name} open loop: pass 2's {n} requests arriving at {wl.rate:g}/s (request i at i/rate s), "
          f"{wl.num_blocks}-block pool; percentiles over {rounds} rounds' requests pooled, ms")
    print(f"{'way':<11}{'group':<6}{'n':>5}{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'TPOT p50':>9}{'p90':>6}"
          f"{'arr->adm p50':>13}{'p90':>7}{'adm->1st p50':>13}{'p90':>7}{'steps':>6}{'sync':>6}{'remote/req':>11}"
          f"{'no tok':>7}")
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    for way in WAYS:
        r = rows.get(way)
        if r is None or "failed" in r:
            continue
        summaries[way] = {g: ttft_summary(recs) for g, recs in _groups(r["open_loop"]).items()}
        for g, m in summaries[way].items():
            print(f"{way:<11}{g:<6}{m['n']:>5}{_f(m['ttft50'], '.1f', 9)}{_f(m['ttft90'], '.1f', 7)}"
                  f"{_f(m['ttft99'], '.1f', 7)}{_f(m['tpot50'], '.2f', 9)}{_f(m['tpot90'], '.2f', 6)}"
                  f"{_f(m['wait50'], '.1f', 13)}{_f(m['wait90'], '.1f', 7)}{_f(m['load50'], '.1f', 13)}"
                  f"{_f(m['load90'], '.1f', 7)}{_f(m['load_steps50'], '.0f', 6)}{_f(m['sync'], 'd', 6)}"
                  f"{_f(m['remote'], '.2f', 11)}{m['no_token']:>7}")
        sm, am = r["step_ms"], r["admit_step_ms"]
        print(f"   {way}: pass-2 step ms mean {statistics.mean(sm):.2f} p50 {_pct(sm, .5):.2f} p90 "
              f"{_pct(sm, .9):.2f} ({len(sm)} steps over {r.get('rounds', 1)} rounds), the {len(am)} steps that "
              f"admitted a request p50 {_f(_pct(am, .5), '.2f', 0)} p90 {_f(_pct(am, .9), '.2f', 0)} (their "
              f"start_load_kv p50 {_f(_pct(r['admit_load_ms'], .5), '.2f', 0)} p90 {_f(_pct(r['admit_load_ms'], .9), '.2f', 0)})"
              "; TTFT p50 per round "
              + " ".join("-" if x is None else f"{x:.1f}" for x in r.get("ttft_p50_rounds", [])))
    u = summaries.get("upstream")
    for way, m in summaries.items():
        if way == "upstream" or u is None:
            continue
        parts = []
        for g in ("all", "hit"):
            if g in m and g in u:
                ratios = [(k, m[g][k], u[g][k]) for k in ("ttft50", "ttft90", "ttft99", "tpot50")]
                parts.append(f"{g}: " + ", ".join(f"{k.replace('ttft', 'TTFT p').replace('tpot', 'TPOT p')} "
                                                  + (f"{a / b:.2f}" if a is not None and b else "-")
                                                  for k, a, b in ratios))
        print(f"{way}/upstream: " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer prompts per workload")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per workload (overrides --quick)")
    ap.add_argument("--only", nargs="*", default=None, help="workload names")
    ap.add_argument("--ways", nargs="*", default=None, choices=WAYS,
                    help="only these ways (default: each workload's own)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each way per workload (medians)")
    ap.add_argument("--reuse-ids", action="store_true",
                    help="the same request ids in both passes (upstream then hangs in pass 2, bench/engine.py)")
    args = ap.parse_args([] if argv is None else argv)
    from kvledger_connector.config import StoreConfig
    from testbed.procs import mooncake_servers
    rc = 0
    with mooncake_servers(rpc_timeout_ms=5000) as mc:
        cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=16 << 20,
                          rpc_timeout_ms=5000).with_addresses(mc.master_address, mc.metadata_server)
        for k, wl in enumerate(WORKLOADS):
            if args.only and wl.name not in args.only:
                continue
            n = args.prompts or (wl.quick_prompts if args.quick else wl.prompts)
            runs: dict[str, list[dict[str, Any]]] = {}
            ways = [w for w in wl.ways if args.ways is None or w in args.ways]
            if not ways:
                continue
            for rnd in range(max(1, args.rounds)):
                s = (k + rnd) % len(ways)
                for way in ways[s:] + ways[:s]:  # rotate: drift spreads over the ways
                    with tempfile.TemporaryDirectory(prefix=f"kvledger-bench-sched-{way}-") as wd:
                        try:
                            res = run_way(way, wl, n, cfg, wd, reuse_ids=args.reuse_ids,
                                          count_keys=lambda: master_key_counts(mc.metrics_port))
                        except Exception as e:  # a bench: say what failed and go on
                            res = {"failed": f"{type(e).__name__}: {e}"[:300]}
                            rc = 1 if way != "upstream" else rc
                    runs.setdefault(way, []).append(res)
                    print(f"[bench.scheduler] {wl.name} round {rnd + 1} {way}: done", flush=True)
            rows = {way: median_row(rs) for way, rs in runs.items()}
            print_table(wl, n, rows)
            if wl.rate is not None:
                print_ttft_table(wl, n, rows)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
