"""Connector telemetry: the connector's one counter system. Every event is counted once, with
`StatsRecorder.add` (directly, or through the parts it is handed to as their ``stats`` / ``counts``: the
ledgers, the store, the scheduler's store calls, the KV events, the resets' removals), into the interval
that vLLM takes as its `KVConnectorStats` (logged each interval and handed to Prometheus,
`KVLedgerPromMetrics`) and into the whole-run `totals` (tests, demos, benches:
`StatsRecorder.total`). A name must be declared in COUNTERS / GAUGES: a counter cannot exist without its
Prometheus metric.

One flat dict of numbers per interval, so that merging ranks is a sum and the payload stays bounded
whatever the traffic (upstream keeps one row per RPC; we keep counters and duration sums):

    counters   store calls: puts, put_keys, put_bytes, put_failed_keys, gets, get_keys, get_bytes,
               store_exceptions (a store call raised; its keys count as CLIENT_EXCEPTION)
               scheduler: lookups, lookup_hit_tokens, loaded_tokens, store_jobs, tail_saves, deferrals,
               saves_dropped (given up: the request finished while its save was deferred and
               `max_held_requests` were held, or the job could never be admitted), held_requests (a
               request finished while its save was deferred: vLLM keeps its blocks until that save is stored),
               kept_blocks (blocks vLLM gave back while their job was deferred, saved from its prefix cache:
               Mamba states, sliding-window blocks), expired_kept_blocks (not saved: evicted first),
               failed_load_requeues (a request whose async load failed under recompute skipped once, so vLLM
               moves it out of the head of its KV-holding queue),
               hook_errors (an input a scheduler hook could not serve: logged, never raised into vLLM),
               save_errors (a request's save given up on such an input), refused_loads (a load that could
               not be planned, reported failed)
               worker rank, store jobs: run_jobs, stale_jobs, skipped_jobs (DmaRead's verdict), rejected_jobs
               (queue full or shut down: reported unrun), failed_jobs (a put failed, or the handler raised)
               worker rank, loads: loads (begun), rejected_loads (queue full), load_errors_reported (blocks)
               the ledgers (kvledger, given this recorder as ``counts``): jobs_released (every rank reported
               the job), unknown_reports (a report of no job in flight), loads_pinned, loads_released (load
               pins), loads_finished (a rank's loads, LoadLedger)
               worker rank, specs: refused_specs (a malformed spec, refused whole: worker/steps.py), integrity removals
               not queued: integrity_removals_dropped (more than jobs.MAX_PENDING_REMOVALS waiting)
               kv_events_dropped, kv_events_stored_blocks, kv_events_removed_blocks (blocks announced in
               BlockStored / BlockRemoved events, telemetry/events.py), resets, resets_refused (logged with why),
               weights_version_switches (the keys moved to a new weights version at a reset); the resets'
               removals (scheduler/reset.py, their own thread): reset_removals (patterns removed),
               reset_removed_keys, reset_removal_retries, reset_removals_given_up (after REMOVAL_ATTEMPTS
               tries), reset_removals_dropped (more than MAX_PENDING_REMOVALS waiting)
               the store's breaker (store/breaker.py): breaker_trips (it opened), breaker_probes (probes sent),
               master_unauthentic (it opened because the listener on the embedded master's port was not the
               master this process joined: gone, or another process's), store_close_leaked (a close that
               left the client open: a call was still inside it), master_restarts (the embedded master
               restarted by its supervisor, store/embedded.py, counted where its owner hands a recorder);
               lookups_past_deadline (store/deadline.py: a scheduler store call answered as a miss at its deadline),
               lookups_skipped_busy (store/deadline.py: answered at once, an abandoned call still inside the store),
               lookups_deferred (store/deadline.py: a lookup unanswered within the step's wait, asked again next step)
    durations  put_s, get_s, lookup_s (sums; the count is puts / gets / lookups)
    latency    h.<op>.<i> → calls, hs.<op>.<i> → their seconds, for op in put, get, lookup and i the index of
               the first bound of LATENCY_BUCKETS_S at or above the call's duration (len: above them all);
               at most 2 × (len + 1) numbers per op whatever the traffic, merged by sum
    gauges     pins_in_flight, pinned_blocks (scheduler side; merged with max)
    failures   fail_code.<code> → keys (at most MAX_CODES distinct codes, the rest under fail_code.other)

Prometheus: a counter per counter, a gauge per gauge, failures by code, and one histogram per op
(``vllm:kvledger_{put,get,lookup}_seconds``). A histogram is rebuilt exactly from an interval's buckets: each
bucket's calls are observed at their mean duration, which lies in that bucket, so bucket counts, count and sum
are those of the calls themselves (upstream sends one row per RPC instead).

What is timed: put = one ``batch_put`` of a store job, get = one ``batch_get`` sub-batch of a load (both on
the worker's store threads: every ``put_s`` / ``get_s`` the worker adds is one call), lookup = one
``batch_is_exist`` of the scheduler's prefix lookup (`kvledger_connector.store.deadline.DeadlineStore`).
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvledger.errors import LedgerInputError

COUNTERS = (
    "puts", "put_keys", "put_bytes", "put_failed_keys", "full_put_retries", "full_put_retried_keys",
    "gets", "get_keys", "get_bytes", "store_exceptions", "integrity_mismatches",
    "lookups", "lookup_hit_tokens", "loaded_tokens",
    "store_jobs", "tail_saves", "deferrals", "saves_dropped", "held_requests", "kept_blocks", "expired_kept_blocks",
    "failed_load_requeues", "sent_tables_evicted", "loads_emitted", "sync_loads", "async_after_failures", "tail_hits",
    "hook_errors", "save_errors", "refused_loads",
    "run_jobs", "stale_jobs", "skipped_jobs", "rejected_jobs", "failed_jobs",
    "loads", "rejected_loads", "load_errors_reported", "refused_specs", "integrity_removals_dropped",
    "put_s", "get_s", "lookup_s",
    "kv_events_dropped", "resets", "resets_refused", "weights_version_switches",
    "reset_removed_keys", "reset_removal_retries", "reset_removals_given_up", "reset_removals_dropped",
    "jobs_released", "unknown_reports", "loads_pinned", "loads_released", "loads_finished",
    "kv_events_stored_blocks", "kv_events_removed_blocks", "reset_removals",
    "breaker_trips", "breaker_probes", "master_unauthentic", "store_close_leaked", "master_restarts",
    "lookups_past_deadline", "lookups_skipped_busy", "lookups_deferred",
)
GAUGES = ("pins_in_flight", "pinned_blocks")
#: ops with a latency histogram, by the duration counter whose every add is one call
TIMED_OPS = {"put_s": "put", "get_s": "get", "lookup_s": "lookup"}
#: histogram bounds (seconds): loopback TCP calls take ~0.1-1 ms, RPCs to a dead master up to rpc_timeout_ms
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
_HIST_PREFIXES = ("h.", "hs.")
MAX_CODES = 16  # distinct failure codes kept per interval (bounded payload)
_CODE_PREFIX = "fail_code."


@dataclass
class KVLedgerStats(KVConnectorStats):
    """Numbers of one interval; `aggregate` sums counters and takes the max of gauges."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def gauge(self, name: str, value: float) -> None:
        self.data[name] = value

    def fail_code(self, code: int, keys: int = 1) -> None:
        name = f"{_CODE_PREFIX}{code}"
        if name not in self.data and sum(k.startswith(_CODE_PREFIX) for k in self.data) >= MAX_CODES:
            name = f"{_CODE_PREFIX}other"
        self.add(name, keys)

    def observe(self, op: str, seconds: float) -> None:
        """One call of `op` that took `seconds`, into its latency bucket."""
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        self.add(f"h.{op}.{i}")
        self.add(f"hs.{op}.{i}", seconds)

    def latency(self, op: str) -> list[tuple[int, float]]:
        """(calls, seconds) per bucket of `op` (index as in LATENCY_BUCKETS_S, the last one above them all)."""
        return [(int(self.data.get(f"h.{op}.{i}", 0)), float(self.data.get(f"hs.{op}.{i}", 0.0)))
                for i in range(len(LATENCY_BUCKETS_S) + 1)]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = max(self.data.get(name, 0), value)
            elif name.startswith(_CODE_PREFIX):
                self.fail_code(name[len(_CODE_PREFIX):], value)  # type: ignore[arg-type]
            else:
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data.items())
                                       if k not in TIMED_OPS and not k.startswith(_HIST_PREFIXES)}
        for op in ("put", "get", "lookup"):
            n = self.data.get(f"{op}s", 0)
            if n:
                out[f"{op}_avg_ms"] = round(self.data.get(f"{op}_s", 0.0) / n * 1e3, 3)
        return out


_COUNTER_NAMES = frozenset(COUNTERS)
_GAUGE_NAMES = frozenset(GAUGES)


class StatsRecorder:
    """Thread-safe accumulator shared by the store/load threads and the step hooks; `take()` swaps the
    interval out (vLLM, Prometheus), `totals` keeps the whole run. A `kvledger.counts.Counter` (``add``,
    ``total``): the ledgers and the store's parts count into it when handed it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVLedgerStats()
        self.totals = KVLedgerStats()  # whole-run numbers (demo report, tests)

    def add(self, name: str, value: float = 1) -> None:
        """Add to a counter; a duration counter's add (`TIMED_OPS`) is one call, also kept in its histogram."""
        if name not in _COUNTER_NAMES:
            raise LedgerInputError("counter", name, "not declared in kvledger_connector.telemetry.stats.COUNTERS")
        op = TIMED_OPS.get(name)
        with self._lock:
            self._stats.add(name, value)
            self.totals.add(name, value)
            if op is not None:
                self._stats.observe(op, value)
                self.totals.observe(op, value)

    def gauge(self, name: str, value: float) -> None:
        if name not in _GAUGE_NAMES:
            raise LedgerInputError("gauge", name, "not declared in kvledger_connector.telemetry.stats.GAUGES")
        with self._lock:
            self._stats.gauge(name, value)
            self.totals.gauge(name, max(value, self.totals.data.get(name, 0)))  # totals keep the peak

    def fail_code(self, code: int, keys: int = 1) -> None:
        with self._lock:
            self._stats.fail_code(code, keys)
            self.totals.fail_code(code, keys)

    def total(self, name: str) -> float:
        """The whole-run value of counter (or peak of gauge) ``name``; 0 if never added."""
        with self._lock:
            return self.totals.data.get(name, 0)

    def take(self) -> KVLedgerStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVLedgerStats()
        return None if stats.is_empty() else stats


class KVLedgerPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters (per counter name) and gauges, labelled like vLLM's other engine metrics."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvledger_{name}_total",
                                    documentation=f"kvledger connector: {name.replace('_', ' ')}",
                                    labelnames=labelnames)
            for name in COUNTERS
        }
        self._gauges = {
            name: self._gauge_cls(name=f"vllm:kvledger_{name}",
                                  documentation=f"kvledger connector: {name.replace('_', ' ')}",
                                  labelnames=labelnames, multiprocess_mode="mostrecent")
            for name in GAUGES
        }
        self._failures = self._counter_cls(name="vllm:kvledger_store_failures_total",
                                           documentation="kvledger connector: failed keys by store code",
                                           labelnames=labelnames + ["code"])
        self._latency = {
            op: self._histogram_cls(name=f"vllm:kvledger_{op}_seconds",
                                    documentation=f"kvledger connector: duration of one store {op} call",
                                    labelnames=labelnames, buckets=list(LATENCY_BUCKETS_S))
            for op in TIMED_OPS.values()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
            elif name in self._gauges:
                self._gauges[name].labels(*labels).set(value)
            elif name.startswith(_CODE_PREFIX) and value:
                self._failures.labels(*labels, name[len(_CODE_PREFIX):]).inc(value)
        for op, hist in self._latency.items():
            child = None
            for i in range(len(LATENCY_BUCKETS_S) + 1):
                calls = int(transfer_stats_data.get(f"h.{op}.{i}", 0))
                if calls <= 0:
                    continue
                child = child or hist.labels(*labels)
                for _ in range(calls):
                    child.observe(_in_bucket(i, float(transfer_stats_data.get(f"hs.{op}.{i}", 0.0)) / calls))


def _in_bucket(i: int, mean: float) -> float:
    """`mean` (of calls that fell in bucket i) kept inside bucket i against rounding: (bound[i-1], bound[i]]."""
    if i < len(LATENCY_BUCKETS_S):
        mean = min(mean, LATENCY_BUCKETS_S[i])
    if i > 0:
        mean = max(mean, math.nextafter(LATENCY_BUCKETS_S[i - 1], math.inf))
    return mean

