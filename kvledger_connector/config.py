"""Store configuration: one frozen `StoreConfig`, validated once at start-up.

Sources, later wins:
    1. defaults (below)
    2. the JSON file named by ``MOONCAKE_CONFIG_PATH`` (Mooncake's usual file; its ``device_name`` key is
       accepted as the RDMA device list)
    3. the connector's ``kv_connector_extra_config`` dict

Every problem raises `ConfigError` naming the source, the field and the offending value, so a typo in a
deployment fails at start-up instead of silently running with a default. Keys the connector itself owns
(not the store) are passed through `StoreConfig.from_sources(..., connector_keys=...)` so that they are
neither rejected nor stored here.

Sizes are ints (bytes) or strings such as ``"4GB"``, ``"512 MiB"``, ``"1.5gb"``; like Mooncake's own
config parser, ``KB/MB/GB/TB`` are binary (1024-based), as are ``KiB/MiB/GiB/TiB``.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"

# Upstream Mooncake config files call the RDMA device list `device_name`; setup() calls it rdma_devices.
_ALIASES = {"device_name": "rdma_devices"}

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")


class ConfigError(ValueError):
    """Invalid store configuration; the message names the source, the field and the value."""

    def __init__(self, field: str, value: Any, reason: str, source: str = "config") -> None:
        self.field, self.value, self.reason, self.source = field, value, reason, source
        super().__init__(f"{source}: {field}={value!r}: {reason}")


@dataclass(frozen=True)
class StoreConfig:
    """Mooncake store settings plus the connector's bounds (all of them finite: see the settings table in README.md).

    `master_server_address` None means *embedded mode*: the connector starts a private master and
    metadata server on 127.0.0.1 (kvledger_connector/embedded.py) and fills both addresses in.
    """

    master_server_address: str | None = None  # "host:port" of mooncake_master; None -> embedded
    metadata_server: str | None = None  # "http://host:port/metadata" | "P2PHANDSHAKE" | etcd://...
    local_hostname: str = "127.0.0.1"  # address this client advertises (also MC_TCP_BIND_ADDRESS)
    protocol: str = "tcp"  # "tcp" or "rdma"
    rdma_devices: str = ""  # comma list of RDMA NICs; "" for tcp
    global_segment_size: int = 512 << 20  # bytes this process contributes to the pool (0: consumer only)
    local_buffer_size: int = 16 << 20  # staging buffer of the copying APIs (zero-copy path does not use it)
    rpc_timeout_ms: int = 2000  # bound on a client->master RPC (MC_RPC_TIMEOUT_MS; Mooncake default 30 s)
    unhealthy_backoff_ms: int = 1000  # after a master RPC failure, skip store calls this long
    max_inflight_jobs: int = 64  # store jobs pinning GPU blocks at once (scheduler cap, S6 BoundedPins)
    max_pinned_blocks: int = 4096  # blocks pinned by store jobs at once (scheduler cap, S6)
    load_sub_batch_keys: int = 64  # keys per batch_get call on the load path
    max_key_bytes: int = 512  # longer keys are never sent; their blocks are reported as load errors
    store_queue_size: int = 128  # bounded worker store-job queue (put side)
    load_queue_size: int = 128  # bounded worker load-job queue

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_sources(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        connector_keys: Iterable[str] = (),
    ) -> StoreConfig:
        """Defaults <- ``$MOONCAKE_CONFIG_PATH`` JSON <- `extra_config`. Keys in `connector_keys` are
        skipped (they belong to the connector); any other unknown key is a `ConfigError`."""
        env = os.environ if env is None else env
        skip = frozenset(connector_keys)
        merged: dict[str, Any] = {}
        path = env.get(ENV_CONFIG_PATH)
        if path:
            merged.update(cls._read_file(path, skip))
        if extra_config is not None:
            if not isinstance(extra_config, Mapping):
                raise ConfigError("kv_connector_extra_config", extra_config, "must be a dict", "extra config")
            merged.update(cls._normalise(dict(extra_config), "kv_connector_extra_config", skip))
        return cls.from_dict(merged, source="config")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> StoreConfig:
        """Validate `values` (field name -> raw value) into a config. Unknown keys are errors."""
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            name = _ALIASES.get(key, key)
            if name not in _FIELDS:
                raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(sorted(_FIELDS))}", source)
            kwargs[name] = _PARSERS[name](key, raw, source)
        cfg = cls(**kwargs)
        cfg._check_coherent(source)
        return cfg

    @staticmethod
    def _read_file(path: str, skip: frozenset[str]) -> dict[str, Any]:
        src = f"{ENV_CONFIG_PATH}={path}"
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(ENV_CONFIG_PATH, path, "file not found", "environment") from None
        except json.JSONDecodeError as e:
            raise ConfigError(ENV_CONFIG_PATH, path, f"not valid JSON ({e})", "environment") from None
        if not isinstance(data, dict):
            raise ConfigError(ENV_CONFIG_PATH, path, "must hold a JSON object", "environment")
        return StoreConfig._normalise(data, src, skip)

    @staticmethod
    def _normalise(data: dict[str, Any], source: str, skip: frozenset[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, raw in data.items():
            if key in skip:
                continue
            name = _ALIASES.get(key, key)
            if name not in _FIELDS:
                raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(sorted(_FIELDS))}", source)
            # validate here too, so the error names the source that holds the bad value
            _PARSERS[name](key, raw, source)
            out[name] = raw
        return out

    def _check_coherent(self, source: str) -> None:
        if self.master_server_address is None and self.metadata_server is not None:
            raise ConfigError("metadata_server", self.metadata_server,
                              "set without master_server_address (embedded mode starts its own)", source)
        if self.master_server_address is not None and self.metadata_server is None:
            raise ConfigError("metadata_server", None, "required when master_server_address is set", source)
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ConfigError("rdma_devices", self.rdma_devices, "required when protocol is 'rdma'", source)
        if self.max_pinned_blocks < self.max_inflight_jobs:
            raise ConfigError("max_pinned_blocks", self.max_pinned_blocks,
                              f"smaller than max_inflight_jobs={self.max_inflight_jobs}", source)

    # -- use -----------------------------------------------------------------------------------------

    @property
    def embedded(self) -> bool:
        """True when no master is configured: the connector starts a private one on loopback."""
        return self.master_server_address is None

    def with_addresses(self, master_server_address: str, metadata_server: str) -> StoreConfig:
        """This config pointed at a running master (used to fill in the embedded master's addresses)."""
        return dataclasses.replace(self, master_server_address=_parse_address(
            "master_server_address", master_server_address, "embedded"),
            metadata_server=_parse_metadata("metadata_server", metadata_server, "embedded"))

    def replace(self, **changes: Any) -> StoreConfig:
        """A validated copy with `changes` (same rules as `from_dict`)."""
        values = {f: getattr(self, f) for f in _FIELDS}
        values.update(changes)
        return StoreConfig.from_dict({k: v for k, v in values.items() if v is not None}, source="replace")


# -- field parsers: each returns the typed value or raises ConfigError(field, value) ----------------------


def _int(field: str, raw: Any, source: str, *, minimum: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(field, raw, f"must be an integer, got {type(raw).__name__}", source)
    if raw < minimum:
        raise ConfigError(field, raw, f"must be >= {minimum}", source)
    return raw


def parse_size(field: str, raw: Any, source: str = "config") -> int:
    """Bytes from an int or a string like "4GB" / "512 MiB" (binary units)."""
    if isinstance(raw, bool):
        raise ConfigError(field, raw, "must be a size (int bytes or e.g. '4GB'), got bool", source)
    if isinstance(raw, int):
        if raw < 0:
            raise ConfigError(field, raw, "size must be >= 0", source)
        return raw
    if isinstance(raw, str):
        m = _SIZE_RE.match(raw)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(field, raw, "not a size; use bytes or e.g. '4GB', '512MB', '64 KiB'", source)
        value = float(m.group(1)) * _UNITS[unit]
        if value != int(value):
            raise ConfigError(field, raw, "not a whole number of bytes", source)
        return int(value)
    raise ConfigError(field, raw, f"must be a size (int bytes or e.g. '4GB'), got {type(raw).__name__}", source)


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return bool(_HOST_RE.match(host))


def _parse_address(field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a 'host:port' string, got {type(raw).__name__}", source)
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or not _host_ok(host):
        raise ConfigError(field, raw, "must be 'host:port' with a port in 1..65535", source)
    return raw


def _parse_metadata(field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a string, got {type(raw).__name__}", source)
    if raw == "P2PHANDSHAKE":
        return raw
    parts = urlsplit(raw)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in _METADATA_SCHEMES or not parts.hostname or port is None:
        raise ConfigError(field, raw, "must be 'P2PHANDSHAKE' or a URL like http://host:port/metadata "
                          f"(schemes: {', '.join(_METADATA_SCHEMES)})", source)
    return raw


def _parse_hostname(field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str) or not _host_ok(raw):
        raise ConfigError(field, raw, "must be a host name or IP address", source)
    return raw


def _parse_protocol(field: str, raw: Any, source: str) -> str:
    if raw not in ("tcp", "rdma"):
        raise ConfigError(field, raw, "must be 'tcp' or 'rdma'", source)
    return str(raw)


def _parse_devices(field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a string, got {type(raw).__name__}", source)
    return raw


_PARSERS: dict[str, Any] = {
    "master_server_address": _parse_address,
    "metadata_server": _parse_metadata,
    "local_hostname": _parse_hostname,
    "protocol": _parse_protocol,
    "rdma_devices": _parse_devices,
    "global_segment_size": parse_size,
    "local_buffer_size": lambda f, r, s: _positive_size(f, r, s),
    "rpc_timeout_ms": lambda f, r, s: _int(f, r, s, minimum=1),
    "unhealthy_backoff_ms": lambda f, r, s: _int(f, r, s, minimum=0),
    "max_inflight_jobs": lambda f, r, s: _int(f, r, s, minimum=1),
    "max_pinned_blocks": lambda f, r, s: _int(f, r, s, minimum=1),
    "load_sub_batch_keys": lambda f, r, s: _int(f, r, s, minimum=1),
    "max_key_bytes": lambda f, r, s: _int(f, r, s, minimum=16),
    "store_queue_size": lambda f, r, s: _int(f, r, s, minimum=1),
    "load_queue_size": lambda f, r, s: _int(f, r, s, minimum=1),
}


def _positive_size(field: str, raw: Any, source: str) -> int:
    value = parse_size(field, raw, source)
    if value == 0:
        raise ConfigError(field, raw, "must be > 0", source)
    return value


_FIELDS = tuple(f.name for f in dataclasses.fields(StoreConfig))
if set(_FIELDS) != set(_PARSERS):  # a new field without a parser would skip validation
    raise ImportError(f"StoreConfig fields and parsers differ: {set(_FIELDS) ^ set(_PARSERS)}")

# Documentation of every key (README table), kept next to the fields it describes.
KEY_DOCS: dict[str, str] = {
    "master_server_address": "host:port of an existing mooncake_master; absent: embedded mode (private master "
                             "and metadata server on 127.0.0.1, free ports, stopped at shutdown)",
    "metadata_server": "transfer-engine metadata service: http://host:port/metadata, P2PHANDSHAKE, etcd://..., "
                       "redis://...; required with master_server_address, forbidden without",
    "local_hostname": "address this client advertises to peers (also exported as MC_TCP_BIND_ADDRESS)",
    "protocol": "'tcp' (default) or 'rdma'",
    "rdma_devices": "RDMA NIC list for protocol 'rdma' (Mooncake files may call it device_name)",
    "global_segment_size": "bytes this worker contributes to the distributed pool (0 = consumer only)",
    "local_buffer_size": "staging buffer of Mooncake's copying APIs (> 0; our zero-copy path does not use it)",
    "rpc_timeout_ms": "bound on every client->master RPC (MC_RPC_TIMEOUT_MS); a hung master costs at most this",
    "unhealthy_backoff_ms": "after a master RPC failure (-900/-901) skip store calls this long instead of "
                            "paying a ~4 s reconnect per call",
    "max_inflight_jobs": "cap on store jobs holding pinned blocks (scheduler defers new saves beyond it)",
    "max_pinned_blocks": "cap on blocks pinned by store jobs (>= max_inflight_jobs; a saving role also needs >= "
                         "ceil(max_model_len / block_size), the longest request's blocks, or the connector refuses "
                         "to start)",
    "load_sub_batch_keys": "keys per batch_get_into_multi_buffers call on the load path",
    "max_key_bytes": "longest store key (UTF-8 bytes); a longer key is never sent, its block is reported as a "
                     "load error",
    "store_queue_size": "bound of each worker's store-job queue",
    "load_queue_size": "bound of each worker's load-job queue",
}
if set(KEY_DOCS) != set(_FIELDS):
    raise ImportError(f"StoreConfig fields and KEY_DOCS differ: {set(_FIELDS) ^ set(KEY_DOCS)}")
