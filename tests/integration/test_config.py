"""StoreConfig: sources, precedence and validation errors that name the field and the value."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger_connector.config import ENV_CONFIG_PATH, KEY_DOCS, ConfigError, StoreConfig, parse_size


def write(tmp_path: Path, data: object) -> dict[str, str]:
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps(data))
    return {ENV_CONFIG_PATH: str(p)}


def test_defaults_are_embedded_mode_over_tcp() -> None:
    cfg = StoreConfig.from_sources(None, env={})
    assert cfg.embedded and cfg.protocol == "tcp" and cfg.master_server_address is None
    assert cfg.max_inflight_jobs <= cfg.max_pinned_blocks


def test_file_then_extra_config_extra_wins(tmp_path: Path) -> None:
    env = write(tmp_path, {"master_server_address": "10.0.0.5:50051",
                           "metadata_server": "http://10.0.0.5:8080/metadata",
                           "global_segment_size": "4GB", "local_buffer_size": 1 << 20,
                           "device_name": "", "protocol": "tcp", "max_inflight_jobs": 8})
    cfg = StoreConfig.from_sources({"max_inflight_jobs": 16, "global_segment_size": "512 MiB",
                                    "kv_role": "kv_both"}, env=env, connector_keys={"kv_role"})
    assert cfg.master_server_address == "10.0.0.5:50051" and not cfg.embedded
    assert cfg.global_segment_size == 512 << 20  # extra config wins over the file
    assert cfg.max_inflight_jobs == 16 and cfg.local_buffer_size == 1 << 20


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
    ({"unhealthy_backoff_ms": -1}, "unhealthy_backoff_ms", ">= 0"),
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
    ({"max_inflight_jobs": 100, "max_pinned_blocks": 10}, "max_pinned_blocks", "max_inflight_jobs=100"),
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


def test_missing_file_and_non_dict_extra(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
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


def test_every_key_is_documented() -> None:
    assert set(KEY_DOCS) == {f for f in StoreConfig.__dataclass_fields__}
    assert all(len(doc) > 10 for doc in KEY_DOCS.values())
