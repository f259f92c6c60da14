"""The configuration: one table of keys, its sources and precedence, bounds, errors that name the field and the
value, the pin cap derived once, and the checked-in tables that are rendered from it."""
from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pytest

from kvledger_connector import upstream_keys
from kvledger_connector.config import (
    BY_NAME,
    CPU_SYNC_LOAD_MAX_TOKENS,
    ENV_CONFIG_PATH,
    GENERATED,
    KEYS,
    ConfigError,
    ConnectorConfig,
    StoreConfig,
    advertised_address,
    derive_pin_cap,
    parse_size,
    read_settings,
    spliced,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, data: object) -> dict[str, str]:
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps(data))
    return {ENV_CONFIG_PATH: str(p)}


def test_defaults_are_embedded_mode_over_tcp() -> None:
    cfg = StoreConfig.from_sources(None, env={})
    assert cfg.embedded and cfg.protocol == "tcp" and cfg.master_server_address is None
    assert cfg.local_hostname == "127.0.0.1"  # the embedded master is on loopback: so is the advertised address
    assert cfg.namespace == "" and not hasattr(cfg, "max_pinned_blocks")  # the pin cap is the connector's


def test_file_then_extra_config_extra_wins(tmp_path: Path) -> None:
    env = write(tmp_path, {"master_server_address": "10.0.0.5:50051",
                           "metadata_server": "http://10.0.0.5:8080/metadata",
                           "global_segment_size": "4GB", "local_buffer_size": 1 << 20,
                           "device_name": "", "protocol": "tcp", "max_inflight_jobs": 8,
                           "local_hostname": "10.0.0.7"})
    settings = read_settings({"max_inflight_jobs": 16, "global_segment_size": "512 MiB",
                              "kv_role": "kv_both"}, env=env, ignore={"kv_role"})
    cfg = settings.store()
    assert cfg.master_server_address == "10.0.0.5:50051" and not cfg.embedded
    assert cfg.global_segment_size == 512 << 20  # extra config wins over the file
    assert settings.given("connector")["max_inflight_jobs"] == 16 and cfg.local_buffer_size == 1 << 20


@pytest.mark.parametrize("raw, value", [
    (0, 0), (123, 123), ("4GB", 4 << 30), ("4gb", 4 << 30), ("512 MiB", 512 << 20), ("1.5GB", 3 << 29),
    ("64KB", 64 << 10), ("100", 100), ("2T", 2 << 40),
])
def test_sizes(raw: object, value: int) -> None:
    assert parse_size("global_segment_size", raw) == value


@pytest.mark.parametrize("extra, field, fragment", [
    ({"global_segment_sise": 1}, "global_segment_sise", "unknown key"),
    ({"global_segment_size": "4 parsecs"}, "global_segment_size", "not a size"),
    ({"global_segment_size": -1}, "global_segment_size", ">= 0"),
    ({"global_segment_size": True}, "global_segment_size", "got bool"),
    ({"global_segment_size": "0.5B"}, "global_segment_size", "whole number"),
    ({"local_buffer_size": 0}, "local_buffer_size", "> 0"),
    ({"rpc_timeout_ms": -5}, "rpc_timeout_ms", ">= 1"),
    ({"rpc_timeout_ms": "2000"}, "rpc_timeout_ms", "must be an integer"),
    ({"unhealthy_backoff_ms": 0}, "unhealthy_backoff_ms", ">= 1"),  # 0 would re-pay the RPC timeout per call
    ({"max_inflight_jobs": 0}, "max_inflight_jobs", ">= 1"),
    ({"max_pinned_blocks": 2.5}, "max_pinned_blocks", "must be an integer"),
    ({"load_sub_batch_keys": 0}, "load_sub_batch_keys", ">= 1"),
    ({"max_key_bytes": 4}, "max_key_bytes", ">= 16"),
    ({"store_queue_size": 0}, "store_queue_size", ">= 1"),
    ({"load_queue_size": None}, "load_queue_size", "must be an integer"),
    ({"protocol": "udp"}, "protocol", "'tcp' or 'rdma'"),
    ({"local_hostname": "bad host!"}, "local_hostname", "host name"),
    ({"master_server_address": "localhost", "metadata_server": "http://h:1/m"}, "master_server_address",
     "host:port"),
    ({"master_server_address": "h:70000", "metadata_server": "http://h:1/m"}, "master_server_address", "1..65535"),
    ({"master_server_address": "h:1", "metadata_server": "ftp://h:1/m"}, "metadata_server", "URL"),
    ({"master_server_address": "h:1", "metadata_server": "http://h/m"}, "metadata_server", "URL"),
    ({"master_server_address": "h:1"}, "metadata_server", "required when master_server_address"),
    ({"metadata_server": "http://h:1/m"}, "metadata_server", "without master_server_address"),
    ({"protocol": "rdma"}, "rdma_devices", "required when protocol"),
    ({"store_queue_size": 10 ** 9}, "store_queue_size", "<= 65536"),
    ({"rpc_timeout_ms": 86_400_000}, "rpc_timeout_ms", "<= 600000"),
    ({"global_segment_size": "5TB"}, "global_segment_size", "<= 4 TiB"),
    ({"local_buffer_size": 2 << 40}, "local_buffer_size", "<= 1 TiB"),
    ({"global_segment_size": "1" * 40}, "global_segment_size", "not a size"),
    ({"rdma_devices": "mlx5_0;rm -rf"}, "rdma_devices", "comma list"),
    ({"trace_path": 7}, "trace_path", "path string"),
    ({"max_pinned_blocks": 0}, "max_pinned_blocks", ">= 1"),
])
def test_bad_extra_config_names_field_and_value(extra: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources(extra, env={})
    assert e.value.field == field
    assert field in str(e.value) and fragment in str(e.value)
    if field in extra:
        assert repr(extra[field]) in str(e.value)


def test_bad_value_in_file_names_the_file(tmp_path: Path) -> None:
    env = write(tmp_path, {"rpc_timeout_ms": -1})
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH=.*mooncake.json: rpc_timeout_ms=-1"):
        StoreConfig.from_sources({}, env=env)


@pytest.mark.parametrize("content, fragment", [("{nope", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_broken_file(tmp_path: Path, content: str, fragment: str) -> None:
    p = tmp_path / "c.json"
    p.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        StoreConfig.from_sources(None, env={ENV_CONFIG_PATH: str(p)})


@pytest.mark.parametrize("case, fragment", [
    ("link", "without following links"), ("others-write", "0666: others may write it"),
    ("group-write", "0664: others may write it"), ("another-user", "is owned by uid 65534"),
    ("fifo", "is not a regular file"), ("huge", "holds more than 1048576 bytes"),
])
def test_the_config_file_is_checked_as_every_file_an_operator_names(tmp_path: Path, case: str,
                                                                    fragment: str) -> None:
    """MOONCAKE_CONFIG_PATH sets the master's address and can turn integrity off, so it is read as the
    secret and the weights-version files are (`ownfile.read_own_file`): this user's regular file, not a
    link, that no one else may write, at most 1 MiB; a refusal names the variable, the path and why."""
    import os

    env = write(tmp_path, {"master_server_address": "10.9.9.9:50051",
                           "metadata_server": "http://10.9.9.9:8080/metadata", "integrity": "off"})
    path = Path(env[ENV_CONFIG_PATH])
    assert read_settings(None, env=env).get("master_server_address") == "10.9.9.9:50051"  # 0644, ours: read
    if case == "link":
        target = tmp_path / "elsewhere.json"
        path.rename(target)
        path.symlink_to(target)
    elif case == "others-write":
        path.chmod(0o666)
    elif case == "group-write":
        path.chmod(0o664)
    elif case == "another-user":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, 65534, 65534)
    elif case == "fifo":
        path.unlink()
        os.mkfifo(path)  # opened without blocking, refused before a read
    else:
        path.write_text(json.dumps({"namespace": "x", "pad": "y" * (1 << 20)}))
    with pytest.raises(ConfigError) as e:
        read_settings(None, env=env)
    assert e.value.field == ENV_CONFIG_PATH and e.value.value == str(path)
    assert fragment in str(e.value) and str(path) in str(e.value)


def test_a_trace_path_is_opened_as_every_file_an_operator_names(tmp_path: Path) -> None:
    """The trace is appended to only as this user's regular file, not a link, that no one else may write: a
    link planted at `trace_path` is refused by name and the file it points to is left as it was."""
    import os

    from kvledger.errors import LedgerInputError
    from kvledger_connector.telemetry.tracefile import close_trace, open_trace

    fresh = tmp_path / "fresh.ndjson"
    sink = open_trace(str(fresh))
    sink.emit("scheduler", "Admit", {"r": "a"})
    close_trace(sink)
    assert fresh.read_text().count("\n") == 1 and (fresh.stat().st_mode & 0o777) == 0o600
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    link = tmp_path / "link.ndjson"
    link.symlink_to(victim)
    shared = tmp_path / "shared.ndjson"
    shared.write_text("")
    shared.chmod(0o666)
    for path, fragment in ((link, "without following links"), (shared, "others may write it")):
        with pytest.raises(LedgerInputError) as e:
            open_trace(str(path))
        assert e.value.field == "trace_path" and fragment in str(e.value) and str(path) in str(e.value)
    assert victim.read_text() == "keep\n" and os.path.islink(link)


def test_missing_file_and_non_dict_extra(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH=.*absent.json.*: not found"):
        StoreConfig.from_sources(None, env={ENV_CONFIG_PATH: str(tmp_path / "absent.json")})
    with pytest.raises(ConfigError, match="must be a dict"):
        StoreConfig.from_sources(["x"], env={})  # type: ignore[arg-type]


def test_config_is_frozen_and_replace_validates() -> None:
    cfg = StoreConfig()
    with pytest.raises(AttributeError):
        cfg.protocol = "rdma"  # type: ignore[misc]
    assert cfg.replace(max_key_bytes=64).max_key_bytes == 64
    with pytest.raises(ConfigError, match="max_key_bytes=1"):
        cfg.replace(max_key_bytes=1)
    with pytest.raises(ConfigError, match="master_server_address='nope'"):
        cfg.with_addresses("nope", "http://127.0.0.1:1/metadata")


def test_every_key_is_one_row_of_the_table() -> None:
    """StoreConfig's and ConnectorConfig's fields are the table's keys of each holder, with its defaults."""
    store = {k.name for k in KEYS if k.holder == "store"}
    conn = {k.name for k in KEYS if k.holder == "connector"}
    assert store == set(StoreConfig.__dataclass_fields__)
    assert conn < set(ConnectorConfig.__dataclass_fields__)
    assert all(len(k.doc) > 10 for k in KEYS)


@pytest.mark.parametrize("key", [k for k in KEYS if k.type in ("int", "size")], ids=lambda k: k.name)
def test_every_number_is_bounded_both_ways_and_refused_beyond(key) -> None:
    lo, hi = key.bounds
    assert hi < 1 << 63
    assert key.parse(key.name, hi, "t") == hi and key.parse(key.name, lo, "t") == lo
    for bad in (hi + 1, lo - 1):
        with pytest.raises(ConfigError) as e:
            key.parse(key.name, bad, "t")
        assert e.value.field == key.name and e.value.value == bad and f"{key.name}={bad!r}" in str(e.value)


def test_sizes_are_exact() -> None:
    assert parse_size("s", "4398046511103") == 4398046511103  # no float rounding
    assert parse_size("s", "0.5KiB") == 512
    with pytest.raises(ConfigError, match="whole number"):
        parse_size("s", "0.1B")


# ---------------------------------------------------------------- upstream MooncakeStoreConnector configs
UPSTREAM_FILE = {  # a MOONCAKE_CONFIG_PATH file as written for vLLM 0.32's MooncakeStoreConnector
    "metadata_server": "http://10.0.0.5:8080/metadata", "master_server_address": "10.0.0.5:50051",
    "protocol": "tcp", "device_name": "", "mode": "embedded", "global_segment_size": "4GB",
    "local_buffer_size": "1GB", "enable_offload": False, "tenant_id": "default",
}


def test_upstream_file_is_accepted_and_mapped(tmp_path: Path) -> None:
    env = {**write(tmp_path, UPSTREAM_FILE), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.9"}
    cfg = StoreConfig.from_sources({"cache_prefix": "team-a", "load_async": True, "enable_lookup": True,
                                    "lookup_async": False, "lookup_rpc_port": 5555}, env=env)
    assert cfg.master_server_address == "10.0.0.5:50051" and cfg.metadata_server == "http://10.0.0.5:8080/metadata"
    assert cfg.global_segment_size == 4 << 30 and cfg.local_buffer_size == 1 << 30 and cfg.rdma_devices == ""
    assert cfg.namespace == "team-a"  # cache_prefix -> namespace
    assert cfg.local_hostname == "10.0.0.9"  # upstream's MOONCAKE_REQUESTER_LOCAL_HOSTNAME
    # an explicit local_hostname wins over the environment override
    cfg = StoreConfig.from_sources({"local_hostname": "10.0.0.8"}, env=env)
    assert cfg.local_hostname == "10.0.0.8"


def test_upstream_standalone_store_mode_is_a_consumer_only_worker(tmp_path: Path) -> None:
    env = write(tmp_path, {**UPSTREAM_FILE, "mode": "standalone-store", "global_segment_size": 0,
                           "local_hostname": "10.0.0.7"})
    assert StoreConfig.from_sources(None, env=env).global_segment_size == 0


@pytest.mark.parametrize("extra, fragment", [
    ({"mode": "embedded", "global_segment_size": 0}, "global_segment_size > 0"),
    ({"mode": "standalone-store"}, "set global_segment_size 0"),
    ({"mode": "disaggregated"}, "'embedded'"),
])
def test_upstream_mode_must_agree_with_the_segment(extra: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources(extra, env={})
    assert e.value.field == "mode" and repr(extra["mode"]) in str(e.value) and fragment in str(e.value)


@pytest.mark.parametrize("key, value, instead", [
    ("tenant_id", "tenant-7", "namespace"),
    ("preferred_segment", "node-3:12345", "remove it"),
    ("enable_lookup", False, "kv_producer"),
    ("load_async", False, "sync_load_max_tokens"),
    ("lookup_async", True, "remove it"),
    ("store_tp_size", 2, "tensor_parallel_size"),
    ("enable_store_tp_lcm", True, "tensor_parallel_size"),
    ("prefill_tp_sizes", [2, 4], "tensor_parallel_size"),
    ("custom_mem_pool", "NVLINK", "remove it"),
    ("enable_group_semantics", "True", "remove it"),
    ("enable_cross_layers_blocks", "true", "remove it"),
])
def test_upstream_keys_we_cannot_honour_are_refused_with_what_to_do(tmp_path: Path, key: str, value: object,
                                                                  instead: str) -> None:
    for env, extra in ((write(tmp_path, {key: value}), None), ({}, {key: value})):  # in the file or extra config
        with pytest.raises(ConfigError) as e:
            StoreConfig.from_sources(extra, env=env)
        assert e.value.field == key and e.value.value == value
        assert f"{key}={value!r}" in str(e.value) and "upstream" in str(e.value) and instead in str(e.value)
        assert (ENV_CONFIG_PATH in str(e.value)) == (extra is None)  # names the source that holds it


@pytest.mark.parametrize("key, value", [
    ("enable_offload", False), ("tenant_id", "default"), ("tenant_id", None), ("preferred_segment", None),
    ("enable_lookup", True), ("load_async", True), ("lookup_async", False), ("store_tp_size", None),
    ("enable_store_tp_lcm", False), ("custom_mem_pool", ""), ("enable_group_semantics", "False"),
    ("enable_cross_layers_blocks", "False"), ("lookup_rpc_port", 0),
])
def test_upstream_keys_at_values_that_ask_for_nothing_we_lack_are_accepted(key: str, value: object) -> None:
    assert StoreConfig.from_sources({key: value}, env={}) == StoreConfig.from_sources({}, env={})


def test_upstream_preferred_segment_from_the_environment_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources(None, env={"MOONCAKE_PREFERRED_SEGMENT": "node-3"})
    assert e.value.field == "MOONCAKE_PREFERRED_SEGMENT" and "'node-3'" in str(e.value)


def test_upstream_save_decode_cache_maps_to_save_decode() -> None:
    assert read_settings({"save_decode_cache": True}, env={}).get("save_decode") is True
    assert read_settings({"save_decode_cache": True, "save_decode": True}, env={}).get("save_decode") is True
    for extra in ({"save_decode_cache": True, "save_decode": False}, {"save_decode": False, "save_decode_cache": True}):
        with pytest.raises(ConfigError, match="save_decode_cache=True: contradicts save_decode=False") as e:
            read_settings(extra, env={})
        assert e.value.field == "save_decode_cache"
    with pytest.raises(ConfigError, match="cache_prefix='a': contradicts namespace='b'"):
        read_settings({"namespace": "b", "cache_prefix": "a"}, env={})


def test_every_key_may_be_in_the_file_except_the_ranks(tmp_path: Path) -> None:
    """The file is a source like the extra config: a connector key there is read (not dropped unread); the
    extra config still wins. A driver's rank in a file shared by every worker is refused, naming the file."""
    env = write(tmp_path, {"save_decode": True, "max_lookup_cache": 8, "load_threads": 2})
    s = read_settings({"max_lookup_cache": 16}, env=env)
    assert (s.get("save_decode"), s.get("max_lookup_cache"), s.get("load_threads")) == (True, 16, 2)
    assert s.sources["save_decode"].startswith(ENV_CONFIG_PATH)
    assert s.sources["max_lookup_cache"] == "kv_connector_extra_config"
    with pytest.raises(ConfigError, match=r"MOONCAKE_CONFIG_PATH=.*: tp_rank=1: not read from the file"):
        read_settings(None, env=write(tmp_path, {"tp_rank": 1}))


def test_environment_values_are_checked_like_extra_config_values(tmp_path: Path) -> None:
    """Nothing from the environment is trusted: each variable goes through its key's parser (bounds
    included), also when an explicit value wins, and the error names the variable and its text."""
    for var, text, extra in (("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "bad host!", {"local_hostname": "10.0.0.8"}),
                             ("VLLM_MOONCAKE_LOAD_RECV_THREADS", "65", {}),
                             ("VLLM_MOONCAKE_LOAD_RECV_THREADS", "1e3", {"load_threads": 2})):
        with pytest.raises(ConfigError) as e:
            read_settings(extra, env={var: text})
        assert e.value.field == var and e.value.value == text and e.value.source == "environment"
        assert f"{var}={text!r}" in str(e.value)
    assert read_settings({}, env={"VLLM_MOONCAKE_LOAD_RECV_THREADS": " "}).get("load_threads") is None  # unset
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"namespace": "x" * 10, "pad": "y" * (2 << 20)}))
    with pytest.raises(ConfigError, match="holds more than 1048576 bytes"):
        read_settings(None, env={ENV_CONFIG_PATH: str(big)})
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_settings(None, env={ENV_CONFIG_PATH: str(tmp_path)})  # a directory


@pytest.mark.parametrize("value", ["a/b", "team a", "x" * 65, 7, "ns@1"])
def test_namespace_is_one_key_component(value: object) -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources({"cache_prefix": value}, env={})
    assert e.value.field == "cache_prefix" and repr(value) in str(e.value)


# ---------------------------------------------------------------- derived defaults
@pytest.mark.parametrize("max_model_len, block_size, pool, jobs, cap", [
    (131072, 16, 20000, 64, 10000),  # half the pool (the old fixed 4096 refused this model: it needs 8192)
    (131072, 16, 10000, 64, 8192),  # half the pool is below the longest request: the longest request
    (128, 16, 20000, 1, 8),  # one job of at most 8 blocks never pins more
    (128, 16, None, 4, 32),  # pool unknown: jobs × longest
    (129, 16, 100, 64, 50),  # a partial last block counts: L = 9
    (1 << 29, 16, 1 << 40, 64, 1 << 30),  # jobs × longest (2**31) and half the pool past the key's bound
])
def test_derived_pin_cap(max_model_len: int, block_size: int, pool: int | None, jobs: int, cap: int) -> None:
    assert derive_pin_cap(max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=pool,
                          max_inflight_jobs=jobs) == cap
    cfg = ConnectorConfig(store=StoreConfig(), max_inflight_jobs=jobs, block_size=block_size,
                          max_model_len=max_model_len, num_gpu_blocks=pool)
    assert cfg.max_pinned_blocks == cap  # derived at construction: no consumer sees an underived cap
    explicit = ConnectorConfig(store=StoreConfig(), max_inflight_jobs=1, block_size=block_size,
                               max_model_len=max_model_len, num_gpu_blocks=pool, max_pinned_blocks=cap)
    assert explicit.max_pinned_blocks == cap


def test_a_derived_pin_cap_never_passes_the_keys_bound() -> None:
    """Derived, the cap is clamped to `max_pinned_blocks`'s own upper bound, as a set value is refused past
    it: even a longest request above the bound (vLLM's figures go to 2**40) derives the bound."""
    hi = next(k for k in KEYS if k.name == "max_pinned_blocks").bounds[1]
    assert derive_pin_cap(max_model_len=1 << 40, block_size=1, num_gpu_blocks=None, max_inflight_jobs=1) == hi
    cfg = ConnectorConfig(store=StoreConfig(), block_size=1, max_model_len=1 << 40, num_gpu_blocks=1 << 40)
    assert cfg.max_pinned_blocks == hi
    with pytest.raises(ConfigError, match=rf"max_pinned_blocks={hi + 1}: must be <= "):
        ConnectorConfig(store=StoreConfig(), block_size=1, max_model_len=8, max_pinned_blocks=hi + 1)


@dataclass(frozen=True)
class _Engine:  # config.EngineFigures
    block_size: int = 16
    world_size: int = 1
    nnodes: int = 1
    max_model_len: int = 128
    num_gpu_blocks: int | None = 64
    save_enabled: bool = True
    load_enabled: bool = True
    kv_load_failure_policy: str = "fail"
    num_groups: int = 1
    key_parts: int = 1
    num_state_groups: int = 0
    device_type: str = "cuda"


def test_connector_config_is_built_once_from_settings_and_engine() -> None:
    """A derived cap may sit below the job cap (a small pool: the pin cap binds first) and survives a copy;
    a cap set below the job cap is a typo, refused naming where it was set; one below the longest request's
    blocks could never admit that request's save."""
    cfg = ConnectorConfig.build(read_settings({"max_inflight_jobs": 64}, env={}), _Engine())
    assert cfg.max_pinned_blocks == 32 and cfg.max_inflight_jobs == 64
    moved = dataclasses_replace(cfg, store=cfg.store.with_addresses("127.0.0.1:50051", "http://127.0.0.1:8080/m"))
    assert moved.max_pinned_blocks == 32
    with pytest.raises(ConfigError, match="kv_connector_extra_config: max_pinned_blocks=10: smaller than "
                                          "max_inflight_jobs=100"):
        ConnectorConfig.build(read_settings({"max_inflight_jobs": 100, "max_pinned_blocks": 10}, env={}), _Engine())
    with pytest.raises(ConfigError, match="max_pinned_blocks=4: smaller than the 8 blocks of the longest request"):
        ConnectorConfig.build(read_settings({"max_inflight_jobs": 1, "max_pinned_blocks": 4}, env={}), _Engine())
    consumer = ConnectorConfig.build(read_settings({"max_inflight_jobs": 1, "max_pinned_blocks": 4}, env={}),
                                     _Engine(save_enabled=False))  # pins nothing: any cap will do
    assert consumer.max_pinned_blocks == 4
    with pytest.raises(ConfigError, match="master_server_address=None: required with nnodes=2"):
        ConnectorConfig.build(read_settings({}, env={}), _Engine(nnodes=2))
    with pytest.raises(ConfigError, match="vllm cache_config: block_size=0"):
        ConnectorConfig.build(read_settings({}, env={}), _Engine(block_size=0))


def test_sync_load_cap_not_given_follows_the_device_and_a_given_one_stands() -> None:
    """On vLLM's CPU engine (the KV cache in host memory) a load of up to CPU_SYNC_LOAD_MAX_TOKENS runs inside
    the step; on an accelerator the key's default; a value given is kept on either, 0 included."""
    default = BY_NAME["sync_load_max_tokens"].default
    assert CPU_SYNC_LOAD_MAX_TOKENS > default
    assert ConnectorConfig.build(read_settings({}, env={}), _Engine()).sync_load_max_tokens == default
    cpu = _Engine(device_type="cpu")
    assert ConnectorConfig.build(read_settings({}, env={}), cpu).sync_load_max_tokens == CPU_SYNC_LOAD_MAX_TOKENS
    for given in (0, 64):
        assert ConnectorConfig.build(read_settings({"sync_load_max_tokens": given}, env={}),
                                     cpu).sync_load_max_tokens == given


def test_derived_pin_cap_refuses_nonsense_engine_figures() -> None:
    with pytest.raises(ConfigError, match="num_gpu_blocks=0"):
        derive_pin_cap(max_model_len=128, block_size=16, num_gpu_blocks=0, max_inflight_jobs=1)


@pytest.mark.parametrize("master", ["127.0.0.1:50051", "localhost:50051", "[::1]:50051"])
def test_advertised_address_is_loopback_with_a_loopback_master(master: str) -> None:
    assert advertised_address(master) == "127.0.0.1"
    assert advertised_address(None) == "127.0.0.1"  # embedded


def test_advertised_address_routes_to_a_remote_master() -> None:
    """A master on another node (TEST-NET-1, never contacted: a UDP connect only picks the route): the
    advertised address is this host's address on that route, which other nodes reach; without a route the
    error asks for local_hostname."""
    master = "192.0.2.1:50051"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 50051))
            route = s.getsockname()[0]
    except OSError:
        route = None
    if route is None:
        with pytest.raises(ConfigError, match="set local_hostname"):
            advertised_address(master)
        return
    assert advertised_address(master) == route and route != "127.0.0.1"
    cfg = StoreConfig.from_sources({"master_server_address": master,
                                    "metadata_server": "http://192.0.2.1:8080/metadata"}, env={})
    assert cfg.local_hostname == route


def test_checked_in_tables_are_the_generated_ones() -> None:
    """README's settings table and docs/vs-upstream.md's config tables are rendered from the key tables;
    after a change there, run `python -m kvledger_connector.config --write`."""
    stale = [rel for rel, (region, render) in GENERATED.items()
             if spliced((ROOT / rel).read_text(), region, render()) != (ROOT / rel).read_text()]
    assert stale == [], f"regenerate with: python -m kvledger_connector.config --write  ({stale})"


def test_every_cited_test_exists() -> None:
    """Each test the tables cite (file.py::name, ::name for the same file) is defined under tests/."""
    cited = [k.tests for k in KEYS] + [u.tests for u in upstream_keys.KEYS]
    missing = []
    for line in cited:
        path = ""
        for ref in filter(None, (r.strip() for r in line.split(","))):
            m = re.fullmatch(r"(?:([\w/.]+\.py))?::(\w+)", ref)
            assert m is not None, ref
            path = m.group(1) or path
            files = [p for p in (ROOT / "tests").rglob(Path(path).name) if str(p).endswith(path)]
            if not any(re.search(rf"^def {m.group(2)}\b", p.read_text(), re.M) for p in files):
                missing.append(f"{path}::{m.group(2)}")
    assert missing == []
