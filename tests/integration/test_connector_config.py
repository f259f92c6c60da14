"""Connector configuration errors name the field and the value; connector stats merge across ranks with a
bounded payload and reach Prometheus."""
from __future__ import annotations

import functools
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.stats import MAX_CODES, KVLedgerPromMetrics, KVLedgerStats
from testbed.harness import Harness


@pytest.mark.parametrize("extra, field", [
    ({"max_inflight_jobz": 3}, "max_inflight_jobz"),
    ({"load_threads": 0}, "load_threads"),
    ({"save_decode": "yes"}, "save_decode"),
    ({"max_inflight_jobs": -1}, "max_inflight_jobs"),
])
def test_bad_extra_config_names_the_field(store_config: StoreConfig, extra, field):
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra=extra)
    assert field in str(e.value) and repr(next(iter(extra.values()))) in str(e.value)


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
        assert h.scheduler_connector.scheduler_side.max_pinned_blocks == 8


def test_max_inflight_jobs_below_one_is_refused_at_start(store_config: StoreConfig):
    with pytest.raises(ConfigError) as e:
        Harness(store_config, extra={"max_inflight_jobs": 0})
    assert e.value.field == "max_inflight_jobs" and e.value.value == 0
    assert "max_inflight_jobs=0" in str(e.value)
