"""Store configuration: one frozen `StoreConfig`, validated once at start-up.

Sources, later wins:
    1. defaults (below)
    2. the JSON file named by ``MOONCAKE_CONFIG_PATH`` (Mooncake's usual file, also one written for upstream
       vLLM's ``MooncakeStoreConnector``: see `UPSTREAM_KEYS`)
    3. the connector's ``kv_connector_extra_config`` dict

Every problem raises `ConfigError` naming the source, the field and the offending value, so a typo in a
deployment fails at start-up instead of silently running with a default. Keys the connector itself owns
(not the store) are passed through `StoreConfig.from_sources(..., connector_keys=...)` so that they are
neither rejected nor stored here.

Upstream keys (vLLM 0.32 ``MooncakeStoreConnector``, file and extra config): each is either the same key here,
mapped onto ours (``device_name`` -> ``rdma_devices``, ``cache_prefix`` -> ``namespace``, ``save_decode_cache``
-> ``save_decode``, ``mode`` checked against ``global_segment_size``), accepted at the value that asks for
nothing we lack (e.g. ``load_async: true``, ``tenant_id: "default"``), or refused with a `ConfigError` that
names the key and the value and says what to use instead. The table is `UPSTREAM_KEYS`; docs/vs-upstream.md
renders it.

Derived defaults (each explained in README's settings table):
    * ``max_pinned_blocks`` unset: `derive_pin_cap` from max_model_len, block_size and the GPU block pool
      (`StoreConfig.for_engine`, called by the connector once it knows the engine);
    * ``local_hostname`` unset: 127.0.0.1 with the embedded master or a loopback master, else the address of
      the interface that routes to the master (`advertised_address`), so that other nodes can reach this one.

Sizes are ints (bytes) or strings such as ``"4GB"``, ``"512 MiB"``, ``"1.5gb"``; like Mooncake's own
config parser, ``KB/MB/GB/TB`` are binary (1024-based), as are ``KiB/MiB/GiB/TiB``.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvledger_connector.scheduler_steps import max_job_blocks

ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"
#: upstream's override of the advertised address (vLLM 0.32 mooncake rdma_utils); mapped onto local_hostname
ENV_REQUESTER_HOSTNAME = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"
#: upstream's placement hint from the environment; refused when set (no placement hints here)
ENV_PREFERRED_SEGMENT = "MOONCAKE_PREFERRED_SEGMENT"
#: upstream's load thread count per rank (vLLM envs); mapped onto load_threads, below an explicit setting
ENV_LOAD_RECV_THREADS = "VLLM_MOONCAKE_LOAD_RECV_THREADS"

# Upstream names of our fields: Mooncake config files call the RDMA device list `device_name` (setup() calls
# it rdma_devices); upstream's extra config calls the key namespace `cache_prefix`.
_ALIASES = {"device_name": "rdma_devices", "cache_prefix": "namespace"}
_LOOPBACK = "127.0.0.1"

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
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
    local_hostname: str = ""  # address this client advertises (also MC_TCP_BIND_ADDRESS); "": derived
    protocol: str = "tcp"  # "tcp" or "rdma"
    rdma_devices: str = ""  # comma list of RDMA NICs; "" for tcp
    global_segment_size: int = 512 << 20  # bytes this process contributes to the pool (0: consumer only)
    local_buffer_size: int = 16 << 20  # staging buffer of the copying APIs (zero-copy path does not use it)
    rpc_timeout_ms: int = 2000  # bound on a client->master RPC (MC_RPC_TIMEOUT_MS; Mooncake default 30 s)
    unhealthy_backoff_ms: int = 1000  # after a master RPC failure, skip store calls this long
    max_inflight_jobs: int = 64  # store jobs pinning GPU blocks at once (scheduler cap, S6 BoundedPins)
    max_pinned_blocks: int | None = None  # blocks pinned by store jobs at once (S6); None: for_engine derives
    load_sub_batch_keys: int = 64  # keys per batch_get call on the load path
    max_key_bytes: int = 512  # longer keys are never sent; their blocks are reported as load errors
    store_queue_size: int = 128  # bounded worker store-job queue (put side)
    load_queue_size: int = 128  # bounded worker load-job queue
    namespace: str = ""  # key prefix of this tenant (upstream: cache_prefix); "" none

    def __post_init__(self) -> None:
        self._check_coherent("config")  # first: the derivation below needs a coherent master address
        if not self.local_hostname:  # derived once, so every use (setup, MC_TCP_BIND_ADDRESS) sees one address
            object.__setattr__(self, "local_hostname", advertised_address(self.master_server_address))

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
        if env.get(ENV_PREFERRED_SEGMENT):
            raise ConfigError(ENV_PREFERRED_SEGMENT, env[ENV_PREFERRED_SEGMENT],
                              UPSTREAM_KEYS["preferred_segment"][1], "environment")
        requester = env.get(ENV_REQUESTER_HOSTNAME, "").strip()
        if requester and "local_hostname" not in merged:  # upstream's override, below any explicit setting
            merged["local_hostname"] = _parse_hostname(ENV_REQUESTER_HOSTNAME, requester, "environment")
        return cls.from_dict(merged, source="config")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> StoreConfig:
        """Validate `values` (field name -> raw value) into a config. Unknown keys are errors; upstream
        keys (`UPSTREAM_KEYS`) are mapped, accepted at a value that asks for nothing we lack, or refused."""
        kwargs: dict[str, Any] = {}
        mode: Any = None
        for key, raw in values.items():
            name = _ALIASES.get(key, key)
            if name in UPSTREAM_KEYS:
                _check_upstream(name, raw, source)
                if name == "mode":
                    mode = raw
                continue
            if name not in _FIELDS:
                raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(sorted(_FIELDS))}", source)
            kwargs[name] = _PARSERS[name](key, raw, source)
        try:
            cfg = cls(**kwargs)
        except ConfigError as e:  # from __post_init__: name the source the values came from
            raise ConfigError(e.field, e.value, e.reason, source) from None
        # a set cap below the job cap is a typo; a derived one may be (a small pool: the pin cap binds first)
        if cfg.max_pinned_blocks is not None and cfg.max_pinned_blocks < cfg.max_inflight_jobs:
            raise ConfigError("max_pinned_blocks", cfg.max_pinned_blocks,
                              f"smaller than max_inflight_jobs={cfg.max_inflight_jobs}", source)
        if mode is not None:
            cfg._check_mode(mode, source)
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
            if name in UPSTREAM_KEYS:
                _check_upstream(name, raw, source)  # here too, so the error names the source that holds it
                out[name] = raw
                continue
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

    def _check_mode(self, mode: str, source: str) -> None:
        """Upstream's ``mode`` names who contributes the pool's memory; here that is global_segment_size."""
        if mode == "embedded" and self.global_segment_size == 0:
            raise ConfigError("mode", mode, "with global_segment_size=0: upstream's 'embedded' mode has each "
                              "worker contribute memory; set global_segment_size > 0, or mode 'standalone-store' "
                              "for a worker that contributes none", source)
        if mode == "standalone-store" and self.global_segment_size != 0:
            raise ConfigError("mode", mode, f"with global_segment_size={self.global_segment_size}: upstream's "
                              "'standalone-store' mode has an external mooncake_client own the pool; set "
                              "global_segment_size 0 (this worker contributes no memory)", source)

    def for_engine(self, *, max_model_len: int, block_size: int, num_gpu_blocks: int | None) -> StoreConfig:
        """This config with ``max_pinned_blocks`` derived for the engine when it is unset (`derive_pin_cap`);
        unchanged when it is set (the connector then checks it against the longest request)."""
        if self.max_pinned_blocks is not None:
            return self
        cap = derive_pin_cap(max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                             max_inflight_jobs=self.max_inflight_jobs)
        return dataclasses.replace(self, max_pinned_blocks=cap)

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
        keep_cap = "max_pinned_blocks" not in changes  # may be derived (`for_engine`): below the job cap is fine
        if keep_cap:
            values.pop("max_pinned_blocks")
        cfg = StoreConfig.from_dict({k: v for k, v in values.items() if v is not None}, source="replace")
        return dataclasses.replace(cfg, max_pinned_blocks=self.max_pinned_blocks) if keep_cap else cfg


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


def _parse_namespace(field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str) or not (raw == "" or _NAMESPACE_RE.match(raw)):
        raise ConfigError(field, raw, "must be '' (none) or 1-64 characters of A-Z a-z 0-9 . _ - (it becomes "
                          "the first component of every store key)", source)
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
    "namespace": _parse_namespace,
}


def _positive_size(field: str, raw: Any, source: str) -> int:
    value = parse_size(field, raw, source)
    if value == 0:
        raise ConfigError(field, raw, "must be > 0", source)
    return value


_FIELDS = tuple(f.name for f in dataclasses.fields(StoreConfig))
if set(_FIELDS) != set(_PARSERS):  # a new field without a parser would skip validation
    raise ImportError(f"StoreConfig fields and parsers differ: {set(_FIELDS) ^ set(_PARSERS)}")


# -- derived defaults -----------------------------------------------------------------------------------


def derive_pin_cap(*, max_model_len: int, block_size: int, num_gpu_blocks: int | None,
                   max_inflight_jobs: int) -> int:
    """The default ``max_pinned_blocks``: ``max(L, min(P // 2, J * L))`` with L the most blocks one store
    job pins (`scheduler_steps.max_job_blocks`: the longest request's table), P the GPU block pool,
    J = max_inflight_jobs.

    Why: a store job pins the blocks it reads until every rank reported. While its request runs they are
    the request's own blocks; after the request finishes or is preempted they stay out of the free pool.
    At least L, or the longest request's save could never be admitted; at most half the pool, so saves in
    flight never keep more than half the KV cache from running requests; never above J * L, which J jobs
    of at most L blocks cannot exceed anyway. Without a known pool (P None), J * L."""
    for name, v in (("max_model_len", max_model_len), ("block_size", block_size),
                    ("max_inflight_jobs", max_inflight_jobs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, v, "must be an int >= 1 to derive max_pinned_blocks", "engine")
    if num_gpu_blocks is not None and (isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int)
                                       or num_gpu_blocks < 1):
        raise ConfigError("num_gpu_blocks", num_gpu_blocks, "must be an int >= 1 to derive max_pinned_blocks",
                          "engine")
    longest = max_job_blocks(max_model_len, block_size)
    upper = max_inflight_jobs * longest
    if num_gpu_blocks is not None:
        upper = min(upper, num_gpu_blocks // 2)
    return max(longest, upper)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_address(master_server_address: str | None) -> str:
    """The default ``local_hostname``: 127.0.0.1 with the embedded master (None) or a loopback master (one
    host); otherwise the address of this host's interface that routes to the master, which other nodes
    reach too (a UDP socket connected to the master picks the route; nothing is sent). Raises `ConfigError`
    when there is no route, asking for an explicit ``local_hostname``."""
    if master_server_address is None:
        return _LOOPBACK
    master = _parse_address("master_server_address", master_server_address, "config")
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    if _is_loopback(host):
        return _LOOPBACK
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            ip = str(s.getsockname()[0]).split("%")[0]
    except OSError as e:
        raise ConfigError("local_hostname", "", f"unset, and no route to master_server_address={master!r} to "
                          f"derive it from ({e}); set local_hostname to this host's address that the other "
                          f"nodes reach", "config") from None
    return ip


# -- upstream keys ---------------------------------------------------------------------------------------


def _flag_off(v: Any) -> bool:
    """Upstream reads these flags loosely (bool(...), or str(...).lower() == "true")."""
    return v is None or v is False or v == 0 or (isinstance(v, str) and v.strip().lower() in ("", "false", "0"))


def _flag_on(v: Any) -> bool:
    return v is True or v == 1 or (isinstance(v, str) and v.strip().lower() in ("true", "1"))


_TP_SHARING = ("upstream's cross-TP key layout; keys are per tensor-parallel shard here, so engines share keys only "
               "at the same tensor_parallel_size: remove it")

#: Keys of vLLM 0.32's MooncakeStoreConnector (its MOONCAKE_CONFIG_PATH file and kv_connector_extra_config)
#: that are not our fields: key -> (the values we accept, i.e. those asking for nothing we lack; the reason and
#: what to use instead, in the error for any other value). Aliases of our fields (device_name, cache_prefix)
#: are in _ALIASES; save_decode_cache is the connector's (`map_upstream_connector_keys`).
UPSTREAM_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mode": (lambda v: v in ("embedded", "standalone-store"),
             "must be 'embedded' (this worker contributes global_segment_size > 0) or 'standalone-store' "
             "(global_segment_size 0; an external mooncake_client owns the pool)"),
    "enable_offload": (_flag_off, "Mooncake's SSD offload tier is not wired into this connector: remove it or set "
                                  "false, and size the memory pool with global_segment_size"),
    "tenant_id": (lambda v: v is None or (isinstance(v, str) and v.strip() in ("", "default")),
                  "Mooncake tenants are not used by this connector; to keep tenants' keys apart on one store set "
                  "namespace (upstream's cache_prefix)"),
    "preferred_segment": (lambda v: v is None,
                          "placement hints are not supported: the master places every put; remove it"),
    "enable_lookup": (lambda v: v is None or _flag_on(v),
                      "to save without loading, use kv_role 'kv_producer' instead"),
    "load_async": (lambda v: v is None or _flag_on(v),
                   "loads are always asynchronous here (between steps): remove it"),
    "lookup_async": (_flag_off, "lookups are one batch_is_exist call in the scheduler's step here: remove it"),
    "store_tp_size": (lambda v: v is None, _TP_SHARING),
    "enable_store_tp_lcm": (_flag_off, _TP_SHARING),
    "prefill_tp_sizes": (lambda v: v is None, _TP_SHARING),
    "custom_mem_pool": (lambda v: v is None or v == "",
                        "the KV cache stays in vLLM's own allocator here (registered with Mooncake in place): "
                        "remove it"),
    "enable_group_semantics": (_flag_off, "puts carry no replica groups here: remove it or set false"),
    "enable_cross_layers_blocks": (_flag_off, "a block is stored in vLLM's own per-layer layout here (README: KV "
                                              "cache layouts): remove it or set false"),
    # upstream's ZMQ lookup-server port: no lookup server here (the scheduler asks the store), so any value
    # asks for nothing we lack
    "lookup_rpc_port": (lambda v: True, ""),
}


def _check_upstream(key: str, raw: Any, source: str) -> None:
    accept, why = UPSTREAM_KEYS[key]
    if not accept(raw):
        raise ConfigError(key, raw, f"upstream MooncakeStoreConnector key not supported at this value: {why}",
                          source)


def map_upstream_connector_keys(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` with upstream's connector-side names renamed to ours: ``save_decode_cache`` -> ``save_decode``
    (both also save blocks of generated tokens). Both set to different values is a `ConfigError`."""
    out = dict(extra)
    if "save_decode_cache" in out:
        v = out.pop("save_decode_cache")
        if "save_decode" in out and out["save_decode"] != v:
            raise ConfigError("save_decode_cache", v, f"contradicts save_decode={out['save_decode']!r}; set one",
                              "kv_connector_extra_config")
        out["save_decode"] = v
    return out


# Documentation of every key (README table), kept next to the fields it describes.
KEY_DOCS: dict[str, str] = {
    "master_server_address": "host:port of an existing mooncake_master; absent: embedded mode (private master "
                             "and metadata server on 127.0.0.1, free ports, stopped at shutdown)",
    "metadata_server": "transfer-engine metadata service: http://host:port/metadata, P2PHANDSHAKE, etcd://..., "
                       "redis://...; required with master_server_address, forbidden without",
    "local_hostname": "address this client advertises to peers (also exported as MC_TCP_BIND_ADDRESS); unset: "
                      "127.0.0.1 with the embedded or a loopback master, else the address of the interface that "
                      "routes to the master (MOONCAKE_REQUESTER_LOCAL_HOSTNAME, upstream's override, is honoured)",
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
                         "to start); unset: max(L, min(P // 2, J * L)), L the longest request's blocks, P the GPU "
                         "block pool, J max_inflight_jobs",
    "load_sub_batch_keys": "keys per batch_get_into_multi_buffers call on the load path",
    "max_key_bytes": "longest store key (UTF-8 bytes); a longer key is never sent, its block is reported as a "
                     "load error",
    "store_queue_size": "bound of each worker's store-job queue",
    "load_queue_size": "bound of each worker's load-job queue",
    "namespace": "first component of every store key (upstream: cache_prefix): engines with different namespaces "
                 "never share a key on one store; '' none",
}
if set(KEY_DOCS) != set(_FIELDS):
    raise ImportError(f"StoreConfig fields and KEY_DOCS differ: {set(_FIELDS) ^ set(KEY_DOCS)}")


# -- the connector's whole configuration ------------------------------------------------------------------

#: extra-config keys owned by the connector, not the store (documentation; README's settings table)
CONNECTOR_KEYS: dict[str, str] = {
    "load_threads": "load threads per worker rank (int >= 1, default 1)",
    "save_decode": "also save full blocks of generated tokens (bool, default false: prompt blocks only)",
    "save_partial_tail": "also save a prompt's partial last block under its own key, so a repeated prompt "
                         "loads all but its last token (bool, default false: full blocks only)",
    "max_lookup_cache": "lookup answers remembered for waiting requests (int >= 1, default 4096)",
    "max_kv_events": "KV cache events held for vLLM's publisher between steps (int >= 1, default 10000; the "
                     "oldest dropped and counted in kv_events_dropped); only with kv_events_config enabled",
    "trace_path": "append kvledger's NDJSON trace events (the actions of kvledger/trace.py) to this file (default: off)",
    "tp_rank": "worker rank for in-process multi-rank drivers (tests); vLLM's TP group wins when set up",
    "pp_rank": "pipeline stage for in-process drivers (tests); vLLM's PP group wins when set up",
}

_EXTRA = "kv_connector_extra_config"


def _extra_bool(field: str, raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(field, raw, "must be a bool", _EXTRA)
    return raw


def _extra_int(field: str, raw: Any, minimum: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
        raise ConfigError(field, raw, f"must be an int >= {minimum}", _EXTRA)
    return raw


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector's two sides are configured with, validated once (`from_extra`) and handed
    to both: the store's settings, the connector's own keys (`CONNECTOR_KEYS`) and what vLLM's configs fix
    (block size, world size, kv_role). Built directly (tests), it is validated the same way."""

    store: StoreConfig
    block_size: int
    world_size: int = 1
    save_enabled: bool = True  # kv_role kv_producer | kv_both
    load_enabled: bool = True  # kv_role kv_consumer | kv_both
    save_decode: bool = False
    save_partial_tail: bool = False
    load_threads: int = 1
    max_lookup_cache: int = 4096
    max_kv_events: int = 10_000
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError("store", type(self.store).__name__, "must be a StoreConfig", "connector")
        _int("block_size", self.block_size, "vllm cache_config", minimum=1)
        _int("world_size", self.world_size, "vllm parallel_config", minimum=1)
        for name in ("save_enabled", "load_enabled", "save_decode", "save_partial_tail"):
            _extra_bool(name, getattr(self, name))
        _extra_int("load_threads", self.load_threads, 1)
        _extra_int("max_lookup_cache", self.max_lookup_cache, 1)
        _extra_int("max_kv_events", self.max_kv_events, 1)
        if self.trace_path is not None and not (isinstance(self.trace_path, str) and self.trace_path):
            raise ConfigError("trace_path", self.trace_path, "must be a non-empty path string", _EXTRA)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], *, store: StoreConfig, block_size: int, world_size: int,
                   save_enabled: bool, load_enabled: bool,
                   env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """The connector's keys of `extra` (upstream names already mapped), each validated here once; upstream's
        ``VLLM_MOONCAKE_LOAD_RECV_THREADS`` (from `env`, default the process environment) sets `load_threads`
        when `extra` does not."""
        known = {"save_decode", "save_partial_tail", "load_threads", "max_lookup_cache", "max_kv_events",
                 "trace_path"}
        kw = {k: extra[k] for k in known if k in extra}
        env = os.environ if env is None else env
        raw_threads = env.get(ENV_LOAD_RECV_THREADS, "").strip()
        if raw_threads and "load_threads" not in kw:
            n = int(raw_threads) if raw_threads.isdigit() else 0
            if n < 1:  # upstream clamps to 1; a value that asks for no loads is refused, not guessed at
                raise ConfigError(ENV_LOAD_RECV_THREADS, raw_threads, "must be an int >= 1 (or set load_threads "
                                  "in kv_connector_extra_config)", "environment")
            kw["load_threads"] = n
        if not kw.get("trace_path"):  # "" or null: off
            kw.pop("trace_path", None)
        elif not isinstance(kw["trace_path"], str):
            raise ConfigError("trace_path", kw["trace_path"], "must be a path string", _EXTRA)
        return cls(store=store, block_size=block_size, world_size=world_size, save_enabled=save_enabled,
                   load_enabled=load_enabled, **kw)

    @property
    def max_inflight_jobs(self) -> int:
        return self.store.max_inflight_jobs

    @property
    def max_pinned_blocks(self) -> int:
        """The scheduler's pin cap (a worker needs none): refused while underived."""
        cap = self.store.max_pinned_blocks
        if cap is None:
            raise ConfigError("max_pinned_blocks", None, "not derived yet: build the store config with "
                              "StoreConfig.for_engine first", "connector")
        return cap
