"""Every combination of settings the config table refuses is refused at start-up naming the field and the
value, read as the connector reads them (`read_settings`, then `ConnectorConfig.build` for the engine's
figures): what tests/integration checks one source at a time, here in milliseconds. The TP-shared layout's
refusals of what vLLM's config fixes are in `engine_facts.kv_head_shard`."""
from __future__ import annotations

import copy
import types
from typing import Any

import pytest

from conformance.probes_edge import tp_config
from kvledger_connector.config import ConfigError, ConnectorConfig, read_settings
from kvledger_connector.shape import engine_facts

MASTER = {"master_server_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"}
TIER = "/srv/kv-tier"
SECRET_FILE = "/srv/kv-secret.key"


def _engine(**figures: Any) -> Any:
    """THIS IS A TEST DOUBLE: vLLM's figures the configuration depends on (`config.EngineFigures`), one rank,
    one KV cache group, a 128-token model in 16-token blocks, unless ``figures`` says otherwise."""
    return types.SimpleNamespace(**{
        "block_size": 16, "world_size": 1, "nnodes": 1, "max_model_len": 128, "num_gpu_blocks": 64,
        "save_enabled": True, "load_enabled": True, "kv_load_failure_policy": "fail", "num_groups": 1,
        "key_parts": 1, "num_state_groups": 0, "device_type": "cuda", **figures})


# (what is combined, extra config, engine figures, the field refused, its value in the message)
REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], str, Any]] = [
    ("a master without metadata", {"master_server_address": MASTER["master_server_address"]}, {},
     "metadata_server", None),
    ("metadata without a master", {"metadata_server": MASTER["metadata_server"]}, {}, "metadata_server",
     MASTER["metadata_server"]),
    ("rdma without devices", {"protocol": "rdma"}, {}, "rdma_devices", ""),
    ("a tier dir without the tier", {"disk_offload_dir": TIER}, {}, "disk_offload_dir", TIER),
    ("the tier without a dir", {"disk_offload": True}, {}, "disk_offload_dir", None),
    ("the tier on a small segment", {"disk_offload": True, "disk_offload_dir": TIER, "global_segment_size": "8MB"},
     {}, "global_segment_size", 8 << 20),
    ("upstream embedded mode without memory", {"mode": "embedded", "global_segment_size": 0}, {}, "mode",
     "embedded"),
    ("upstream standalone-store mode with memory", {"mode": "standalone-store"}, {}, "mode", "standalone-store"),
    ("mac beside a master without a secret", {"integrity": "mac", **MASTER}, {}, "integrity_secret_file", None),
    ("checksum with a secret", {"integrity": "checksum", "integrity_secret_file": SECRET_FILE}, {},
     "integrity_secret_file", SECRET_FILE),
    ("off with a secret", {"integrity": "off", "integrity_secret_file": SECRET_FILE}, {}, "integrity_secret_file",
     SECRET_FILE),
    ("checksum with a secret beside a master", {"integrity": "checksum", "integrity_secret_file": SECRET_FILE,
                                                **MASTER}, {}, "integrity_secret_file", SECRET_FILE),
    ("partial tails of a Mamba hybrid", {"save_partial_tail": True}, {"num_groups": 2, "num_state_groups": 1},
     "save_partial_tail", True),
    ("several nodes on the embedded store", {}, {"nnodes": 2}, "master_server_address", None),
    ("a pin cap below the job cap", {"max_inflight_jobs": 100, "max_pinned_blocks": 10}, {}, "max_pinned_blocks",
     10),
    ("a pin cap below the longest request", {"max_inflight_jobs": 1, "max_pinned_blocks": 4}, {},
     "max_pinned_blocks", 4),  # 128 tokens in 16-token blocks: 8
]


@pytest.mark.parametrize("extra, figures, field, value", [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED])
def test_a_refused_combination_names_its_field_and_value(extra: dict[str, Any], figures: dict[str, Any],
                                                         field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.build(read_settings(extra, env={}), _engine(**figures))
    assert e.value.field == field and f"{field}={value!r}" in str(e.value), str(e.value)


def test_the_refused_combinations_are_accepted_apart() -> None:
    """Each refused row's settings, one at a time where they are allowed alone, start: the refusal is the
    combination's, not a setting's own."""
    for extra in ({"protocol": "rdma", "rdma_devices": "mlx5_0"}, {"disk_offload": True, "disk_offload_dir": TIER},
                  {"integrity": "checksum"}, {"integrity": "off"}, {"integrity": "mac"}, {"save_partial_tail": True},
                  {"integrity": "mac", "integrity_secret_file": SECRET_FILE, **MASTER},
                  {"max_inflight_jobs": 1, "max_pinned_blocks": 8}):
        ConnectorConfig.build(read_settings(extra, env={}), _engine())
    ConnectorConfig.build(read_settings(MASTER, env={}), _engine(nnodes=2))


def test_the_tp_shared_layout_refuses_what_it_cannot_key_by_name() -> None:
    """`kv_heads_per_key` must divide the KV heads a rank holds (a key's heads on one rank), and is refused
    under context parallelism, whose ranks split a block's tokens: both naming the field."""
    vc = copy.deepcopy(tp_config(1, 2))  # two KV heads on the one rank
    assert engine_facts.kv_head_shard(vc, 2, 0, 1) == (2, 0)
    with pytest.raises(ConfigError) as e:
        engine_facts.kv_head_shard(vc, 2, 0, 3)
    assert e.value.field == "kv_heads_per_key" and "must divide the 2 KV heads" in str(e.value)
    vc.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ConfigError) as e:
        engine_facts.kv_head_shard(vc, 2, 0, 1)
    assert e.value.field == "kv_heads_per_key" and "context parallelism" in str(e.value)
