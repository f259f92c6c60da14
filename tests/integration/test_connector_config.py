"""Connector configuration errors name the field and the value; upstream MooncakeStoreConnector keys and the
derived pin cap reach the connector; connector stats (counters, gauges, latency histograms) merge across ranks
with a bounded payload and reach Prometheus through vLLM's own metrics path."""
from __future__ import annotations

import functools
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.telemetry.stats import LATENCY_BUCKETS_S, MAX_CODES, KVLedgerPromMetrics, KVLedgerStats, StatsRecorder
from testbed.harness import Harness, shared_prefix_prompts


@pytest.mark.parametrize("extra, field", [
    ({"max_inflight_jobz": 3}, "max_inflight_jobz"),
    ({"load_threads": 0}, "load_threads"),
    ({"save_decode": "yes"}, "save_decode"),
    ({"save_partial_tail": 1}, "save_partial_tail"),
    ({"max_inflight_jobs": -1}, "max_inflight_jobs"),
])
def test_bad_extra_config_names_the_field(store_config: StoreConfig, extra, field):
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra=extra)
    assert field in str(e.value) and repr(next(iter(extra.values()))) in str(e.value)


def test_upstream_load_recv_threads_env_sets_load_threads(store_config: StoreConfig,
                                                          monkeypatch: pytest.MonkeyPatch):
    """vLLM's VLLM_MOONCAKE_LOAD_RECV_THREADS (upstream's load threads per rank) reaches the worker side of
    the connector vLLM builds; an explicit load_threads wins; a value that is not an int >= 1 is refused."""
    monkeypatch.setenv("VLLM_MOONCAKE_LOAD_RECV_THREADS", "3")
    for extra, want in (({}, 3), ({"load_threads": 2}, 2)):
        with Harness(store_config, extra=extra) as h:
            ws = h.workers[0].worker_side
            assert ws.connector_config.load_threads == want
            assert sum(t.name.startswith("kvledger-load") for t in ws._threads) == want, ws._threads
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("VLLM_MOONCAKE_LOAD_RECV_THREADS", bad)
        with pytest.raises(ConfigError) as e:
            Harness(store_config)
        assert e.value.field == "VLLM_MOONCAKE_LOAD_RECV_THREADS" and repr(bad) in str(e.value)


def test_stats_merge_ranks_and_bound_failure_codes():
    a, b = KVLedgerStats(), KVLedgerStats()
    a.add("puts", 2), a.add("put_s", 0.5), a.gauge("pins_in_flight", 3)
    b.add("puts", 1), b.add("put_s", 0.1), b.gauge("pins_in_flight", 7)
    for code in range(MAX_CODES + 5):
        b.fail_code(-code - 1)
    a.aggregate(b)
    assert a.data["puts"] == 3 and a.data["pins_in_flight"] == 7
    assert sum(k.startswith("fail_code.") for k in a.data) == MAX_CODES + 1  # + the "other" bucket
    assert a.data["fail_code.other"] == 5
    red = a.reduce()
    assert red["put_avg_ms"] == pytest.approx(200.0)


def test_prometheus_metrics_observe(vllm_config_for_prom=None):
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}

    class _Cfg:
        kv_transfer_config = None

    prom = KVLedgerPromMetrics(_Cfg(), types, ["engine"], {0: ["0"]})
    prom.observe({"puts": 4, "deferrals": 2, "pins_in_flight": 5, "fail_code.-704": 3}, 0)
    assert reg.get_sample_value("vllm:kvledger_puts_total", {"engine": "0"}) == 4
    assert reg.get_sample_value("vllm:kvledger_deferrals_total", {"engine": "0"}) == 2
    assert reg.get_sample_value("vllm:kvledger_pins_in_flight", {"engine": "0"}) == 5
    assert reg.get_sample_value("vllm:kvledger_store_failures_total", {"engine": "0", "code": "-704"}) == 3


@pytest.mark.parametrize("max_model_len, max_pinned_blocks, need", [
    (1024, 8, 64),  # 1024 / 16
    (129, 8, 9),  # a partial last block counts: ceil(129 / 16)
])
def test_pin_cap_below_the_longest_request_is_refused_at_start(store_config: StoreConfig, max_model_len,
                                                               max_pinned_blocks, need):
    """A store job larger than max_pinned_blocks could never be admitted (SchedulerLedger.open_job raises):
    the connector refuses such a cap at construction, naming the field, the value and the blocks needed."""
    threads = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra={"max_inflight_jobs": 1, "max_pinned_blocks": max_pinned_blocks},
                max_model_len=max_model_len)
    assert e.value.field == "max_pinned_blocks" and e.value.value == max_pinned_blocks
    assert f"max_pinned_blocks={max_pinned_blocks!r}" in str(e.value)
    assert f"{need} blocks" in str(e.value) and f"max_model_len={max_model_len}" in str(e.value)
    # refused before anything started: no store or load thread left behind
    assert not [t.name for t in threading.enumerate() if t.ident not in threads and t.name.startswith("kvledger")]


def test_pin_cap_equal_to_the_longest_request_starts(store_config: StoreConfig):
    with Harness(store_config, extra={"max_inflight_jobs": 1, "max_pinned_blocks": 8}, max_model_len=128) as h:
        assert h.scheduler_connector.scheduler_side.steps.max_pinned_blocks == 8


def test_max_inflight_jobs_below_one_is_refused_at_start(store_config: StoreConfig):
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra={"max_inflight_jobs": 0})
    assert e.value.field == "max_inflight_jobs" and e.value.value == 0
    assert "max_inflight_jobs=0" in str(e.value)


def test_latency_histograms_are_exact_per_bucket():
    """Each bucket's calls are observed at their mean, which lies in that bucket: Prometheus gets the calls'
    own bucket counts, count and sum, from a payload of at most two numbers per bucket."""
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}

    class _Cfg:
        kv_transfer_config = None

    durations = [0.00005, 0.0001, 0.0003, 0.0004, 0.002, 0.002, 0.7, 12.0]  # 0.0001 sits on a bound
    ranks = [StatsRecorder(), StatsRecorder()]
    for i, d in enumerate(durations):  # as the store threads record a put: one add of put_s per call
        ranks[i % 2].add("puts")
        ranks[i % 2].add("put_s", d)
    a, b = (r.take() for r in ranks)
    a.aggregate(b)  # merging ranks is a sum
    assert sum(k.startswith(("h.", "hs.")) for k in a.data) <= 2 * (len(LATENCY_BUCKETS_S) + 1)
    prom = KVLedgerPromMetrics(_Cfg(), types, ["engine"], {0: ["0"]})
    prom.observe(a.data, 0)
    lab = {"engine": "0"}
    assert reg.get_sample_value("vllm:kvledger_put_seconds_count", lab) == len(durations)
    assert reg.get_sample_value("vllm:kvledger_put_seconds_sum", lab) == pytest.approx(sum(durations))
    for le in LATENCY_BUCKETS_S:
        want = sum(d <= le for d in durations)
        assert reg.get_sample_value("vllm:kvledger_put_seconds_bucket", {**lab, "le": str(float(le))}) == want, le
    assert reg.get_sample_value("vllm:kvledger_put_seconds_bucket", {**lab, "le": "+Inf"}) == len(durations)
    assert "put_avg_ms" in a.reduce() and not any(k.startswith(("h.", "hs.")) for k in a.reduce())


def test_latency_histograms_through_vllms_metrics_path(store_config: StoreConfig):
    """vLLM's real path: the Scheduler merges the workers' and its own connector stats into SchedulerStats,
    vLLM's PrometheusStatLogger hands them to KVConnectorProm, which resolves our class from the config and
    builds our metrics. The harness's step output is captured by wrapping update_from_output (a recorder,
    no behaviour changed). Every put, get and lookup call is in its histogram."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prompts = shared_prefix_prompts(6, num_prefixes=2, prefix_len=48, suffix_len=8, seed=3)
    with Harness(store_config, num_blocks=12, max_num_seqs=2) as h:
        stats = []
        inner = h.scheduler.update_from_output

        def recording(*a, **kw):
            out = inner(*a, **kw)
            stats.extend(eco.scheduler_stats for eco in out.values() if eco.scheduler_stats is not None)
            return out

        h.scheduler.update_from_output = recording  # type: ignore[method-assign]
        for _ in range(2):  # pass 1 saves; pass 2, with vLLM's prefix cache emptied, loads from the store
            assert h.scheduler.reset_prefix_cache()
            for i, p in enumerate(prompts):
                h.add_request(f"req-{i}", p, 8)
            h.run()
        assert h.garbage == [] and h.check_at_rest() == []
        logger = PrometheusStatLogger(h.vllm_config, [0])
        for s in stats:
            logger.record(scheduler_stats=s, iteration_stats=None, engine_idx=0)
        totals = {k: v for c in [h.scheduler_connector, *h.workers] for k, v in c.stats.totals.data.items()
                  if k in ("puts", "gets", "lookups", "put_s", "get_s", "lookup_s")}
        lab = {"model_name": str(h.vllm_config.model_config.served_model_name), "engine": "0"}
        for op, n in (("put", "puts"), ("get", "gets"), ("lookup", "lookups")):
            count = REGISTRY.get_sample_value(f"vllm:kvledger_{op}_seconds_count", lab)
            assert count is not None and count > 0, op
            assert count == totals[n], op  # every call, once
            assert REGISTRY.get_sample_value(f"vllm:kvledger_{op}_seconds_sum", lab) == pytest.approx(
                totals[f"{op}_s"]), op
        assert REGISTRY.get_sample_value("vllm:kvledger_puts_total", lab) == totals["puts"]


def test_upstream_extra_config_through_the_connector(store_config: StoreConfig):
    extra = {"cache_prefix": "tenant-1", "save_decode_cache": True, "load_async": True, "enable_lookup": True}
    with Harness(store_config, extra=extra) as h:
        assert h.scheduler_connector.store_config.namespace == "tenant-1"
        assert h.scheduler_connector.scheduler_side.steps.save_decode is True
        assert all(kb.prefix.startswith("tenant-1/kvl2/") for kb in h.key_builders)
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra={"preferred_segment": "node-3"})
    assert e.value.field == "preferred_segment" and "'node-3'" in str(e.value) and "remove it" in str(e.value)


@pytest.mark.parametrize("num_blocks, max_model_len, cap", [
    (32, 4096, 256),  # the longest request (4096 / 16) is above half the pool: the longest request
    (1200, 1024, 600),  # half the pool
])
def test_pin_cap_is_derived_from_the_engine_when_unset(store_config: StoreConfig, num_blocks: int,
                                                       max_model_len: int, cap: int):
    with Harness(store_config, num_blocks=num_blocks, max_model_len=max_model_len) as h:
        for conn in [h.scheduler_connector, *h.workers]:
            assert conn.config.max_pinned_blocks == cap  # every role: derived once, at construction
        assert h.scheduler_connector.scheduler_side.steps.max_pinned_blocks == cap
