"""Connector telemetry: vLLM `KVConnectorStats` (logged each interval) and Prometheus metrics.

One flat dict of numbers per interval, so that merging ranks is a sum and the payload stays bounded
whatever the traffic (upstream keeps one row per RPC; we keep counters and duration sums):

    counters   puts, put_keys, put_bytes, put_failed_keys, gets, get_keys, get_bytes, get_failed_keys,
               lookups, lookup_hit_tokens, loaded_tokens, store_jobs, stale_jobs, skipped_jobs,
               deferrals, load_errors_reported, rejected_jobs
    durations  put_s, get_s (sums; the count is puts / gets)
    gauges     pins_in_flight, pinned_blocks (scheduler side; merged with max)
    failures   fail_code.<code> → keys (at most MAX_CODES distinct codes, the rest under fail_code.other)
"""
from __future__ import annotations

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

COUNTERS = (
    "puts", "put_keys", "put_bytes", "put_failed_keys",
    "gets", "get_keys", "get_bytes", "get_failed_keys",
    "lookups", "lookup_hit_tokens", "loaded_tokens",
    "store_jobs", "stale_jobs", "skipped_jobs", "deferrals", "load_errors_reported", "rejected_jobs",
    "put_s", "get_s",
)
GAUGES = ("pins_in_flight", "pinned_blocks")
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
                                       if k not in ("put_s", "get_s")}
        for op in ("put", "get"):
            n = self.data.get(f"{op}s", 0)
            if n:
                out[f"{op}_avg_ms"] = round(self.data.get(f"{op}_s", 0.0) / n * 1e3, 3)
        return out


class StatsRecorder:
    """Thread-safe accumulator shared by the store/load threads and the step hooks; `take()` swaps it out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVLedgerStats()
        self.totals = KVLedgerStats()  # whole-run numbers (demo report, tests)

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._stats.add(name, value)
            self.totals.add(name, value)

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._stats.gauge(name, value)
            self.totals.gauge(name, max(value, self.totals.data.get(name, 0)))  # totals keep the peak

    def fail_code(self, code: int, keys: int = 1) -> None:
        with self._lock:
            self._stats.fail_code(code, keys)
            self.totals.fail_code(code, keys)

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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
            elif name in self._gauges:
                self._gauges[name].labels(*labels).set(value)
            elif name.startswith(_CODE_PREFIX) and value:
                self._failures.labels(*labels, name[len(_CODE_PREFIX):]).inc(value)
