"""The connector's configuration: one table of keys (`KEYS`), read from every source by one reader.

Every key is a `Key` row: its name, its type (which picks the parser), its default, its bounds (every
number has both), whether the ``MOONCAKE_CONFIG_PATH`` file may set it, which object holds it
(`StoreConfig`, `ConnectorConfig`, or the engine facts: the ranks) and its documentation. Upstream
MooncakeStoreConnector's names for our keys and its environment variables are in
kvledger_connector/upstream_keys.py. README's settings table and docs/vs-upstream.md's config tables are
rendered from these tables (``python -m kvledger_connector.config --write``; a test fails on drift).

Sources, later wins: defaults, the JSON file named by ``MOONCAKE_CONFIG_PATH``, ``kv_connector_extra_config``.
Upstream's ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` and ``VLLM_MOONCAKE_LOAD_RECV_THREADS`` set their keys only
when no file or extra config does. Every value, the environment's included, goes through its row's parser;
anything wrong raises `ConfigError` naming the source, the field and the value as given, so a typo fails at
start-up instead of running with a default, and no key is ever dropped unread.

`read_settings` reads the sources into `Settings`; `Settings.store()` builds the `StoreConfig` and
`ConnectorConfig.build` the whole configuration with what vLLM's configs fix (`EngineFigures`), deriving
the pin cap there, once: no consumer sees an underived cap.

Sizes are ints (bytes) or strings such as ``"4GB"``, ``"512 MiB"``, ``"1.5gb"``; like Mooncake's own config
parser, ``KB/MB/GB/TB`` are binary (1024-based), as are ``KiB/MiB/GiB/TiB``.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

from kvledger.errors import LedgerInputError
from kvledger_connector import upstream_keys as upstream
from kvledger_connector.ownfile import read_own_file
from kvledger_connector.upstream_keys import ENV_CONFIG_PATH

__all__ = ["ENV_CONFIG_PATH", "KEYS", "LOAD_FAILURE_POLICIES", "ConfigError", "ConnectorConfig", "EngineFigures",
           "Key", "Settings", "StoreConfig", "advertised_address", "derive_pin_cap", "max_job_blocks", "parse_size",
           "read_settings"]

_EXTRA = "kv_connector_extra_config"
_ENVIRONMENT = "environment"
_LOOPBACK = "127.0.0.1"
_MAX_FILE_BYTES = 1 << 20  # a settings file, not a data file: anything larger is a wrong path
_MAX_TEXT = 4096  # longest string value (PATH_MAX); also bounds a size string before it is parsed

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,12})?)\s*([a-zA-Z]*)\s*$")
_DECIMAL_RE = re.compile(r"^\s*\d{1,20}\s*$")
_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_DEVICES_RE = re.compile(r"^[A-Za-z0-9_.:,/ -]{0,1024}$")
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")


class ConfigError(LedgerInputError):
    """Invalid configuration; the message names the source, the field and the value."""

    def __init__(self, field: str, value: Any, reason: str, source: str = "config") -> None:
        self.source = source
        super().__init__(field, value, reason, f"{source}: {field}={value!r}: {reason}")

    def at(self, source: str) -> ConfigError:
        """The same error, naming `source` (where the value was read)."""
        return ConfigError(self.field, self.value, self.reason, source)


# -- the table ------------------------------------------------------------------------------------------

KeyType = Literal["address", "metadata", "host", "protocol", "devices", "size", "int", "bool", "namespace", "version",
                  "path", "integrity", "firewall"]
Holder = Literal["store", "connector", "engine"]
#: `ConnectorConfig.max_pinned_blocks` given as DERIVED (the default) is derived (`derive_pin_cap`)
DERIVED: Final = 0
#: vLLM's ``kv_load_failure_policy`` values
LOAD_FAILURE_POLICIES = ("fail", "recompute")


def max_job_blocks(max_model_len: int, block_size: int) -> int:
    """The most blocks one store job pins of a KV cache group: the longest request's table,
    ceil(max_model_len / block_size). A partial tail is the table's own last block (read in place, never a
    copy-on-write block outside the table), so it adds nothing."""
    return -(-max_model_len // block_size)


@dataclass(frozen=True)
class Key:
    """One configuration key: how it is parsed and bounded, where it may come from, who holds it."""

    name: str
    type: KeyType
    default: Any
    holder: Holder
    doc: str  # README's "meaning" column
    lo: int | None = None  # int and size keys: both bounds, inclusive
    hi: int | None = None
    in_file: bool = True  # the MOONCAKE_CONFIG_PATH file may set it (else the extra config only)
    shown_default: str | None = None  # README's "default" column when the value alone says too little
    tests: str = ""  # the tests that back a key upstream lacks (docs/vs-upstream.md)

    @property
    def bounds(self) -> tuple[int, int]:
        """(lo, hi) of a number key (the import-time check makes sure every number has both)."""
        if self.lo is None or self.hi is None:
            raise TypeError(f"config key {self.name} ({self.type}) has no bounds")
        return self.lo, self.hi

    def parse(self, field: str, raw: Any, source: str) -> Any:
        """The typed value of `raw`, within this key's bounds, or `ConfigError(field, raw)`."""
        return _PARSERS[self.type](self, field, raw, source)

    def parse_text(self, field: str, text: str, source: str) -> Any:
        """`parse` for a string from the environment: numbers are decimal digits; the error names `text`."""
        try:
            if self.type != "int":
                return self.parse(field, text.strip(), source)
            if not _DECIMAL_RE.match(text):
                lo, hi = self.bounds
                raise ConfigError(field, text, f"must be a decimal integer in {lo}..{hi}", source)
            return self.parse(field, int(text), source)
        except ConfigError as e:
            raise ConfigError(field, text, f"{e.reason} (or set {self.name} in {_EXTRA})", source) from None


def _size_text(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _bounded(key: Key, field: str, raw: Any, value: int, source: str) -> int:
    lo, hi = key.bounds
    if value < lo:
        why = "must be > 0" if key.type == "size" and lo == 1 else f"must be >= {lo}"
        raise ConfigError(field, raw, why, source)
    if value > hi:
        raise ConfigError(field, raw, f"must be <= {_size_text(hi) if key.type == 'size' else hi}", source)
    return value


def _parse_int(key: Key, field: str, raw: Any, source: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(field, raw, f"must be an integer, got {type(raw).__name__}", source)
    return _bounded(key, field, raw, raw, source)


def parse_size(field: str, raw: Any, source: str = "config") -> int:
    """Bytes from an int or a string like "4GB" / "512 MiB" (binary units), exactly (no float rounding);
    the bounds are the key's (`Key.parse`)."""
    if isinstance(raw, bool):
        raise ConfigError(field, raw, "must be a size (int bytes or e.g. '4GB'), got bool", source)
    if isinstance(raw, int):
        if raw < 0:
            raise ConfigError(field, raw, "size must be >= 0", source)
        return raw
    if isinstance(raw, str):
        m = _SIZE_RE.match(raw) if len(raw) <= 64 else None
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(field, raw, "not a size; use bytes or e.g. '4GB', '512MB', '64 KiB'", source)
        value = Fraction(m.group(1)) * _UNITS[unit]
        if value.denominator != 1:
            raise ConfigError(field, raw, "not a whole number of bytes", source)
        return int(value)
    raise ConfigError(field, raw, f"must be a size (int bytes or e.g. '4GB'), got {type(raw).__name__}", source)


def _parse_size(key: Key, field: str, raw: Any, source: str) -> int:
    return _bounded(key, field, raw, parse_size(field, raw, source), source)


def _parse_bool(key: Key, field: str, raw: Any, source: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(field, raw, "must be a bool", source)
    return raw


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return bool(_HOST_RE.match(host))


def _parse_address(key: Key | None, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a 'host:port' string, got {type(raw).__name__}", source)
    host, sep, port = raw.rpartition(":")
    if (not sep or not host or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536
            or not _host_ok(host)):
        raise ConfigError(field, raw, "must be 'host:port' with a port in 1..65535", source)
    return raw


def _parse_metadata(key: Key | None, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a string, got {type(raw).__name__}", source)
    if raw == "P2PHANDSHAKE":
        return raw
    parts = urlsplit(raw) if len(raw) <= _MAX_TEXT else None
    try:
        port = parts.port if parts is not None else None
    except ValueError:
        port = None
    if parts is None or parts.scheme not in _METADATA_SCHEMES or not parts.hostname or port is None:
        raise ConfigError(field, raw, "must be 'P2PHANDSHAKE' or a URL like http://host:port/metadata "
                          f"(schemes: {', '.join(_METADATA_SCHEMES)})", source)
    return raw


def _parse_host(key: Key, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str) or not _host_ok(raw):
        raise ConfigError(field, raw, "must be a host name or IP address", source)
    return raw


def _parse_protocol(key: Key, field: str, raw: Any, source: str) -> str:
    if raw not in ("tcp", "rdma") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'tcp' or 'rdma'", source)
    return raw


def _parse_devices(key: Key, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a string, got {type(raw).__name__}", source)
    if not _DEVICES_RE.match(raw):
        raise ConfigError(field, raw, "must be a comma list of device names (A-Z a-z 0-9 _ . : / - and spaces), "
                          "at most 1024 characters", source)
    return raw


def _key_part(field: str, raw: Any, source: str, where: str) -> str:
    """'' or 1-64 of A-Z a-z 0-9 . _ -: a value that goes into every store key (`where`)."""
    if not isinstance(raw, str) or not (raw == "" or _NAMESPACE_RE.match(raw)):
        raise ConfigError(field, raw, f"must be '' (none) or 1-64 characters of A-Z a-z 0-9 . _ - ({where})", source)
    return raw


def _parse_namespace(key: Key, field: str, raw: Any, source: str) -> str:
    return _key_part(field, raw, source, "it becomes the first component of every store key")


def _parse_version(key: Key, field: str, raw: Any, source: str) -> str:
    return _key_part(field, raw, source, "it goes into every store key's layout digest")


def _parse_integrity(key: Key, field: str, raw: Any, source: str) -> str:
    if raw not in ("checksum", "mac", "off") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'checksum', 'mac' or 'off'", source)
    return raw


def _parse_firewall(key: Key, field: str, raw: Any, source: str) -> str:
    if raw not in ("off", "nftables") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'off' or 'nftables'", source)
    return raw


def integrity_mode(mode: str | None, secret_file: str | None, *, embedded: bool) -> str:
    """The integrity an engine runs with: the one rule for an unset `integrity` and the secret's source.

        integrity        integrity_secret_file   store        ->
        unset or mac     set                     any          mac, the operator's secret
        unset or mac     unset                   embedded     mac, a secret generated for the engine
                                                              (kvledger_connector/store/rendezvous.py `engine_secret`)
        unset            unset                   configured   checksum (logged at start-up: no forger is stopped)
        mac              unset                   configured   refused: engines that share a store need one secret
        checksum or off  set                     any          refused: only mac uses a secret
    """
    if secret_file is not None:
        if mode not in (None, "mac"):
            raise ConfigError("integrity_secret_file", secret_file,
                              f"set with integrity={mode!r}; a secret is used only by 'mac'", "connector")
        return "mac"
    if mode is None:
        return "mac" if embedded else "checksum"
    if mode == "mac" and not embedded:
        raise ConfigError("integrity_secret_file", None, "required by integrity 'mac' with a configured "
                          "master_server_address: every engine that shares the store must read the same secret",
                          "connector")
    return mode


def _parse_path(key: Key, field: str, raw: Any, source: str) -> str | None:
    if raw is None or raw == "":  # off
        return None
    if not isinstance(raw, str) or "\0" in raw or len(raw) > _MAX_TEXT:
        raise ConfigError(field, raw, f"must be a path string of at most {_MAX_TEXT} characters ('' or null: off)",
                          source)
    return raw


_PARSERS: dict[str, Callable[[Key, str, Any, str], Any]] = {
    "address": _parse_address, "metadata": _parse_metadata, "host": _parse_host, "protocol": _parse_protocol,
    "devices": _parse_devices, "size": _parse_size, "int": _parse_int, "bool": _parse_bool,
    "namespace": _parse_namespace, "version": _parse_version, "path": _parse_path,
    "integrity": _parse_integrity, "firewall": _parse_firewall,
}

_T = 1 << 40
_MS_BOUND = 600_000  # ten minutes: a longer RPC bound or back-off stalls an engine step, not a cap
#: the smallest memory segment Mooncake's setup() takes (-600, "Total size must be at least 16777216")
MIN_OFFLOAD_SEGMENT = 16 << 20

KEYS: tuple[Key, ...] = (
    # -- the Mooncake client (StoreConfig)
    Key("master_server_address", "address", None, "store",
        "host:port of an existing mooncake_master; absent: embedded mode (a private master on 127.0.0.1, free "
        "ports, stopped at shutdown; no metadata server: `P2PHANDSHAKE`)", shown_default="absent"),
    Key("metadata_server", "metadata", None, "store",
        "transfer-engine metadata service; required with `master_server_address`, not allowed without it",
        shown_default="absent"),
    Key("local_hostname", "host", "", "store",
        "address this client advertises (also exported as `MC_TCP_BIND_ADDRESS`). Unset: 127.0.0.1 in embedded "
        "mode or with a loopback master (one host); with a master on another host, the address of this host's "
        "interface that routes to the master (what the other nodes reach; no route: start-up error asking for it)",
        shown_default="derived",
        tests="test_config.py::test_advertised_address_is_loopback_with_a_loopback_master, "
              "::test_advertised_address_routes_to_a_remote_master"),
    Key("protocol", "protocol", "tcp", "store", "transfer protocol"),
    Key("rdma_devices", "devices", "", "store", "RDMA NIC list, required for rdma"),
    Key("global_segment_size", "size", 512 << 20, "store",
        "bytes this worker contributes to the pool (0 = consumer only)", lo=0, hi=4 * _T),
    Key("local_buffer_size", "size", 16 << 20, "store",
        "staging buffer of Mooncake's copying APIs (the zero-copy path does not use it)", lo=1, hi=_T),
    Key("rpc_timeout_ms", "int", 2000, "store",
        "bound on every client→master RPC (`MC_RPC_TIMEOUT_MS`): a hung master costs at most this",
        lo=1, hi=_MS_BOUND, tests="test_store_faults.py::test_hung_master_times_out_with_901_within_rpc_timeout"),
    Key("transfer_timeout_s", "int", 10, "store",
        "bound on a transfer that makes no progress, e.g. from a peer that holds the bytes and is frozen "
        "(`MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_TCP_STATUS_TIMEOUT_SEC`; Mooncake's default 30): such a get or "
        "put returns -800 and its blocks are reported, so a frozen peer holds a job's pins this long at most. "
        "Read when each client is set up",
        lo=1, hi=3600, tests="test_store_faults.py::test_a_frozen_holder_fails_a_get_within_transfer_timeout, "
                             "test_connector_faults.py::test_a_frozen_holder_costs_load_errors_never_a_stall"),
    Key("unhealthy_backoff_ms", "int", 1000, "store",
        "after a master failure (-900/-901) the store's breaker opens: every call is skipped (a miss, a failed "
        "save or load) instead of paying a reconnect per call, until a probe the store's own thread sends "
        "after this long is answered",
        lo=1, hi=_MS_BOUND,
        tests="test_store_faults.py::test_killed_master_gives_codes_then_fast_skips_then_recovers_without_old_keys"),
    Key("max_unhealthy_backoff_ms", "int", 30_000, "store",
        "each failed probe doubles the wait for the next, from `unhealthy_backoff_ms` up to this (never below "
        "`unhealthy_backoff_ms`); the first probe the master answers closes the breaker. A master dead for "
        "good then costs the prober one RPC per this long, and the engine nothing",
        lo=1, hi=_MS_BOUND,
        tests="test_store_raw_faults.py::test_master_failures_in_a_row_double_the_backoff_and_an_answer_resets_it"),
    Key("max_inflight_jobs", "int", 64, "connector",
        "cap on store jobs holding pinned blocks; beyond it the scheduler defers saves (retried, not dropped)",
        lo=1, hi=1 << 16, tests="test_connector_e2e.py::test_cap_defers_saves_and_everything_still_drains"),
    Key("max_held_requests", "int", 64, "connector",
        "finished requests whose save the caps deferred, kept by vLLM (`request_finished` delays the free) "
        "until that save is stored: their blocks stay allocated meanwhile. Past it a finishing request's "
        "deferred save is given up (`saves_dropped`); 0: never hold (every such save given up)",
        lo=0, hi=1 << 16, tests="test_held_saves.py::test_a_save_deferred_past_its_finish_is_stored_and_hits, "
                                "::test_held_requests_are_bounded"),
    Key("load_sub_batch_keys", "int", 64, "store", "keys per `batch_get_into_multi_buffers` call", lo=1, hi=1 << 12,
        tests="test_connector_worker.py::test_failing_first_sub_batch_at_rank_gt0_reports_every_unloaded_block"),
    Key("max_key_bytes", "int", 512, "store",
        "longest store key (UTF-8 bytes); a longer key is never sent, its block is reported as a load error",
        lo=16, hi=1 << 12, tests="test_connector_worker.py::test_oversized_keys_are_reported_not_sent"),
    Key("store_queue_size", "int", 128, "store", "bound of each worker's store-job queue", lo=1, hi=1 << 16,
        tests="test_connector_worker.py::test_full_store_queue_reports_rejected_job_at_once"),
    Key("load_queue_size", "int", 128, "store", "bound of each worker's load-job queue", lo=1, hi=1 << 16,
        tests="test_connector_worker.py::test_full_load_queue_reports_every_block"),
    Key("namespace", "namespace", "", "store",
        "first component of every key: tenants sharing a store with different namespaces never share a key"),
    # -- Mooncake's disk tier (docs/disk-tier.md)
    Key("disk_offload", "bool", False, "store",
        "Mooncake's disk tier: objects in this client's memory segment are also written to files under "
        "`disk_offload_dir`, and read back from there once evicted from memory (a key on disk answers a lookup "
        "as present). The master must run with `--enable_offload=true` (else start-up fails with -1300). A "
        "client with no segment (`global_segment_size` 0) writes nothing itself: the segment's owner does",
        tests="test_disk_tier.py::test_a_working_set_four_times_the_segment_is_read_back_from_disk_byte_exact"),
    Key("disk_offload_dir", "path", None, "store",
        "directory under which each client owning a segment makes its own private directory (mode 0700, removed "
        "when the client closes; one left by a killed client is removed by the next client) for the tier's files; "
        "created 0700 when absent; refused unless this user's directory, not a link, that no one else may write. "
        "Required with `disk_offload` and a segment",
        shown_default="none",
        tests="test_disk_tier.py::test_a_directory_others_may_write_is_refused_by_name, "
              "::test_directories_of_clients_killed_without_closing_are_swept_by_the_next_client"),
    Key("disk_offload_size", "size", 16 << 30, "store",
        "bound on each client's files on disk; past it the least recently used objects' files are removed "
        "(they are then misses). Mooncake also keeps 256 MiB of their file system free, removing files likewise",
        lo=16 << 20, hi=1 << 50,
        tests="test_disk_tier.py::test_the_disk_bound_evicts_files_and_leaves_misses_never_wrong_bytes, "
              "::test_a_file_system_that_fills_up_below_the_bound_keeps_what_fits_and_never_reads_wrong_bytes"),
    Key("disk_offload_staging_size", "size", 64 << 20, "store",
        "the segment owner's buffer for reads from its files (Mooncake's default 1.25 GiB per client): one "
        "`batch_get`'s disk-resident objects must fit in it, else each of them fails (-10). With the tier a "
        "worker's batch gets take at most as many keys as it holds for each of the engine's ranks at once "
        "(fewer than `load_sub_batch_keys` where needed); a size that holds not one key per rank is refused",
        lo=16 << 20, hi=16 << 30,
        tests="test_disk_tier.py::test_bad_tier_settings_are_refused_by_name, "
              "test_job_steps.py::test_a_load_batch_fits_the_tiers_staging_buffer"),
    Key("disk_offload_heartbeat_s", "int", 1, "store",
        "how often the client writes new objects to disk (Mooncake's default 10): an object's memory stays "
        "taken until it is written, so a put into a full segment fails meanwhile", lo=1, hi=60,
        tests="test_disk_tier.py::test_a_working_set_four_times_the_segment_is_read_back_from_disk_byte_exact"),
    Key("full_put_retries", "int", 20, "store",
        "with `disk_offload`: times a put's keys that found the memory segment full (-200) are put again, each "
        "after `full_put_retry_ms`, while the tier writes objects out and frees their memory (counted in "
        "`full_put_retries`); past them the save fails under pressure, as without the tier. Without the tier a "
        "full store fails the save at once", lo=0, hi=100,
        tests="test_job_steps.py::test_a_put_into_a_full_segment_is_retried_with_the_tier_then_fails"),
    Key("full_put_retry_ms", "int", 250, "store",
        "the wait before each of `full_put_retries`: the tier frees an object's memory once it is written (at a "
        "`disk_offload_heartbeat_s`) and its lease has run out; by default a put waits up to 5 s for room. A "
        "worker's store thread waits, its later saves queue behind (backpressure)", lo=1, hi=60_000,
        tests="test_job_steps.py::test_a_put_into_a_full_segment_is_retried_with_the_tier_then_fails"),
    # -- the connector's two sides (ConnectorConfig)
    Key("max_pinned_blocks", "int", DERIVED, "connector",
        "cap on pinned blocks. Unset: max(L, min(P / 2, J × L)) with L = ceil(`max_model_len`/`block_size`) the "
        "longest request's blocks, P the GPU block pool, J = `max_inflight_jobs`: at least L (else the longest "
        "prompt could never be saved), at most half the pool (saves in flight never keep more than half the KV "
        "cache from running requests; their blocks stay pinned after a request finishes or is preempted), never "
        "above J × L (J jobs cannot pin more). E.g. 128K tokens, block 16, 20,000 blocks: 10,000. Set: ≥ "
        "`max_inflight_jobs`, and for a saving role ≥ L, else the connector refuses to start",
        lo=1, hi=1 << 30, shown_default="derived",
        tests="test_config.py::test_derived_pin_cap, test_connector_config.py::test_pin_cap_is_derived_from_the_"
              "engine_when_unset, ::test_pin_cap_below_the_longest_request_is_refused_at_start"),
    Key("load_threads", "int", 1, "connector", "load threads per rank", lo=1, hi=64,
        tests="test_connector_config.py::test_upstream_load_recv_threads_env_sets_load_threads"),
    Key("save_decode", "bool", False, "connector", "also save full blocks of generated tokens (default: prompt "
        "blocks only)"),
    Key("save_partial_tail", "bool", False, "connector",
        "also save a prompt's partial last block (at least 2 tokens past a full block) under its own key, so a "
        "repeated prompt loads all but its last token; off by default like upstream's (one more key per prompt; "
        "multimodal and prompt-embedding requests never use it; a block stored as several keys, KV cache groups or "
        "head shards, has a tail key per part; refused for a model with Mamba layers)",
        tests="test_partial_tail.py::test_tail_is_saved_and_a_repeated_prompt_loads_all_but_its_last_token, "
              "::test_a_tail_of_a_block_stored_as_several_keys_is_saved_and_loaded_by_every_key, "
              "test_mamba_hybrid.py::test_partial_tails_are_refused_for_a_mamba_hybrid_by_name"),
    Key("sync_load_max_tokens", "int", 256, "connector",
        "a load of at most this many tokens runs inside the engine step that schedules its request (vLLM's "
        "`load_kv_async=False`: every rank loads before the forward); a longer one runs on the load threads "
        "while the request waits in WAITING_FOR_REMOTE_KVS, holding its blocks and admitted past "
        "`max_num_seqs`. 0: every load asynchronous (upstream's behaviour). Only under vLLM's "
        "`kv_load_failure_policy` \"fail\" (its default): under \"recompute\" vLLM keeps a failed sync load's "
        "blocks in its prefix cache, so every load is asynchronous there, as for a hybrid model (vLLM takes "
        "a failed load of several KV cache groups per request)", lo=0, hi=1 << 24,
        tests="test_sync_loads.py::test_short_load_runs_in_the_step_that_schedules_it, "
              "::test_sync_load_max_tokens_zero_keeps_every_load_async, "
              "::test_recompute_policy_keeps_every_load_async"),
    Key("lookup_timeout_ms", "int", 200, "connector",
        "deadline of each store call the scheduler makes inside an engine step (lookups, the KV-events "
        "check); one past it answers a miss and opens the store's breaker, so a store that stops answering "
        "costs one step this long, not a reconnect (~4-5 s) per lookup", lo=1, hi=60_000,
        tests="test_store_breaker.py::test_a_lookup_past_its_deadline_misses_and_trips_the_breaker"),
    Key("max_lookup_cache", "int", 4096, "connector",
        "lookup answers kept for waiting requests (vLLM asks again every step)", lo=1, hi=1 << 20,
        tests="test_connector_e2e.py::test_lookup_cache_is_bounded"),
    Key("max_kv_events", "int", 10_000, "connector",
        "KV cache events (`BlockStored` / `BlockRemoved`, medium `CPU`) held between two steps for vLLM's "
        "publisher, only with `--kv-events-config` enabled; the oldest dropped and counted (`kv_events_dropped`). "
        "vLLM collects them every step, so the cap only bites when one step collects more",
        lo=1, hi=1 << 22, tests="test_kv_events.py::test_max_kv_events_refuses_bad_values, "
                                "::test_pending_events_are_bounded_oldest_dropped"),
    Key("integrity", "integrity", None, "connector",
        "a tag over every stored block's bytes, in an 80-byte trailer of its object, computed where the KV "
        "cache lives and checked before a load reports the block loaded (a mismatch is a load error). "
        "\"mac\": keyed by a secret, so a store client without it cannot make a value that loads (the "
        "default: with the embedded store a secret generated per engine in the private runtime directory, "
        "else `integrity_secret_file`); \"checksum\": anyone can compute it (catches corruption, a block "
        "under another key, a careless overwrite; the default with a configured master and no secret file, "
        "logged at start-up); \"off\": no trailer. In every key's layout digest",
        shown_default="mac (embedded store or a secret file), else checksum",
        tests="test_integrity.py::test_a_same_size_overwrite_is_a_load_error_never_loaded, "
              "::test_mac_needs_the_secret_and_engines_with_other_secrets_share_no_key, "
              "::test_the_embedded_default_refuses_a_recomputed_checksum_tag"),
    Key("integrity_secret_file", "path", None, "connector",
        "the deployment secret for integrity \"mac\" (32-4096 random bytes, refused when "
        "patterned or of under 8 distinct byte values; a regular file of this user, mode 0600; "
        "opened without following links); the same file on every engine that shares the store. Unset with "
        "the embedded store: a secret generated for the engine",
        shown_default="none", tests="test_integrity.py::test_the_secret_file_is_refused_unless_private, "
                                    "test_rendezvous.py::test_a_generated_secret_is_refused_unless_private"),
    Key("firewall", "firewall", "off", "connector",
        "\"nftables\": each process of the engine closes every TCP port its store listens on (its Mooncake "
        "client's handshake, data and disk-tier ports; the master's RPC and metrics ports where it started them) "
        "to every other local uid, with an nftables table of its own (`meta skuid` on the output hook), created "
        "at start, deleted at shutdown, swept at the next start after a crash; needs root and the nft command "
        "(else start-up fails naming this key). \"off\": the operator's recipe in docs/security.md, or none",
        shown_default="off",
        tests="test_shared_host_firewall.py::test_the_connectors_firewall_shuts_out_another_uid_and_loads_still_hit, "
              "::test_a_killed_processs_table_is_swept_at_the_next_start, "
              "::test_the_firewall_opt_in_fails_start_up_by_name_without_nft"),
    Key("trace_path", "path", None, "connector",
        "NDJSON trace of the shared-vocabulary events (schema: `kvledger.trace.EVENTS`), one file per process "
        "(checked by `python -m conformance.runlog`); appended to only as this user's regular file, not a link, "
        "that no one else may write (created mode 0600)", shown_default="off",
        tests="test_runlog.py::test_real_log_is_accepted, "
              "test_connector_e2e.py::test_trace_path_writes_the_shared_vocabulary, "
              "test_config.py::test_a_trace_path_is_opened_as_every_file_an_operator_names"),
    # -- the engine's ranks (kvledger_connector/shape/engine_facts.py checks them against vLLM's groups)
    Key("tp_rank", "int", None, "engine", "worker rank, only for in-process multi-rank drivers (tests); vLLM's TP "
        "group wins, and a worker of a group of several ranks with neither refuses to start", lo=0, hi=1 << 16,
        in_file=False, shown_default="vLLM's",
        tests="test_kv_layouts.py::test_worker_without_a_rank_refuses_to_guess"),
    Key("weights_version", "version", "", "engine",
        "the model's weights version, in every key's layout digest next to vLLM's hash of the model config "
        "(`ModelConfig.compute_hash`: path, revision, quantization, dtype, overrides) and the block hash "
        "algorithm: bump it when the weights change under the same model config (an RL update), and no engine "
        "reads the old weights' KV",
        tests="test_keys.py::test_model_identity_is_in_the_key, "
              "test_namespace.py::test_a_bumped_weights_version_never_loads_the_old_kv"),
    Key("weights_version_file", "path", None, "engine",
        "a file holding the weights version (as `weights_version`; this user's, writable by no one else), read "
        "at start-up and again at every `reset_cache` (vLLM's `reset_prefix_cache(reset_connector=True)`): an RL "
        "loop that writes the new version there (a new file renamed over the old) and resets after each weight "
        "update moves the engine's keys to it, so no other engine's old-weights KV is read. Excludes "
        "`weights_version`", shown_default="none",
        tests="test_namespace.py::test_a_weights_version_bumped_at_reset_never_reads_the_old_kv, "
              "::test_a_bad_weights_version_file_is_refused_by_name"),
    Key("store_replicated_kv_once", "bool", True, "engine",
        "ranks that hold identical KV (MLA's latent on every TP rank; KV heads vLLM replicates when TP exceeds "
        "the model's KV heads) share one key per block and each key is put by one of them, so the store holds "
        "one copy; false: every rank stores its own copy under its own keys (earlier versions' keys)",
        tests="test_replicated_kv.py::test_mla_at_tp2_stores_one_copy_and_every_rank_loads_it, "
              "::test_per_rank_copies_when_turned_off"),
    Key("kv_heads_per_key", "int", 0, "engine",
        "the TP-shared store layout (opt-in): each key holds this many of the model's KV heads of a block and names "
        "them instead of a TP rank, so engines at different TP sizes share a prefix (a TP 2 engine's saves load "
        "into TP 1 and TP 4 engines). It must divide the KV heads each rank holds (1 serves every TP size; with "
        "MLA, or more TP ranks than KV heads, 1). Every engine sharing the keys sets the same value; a rank puts "
        "heads/k keys per block. 0: a key per TP shard (the keys of earlier versions). Not with "
        "`store_replicated_kv_once` false, nor for a model with Mamba layers", lo=0, hi=1 << 16,
        tests="test_tp_shared_layout.py::test_a_tp2_engine_saves_and_tp1_and_tp4_ranks_load_it_byte_exact, "
              "::test_kv_heads_per_key_that_does_not_divide_a_ranks_heads_is_refused"),
    Key("pp_rank", "int", None, "engine", "pipeline stage, only for in-process drivers (tests); vLLM's PP group "
        "wins", lo=0, hi=1 << 16, in_file=False, shown_default="vLLM's",
        tests="test_kv_layouts.py::test_worker_without_a_rank_refuses_to_guess"),
)
BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


def _holds(holder: Holder) -> tuple[Key, ...]:
    return tuple(k for k in KEYS if k.holder == holder)


def _is_default(key: Key, value: Any) -> bool:
    return value is key.default or (type(value) is type(key.default) and value == key.default)


def _check_fields(obj: Any, holder: Holder) -> None:
    """Every table key `obj` holds, through its row (so a config built in code is checked like one read
    from a source); a default is valid by construction (None / "": absent, DERIVED: derived)."""
    for key in _holds(holder):
        value = getattr(obj, key.name)
        if not _is_default(key, value):
            object.__setattr__(obj, key.name, key.parse(key.name, value, "config"))


# -- the store's settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreConfig:
    """The Mooncake client's settings and the worker's store/load bounds, each checked through its `KEYS` row.

    `master_server_address` None means *embedded mode*: the connector starts a private master on 127.0.0.1
    (kvledger_connector/store/embedded.py) and fills in its address and ``P2PHANDSHAKE`` (no metadata server).
    """

    master_server_address: str | None = None
    metadata_server: str | None = None
    local_hostname: str = ""  # "": derived (`advertised_address`)
    protocol: str = "tcp"
    rdma_devices: str = ""
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 16 << 20
    rpc_timeout_ms: int = 2000
    transfer_timeout_s: int = 10
    unhealthy_backoff_ms: int = 1000
    max_unhealthy_backoff_ms: int = 30_000
    load_sub_batch_keys: int = 64
    max_key_bytes: int = 512
    store_queue_size: int = 128
    load_queue_size: int = 128
    namespace: str = ""
    disk_offload: bool = False
    disk_offload_dir: str | None = None
    disk_offload_size: int = 16 << 30
    disk_offload_staging_size: int = 64 << 20
    disk_offload_heartbeat_s: int = 1
    full_put_retries: int = 20
    full_put_retry_ms: int = 250

    def __post_init__(self) -> None:
        _check_fields(self, "store")
        if self.disk_offload_dir is not None and not self.disk_offload:
            raise ConfigError("disk_offload_dir", self.disk_offload_dir, "set without disk_offload true")
        if self.disk_offload and self.global_segment_size > 0:
            if self.disk_offload_dir is None:
                raise ConfigError("disk_offload_dir", None, "required with disk_offload and a memory segment "
                                  "(global_segment_size > 0): a directory on the disk to hold the tier")
            if not os.path.isabs(self.disk_offload_dir):
                raise ConfigError("disk_offload_dir", self.disk_offload_dir, "must be an absolute path")
            if self.global_segment_size < MIN_OFFLOAD_SEGMENT:
                raise ConfigError("global_segment_size", self.global_segment_size,
                                  f"must be >= {_size_text(MIN_OFFLOAD_SEGMENT)} with disk_offload (Mooncake's "
                                  "setup() refuses a smaller segment)")
        if self.master_server_address is None and self.metadata_server is not None:
            raise ConfigError("metadata_server", self.metadata_server,
                              "set without master_server_address (embedded mode starts its own)")
        if self.master_server_address is not None and self.metadata_server is None:
            raise ConfigError("metadata_server", None, "required when master_server_address is set")
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ConfigError("rdma_devices", self.rdma_devices, "required when protocol is 'rdma'")
        if not self.local_hostname:  # derived once, so every use (setup, MC_TCP_BIND_ADDRESS) sees one address
            object.__setattr__(self, "local_hostname", advertised_address(self.master_server_address))

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                     ignore: Iterable[str] = ()) -> StoreConfig:
        """The store's part of `read_settings` (every key of every source is still checked)."""
        return read_settings(extra_config, env=env, ignore=ignore).store()

    @property
    def embedded(self) -> bool:
        """True when no master is configured: the connector starts a private one on loopback."""
        return self.master_server_address is None

    def with_addresses(self, master_server_address: str, metadata_server: str) -> StoreConfig:
        """This config pointed at a running master (used to fill in the embedded master's addresses)."""
        try:
            return dataclasses.replace(self, master_server_address=master_server_address,
                                       metadata_server=metadata_server)
        except ConfigError as e:
            raise e.at("embedded") from None

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with `changes`, checked like any other."""
        try:
            return dataclasses.replace(self, **changes)
        except ConfigError as e:
            raise e.at("replace") from None


# -- reading the sources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Every key the sources gave, parsed (typed, within its bounds), and the source that set each."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def get(self, name: str) -> Any:
        """The value given for `name`, None when no source gave it."""
        if name not in BY_NAME:
            raise KeyError(f"{name!r} is not a config key")
        return self.values.get(name)

    def given(self, holder: Holder) -> dict[str, Any]:
        return {k.name: self.values[k.name] for k in _holds(holder) if k.name in self.values}

    def sourced(self, e: ConfigError) -> ConfigError:
        """`e` naming the source of its field's value (a cross-field check knows only the field)."""
        return e.at(self.sources[e.field]) if e.field in self.sources else e

    def store(self) -> StoreConfig:
        try:
            return StoreConfig(**self.given("store"))
        except ConfigError as e:
            raise self.sourced(e) from None


def _read_file(path: str) -> Mapping[str, Any]:
    """The ``MOONCAKE_CONFIG_PATH`` file, checked as every file an operator names (`read_own_file`): it sets
    the master's address and may turn integrity off, so only this user's regular file, not a link, that no
    one else may write, of at most 1 MiB."""
    src = _ENVIRONMENT
    try:
        blob = read_own_file(ENV_CONFIG_PATH, path, max_bytes=_MAX_FILE_BYTES, private=False)
    except LedgerInputError as e:
        raise ConfigError(ENV_CONFIG_PATH, path, e.reason, src) from None
    try:
        data = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(ENV_CONFIG_PATH, path, f"not valid JSON ({e})", src) from None
    if not isinstance(data, dict):
        raise ConfigError(ENV_CONFIG_PATH, path, "must hold a JSON object", src)
    return data


def _read_source(data: Mapping[str, Any], source: str, *, file: bool, ignore: frozenset[str],
                 values: dict[str, Any], sources: dict[str, str], checked: dict[str, tuple[Any, str]]) -> None:
    """One source's keys into `values` (over earlier sources'); upstream's own keys into `checked`."""
    given_as: dict[str, tuple[str, Any]] = {}  # our key -> (the name it was given under, raw), in this source
    for key, raw in data.items():
        if key in ignore:
            continue
        if not isinstance(key, str):
            raise ConfigError(str(key), raw, "keys must be strings", source)
        row = upstream.CHECKED.get(key)
        if row is not None:
            reason = row.refusal(raw)
            if reason is not None:
                raise ConfigError(key, raw, reason, source)
            checked[key] = (raw, source)
            continue
        name = upstream.ALIASES.get(key, key)
        spec = BY_NAME.get(name)
        if spec is None:
            raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(sorted(BY_NAME))}", source)
        if file and not spec.in_file:
            raise ConfigError(key, raw, f"not read from the file: set it in {_EXTRA}", source)
        value = spec.parse(key, raw, source)
        if name in given_as and values[name] != value:  # e.g. save_decode_cache and save_decode disagree
            (other, other_raw), (alias, alias_raw) = given_as[name], (key, raw)
            if alias == name:
                (other, other_raw), (alias, alias_raw) = (alias, alias_raw), (other, other_raw)
            raise ConfigError(alias, alias_raw, f"contradicts {other}={other_raw!r}; set one", source)
        given_as[name] = (key, raw)
        values[name], sources[name] = value, source


def read_settings(extra_config: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                  ignore: Iterable[str] = ()) -> Settings:
    """Defaults <- ``$MOONCAKE_CONFIG_PATH`` JSON <- `extra_config`, then upstream's environment variables
    below both; every value checked through its `KEYS` row. Keys in `ignore` are neither ours nor
    upstream's and are skipped; any other unknown key is a `ConfigError`."""
    env = os.environ if env is None else env
    skip = frozenset(ignore)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    checked: dict[str, tuple[Any, str]] = {}
    path = env.get(ENV_CONFIG_PATH, "")
    if path:
        _read_source(_read_file(path), f"{ENV_CONFIG_PATH}={path}", file=True, ignore=skip, values=values,
                     sources=sources, checked=checked)
    if extra_config is not None:
        if not isinstance(extra_config, Mapping):
            raise ConfigError(_EXTRA, extra_config, "must be a dict", "extra config")
        _read_source(extra_config, _EXTRA, file=False, ignore=skip, values=values, sources=sources,
                     checked=checked)
    for row in upstream.ENV:
        text = env.get(row.name)
        if text is None or text.strip() == "":  # unset, or exported empty
            continue
        if row.ours is None:  # a variable asking for something we lack
            reason = row.refusal(text)
            if reason is not None:
                raise ConfigError(row.name, text, reason, _ENVIRONMENT)
            continue
        value = BY_NAME[row.ours].parse_text(row.name, text, _ENVIRONMENT)  # checked even when overridden
        if row.ours not in values:
            values[row.ours], sources[row.ours] = value, _ENVIRONMENT
    if "mode" in checked:
        mode, source = checked["mode"]
        reason = upstream.mode_refusal(mode, values.get("global_segment_size", BY_NAME["global_segment_size"].default))
        if reason is not None:
            raise ConfigError("mode", mode, reason, source)
    return Settings(values=values, sources=sources)


# -- the whole configuration ---------------------------------------------------------------------------------


class EngineFigures(Protocol):
    """What vLLM's configs fix that the configuration depends on (kvledger_connector/shape/engine_facts.py)."""

    @property
    def block_size(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_gpu_blocks(self) -> int | None: ...
    @property
    def save_enabled(self) -> bool: ...
    @property
    def load_enabled(self) -> bool: ...
    @property
    def kv_load_failure_policy(self) -> str: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def key_parts(self) -> int: ...
    @property
    def num_state_groups(self) -> int: ...


def derive_pin_cap(*, max_model_len: int, block_size: int, num_gpu_blocks: int | None,
                   max_inflight_jobs: int, num_kv_groups: int = 1) -> int:
    """The default ``max_pinned_blocks``: ``max(L, min(P // 2, J * L))`` with L the most blocks one store
    job pins (`max_job_blocks`: the longest request's table, times the KV cache groups of a hybrid model,
    whose tables share the pool), P the GPU block pool, J = max_inflight_jobs.

    Why: a store job pins the blocks it reads until every rank reported. While its request runs they are
    the request's own blocks; after the request finishes or is preempted they stay out of the free pool.
    At least L, or the longest request's save could never be admitted; at most half the pool, so saves in
    flight never keep more than half the KV cache from running requests; never above J * L, which J jobs
    of at most L blocks cannot exceed anyway. Without a known pool (P None), J * L. Never above the key's
    upper bound, which a set value may not pass either."""
    for name, v in (("max_model_len", max_model_len), ("block_size", block_size),
                    ("max_inflight_jobs", max_inflight_jobs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, v, "must be an int >= 1 to derive max_pinned_blocks", "engine")
    if num_gpu_blocks is not None and (isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int)
                                       or num_gpu_blocks < 1):
        raise ConfigError("num_gpu_blocks", num_gpu_blocks, "must be an int >= 1 to derive max_pinned_blocks",
                          "engine")
    longest = num_kv_groups * max_job_blocks(max_model_len, block_size)
    upper = max_inflight_jobs * longest
    if num_gpu_blocks is not None:
        upper = min(upper, num_gpu_blocks // 2)
    return min(max(longest, upper), BY_NAME["max_pinned_blocks"].bounds[1])  # never past the key's own bound


def _vllm_int(field: str, value: Any, source: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40:
        raise ConfigError(field, value, "must be an int in 1..2**40", source)


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector's two sides are configured with, checked once and handed to both: the
    store's settings, the connector's own keys and what vLLM's configs fix. `build` makes it from
    `Settings`; built directly (tests, drivers) it is checked the same way.

    `max_pinned_blocks` is the cap in force after construction: given as DERIVED (the default) it is
    derived here from `max_model_len`, `block_size` and `num_gpu_blocks` (`derive_pin_cap`). Without a
    `max_model_len` (a side built by a driver, not an engine) no job size is known and the cap is the key's
    bound: only `max_inflight_jobs` limits the pins then."""

    store: StoreConfig
    block_size: int
    world_size: int = 1
    nnodes: int = 1
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    save_enabled: bool = True  # kv_role kv_producer | kv_both
    load_enabled: bool = True  # kv_role kv_consumer | kv_both
    kv_load_failure_policy: str = "fail"  # vLLM's (kv_transfer_config); "fail" is its default
    save_decode: bool = False
    save_partial_tail: bool = False
    load_threads: int = 1
    sync_load_max_tokens: int = 256
    max_lookup_cache: int = 4096
    lookup_timeout_ms: int = 200
    max_kv_events: int = 10_000
    trace_path: str | None = None
    max_inflight_jobs: int = 64
    max_held_requests: int = 64
    max_pinned_blocks: int = DERIVED
    integrity: str | None = None  # None: by the store (`integrity_mode`)
    integrity_secret_file: str | None = None
    firewall: str = "off"  # "nftables": kvledger_connector/store/firewall.py
    # KV cache groups (a hybrid model under vLLM's hybrid KV cache manager: a job pins a block per group)
    num_kv_groups: int = 1
    # keys per block and KV cache group on a rank (the TP-shared layout's head shards, `kv_heads_per_key`)
    key_parts: int = 1
    # Mamba groups in vLLM's "align" mode among the KV cache groups
    num_state_groups: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError("store", type(self.store).__name__, "must be a StoreConfig", "connector")
        _vllm_int("block_size", self.block_size, "vllm cache_config")
        _vllm_int("world_size", self.world_size, "vllm parallel_config")
        _vllm_int("nnodes", self.nnodes, "vllm parallel_config")
        _vllm_int("max_model_len", self.max_model_len, "vllm model_config", optional=True)
        _vllm_int("num_gpu_blocks", self.num_gpu_blocks, "vllm cache_config", optional=True)
        for name in ("save_enabled", "load_enabled"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be a bool", "vllm kv_transfer_config")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError("kv_load_failure_policy", self.kv_load_failure_policy,
                              f"must be one of {LOAD_FAILURE_POLICIES}", "vllm kv_transfer_config")
        _check_fields(self, "connector")
        integrity_mode(self.integrity, self.integrity_secret_file, embedded=self.store.embedded)
        if self.num_kv_groups.__class__ is not int or self.num_kv_groups < 1:
            raise ConfigError("num_kv_groups", self.num_kv_groups, "must be an int >= 1", "vllm kv_cache_config")
        if self.key_parts.__class__ is not int or self.key_parts < 1:
            raise ConfigError("key_parts", self.key_parts, "must be an int >= 1", "engine")
        if self.num_state_groups.__class__ is not int or not 0 <= self.num_state_groups < self.num_kv_groups:
            raise ConfigError("num_state_groups", self.num_state_groups,
                              f"must be an int in 0..{self.num_kv_groups - 1} (num_kv_groups={self.num_kv_groups})",
                              "engine")
        if self.num_state_groups and self.save_partial_tail:
            raise ConfigError("save_partial_tail", True, f"the model has {self.num_state_groups} Mamba group(s): a "
                              f"state at a prompt's partial end is vLLM's copy-on-write hand-off, which the "
                              f"connector does not serve; set false", "connector")
        object.__setattr__(self, "max_pinned_blocks", self._pin_cap())
        if self.nnodes > 1 and self.store.embedded:
            raise ConfigError("master_server_address", None,
                              f"required with nnodes={self.nnodes}: the embedded default starts a master on "
                              f"127.0.0.1 that other nodes cannot reach; run mooncake_master and set "
                              f"master_server_address and metadata_server")

    def _pin_cap(self) -> int:
        cap = self.max_pinned_blocks
        if cap == DERIVED:
            if self.max_model_len is None:
                return BY_NAME["max_pinned_blocks"].bounds[1]
            return derive_pin_cap(max_model_len=self.max_model_len, block_size=self.block_size,
                                  num_gpu_blocks=self.num_gpu_blocks, max_inflight_jobs=self.max_inflight_jobs,
                                  num_kv_groups=self.num_kv_groups)
        # a store job pins every block it may read (SchedulerLedger.open_job): one larger than the cap could
        # never be admitted, so a cap below the longest request's table would silently never save long prompts
        if self.save_enabled and self.max_model_len is not None:
            longest = self.num_kv_groups * max_job_blocks(self.max_model_len, self.block_size)
            if cap < longest:
                raise ConfigError("max_pinned_blocks", cap,
                                  f"smaller than the {longest} blocks of the longest request (max_model_len="
                                  f"{self.max_model_len}, block_size={self.block_size}): its store job could never "
                                  f"be admitted; raise max_pinned_blocks or lower max_model_len")
        return cap

    @classmethod
    def build(cls, settings: Settings, engine: EngineFigures) -> ConnectorConfig:
        """The configuration of one connector: `settings` (`read_settings`) for `engine`."""
        given = settings.given("connector")
        try:
            cfg = cls(store=settings.store(), block_size=engine.block_size, world_size=engine.world_size,
                      nnodes=engine.nnodes, max_model_len=engine.max_model_len, num_gpu_blocks=engine.num_gpu_blocks,
                      save_enabled=engine.save_enabled, load_enabled=engine.load_enabled,
                      kv_load_failure_policy=engine.kv_load_failure_policy,
                      num_kv_groups=engine.num_groups, key_parts=engine.key_parts,
                      num_state_groups=engine.num_state_groups, **given)
        except ConfigError as e:
            raise settings.sourced(e) from None
        # a cap set below the job cap is a typo; a derived one may be (a small pool: the pin cap binds first)
        if "max_pinned_blocks" in given and cfg.max_pinned_blocks < cfg.max_inflight_jobs:
            raise ConfigError("max_pinned_blocks", cfg.max_pinned_blocks,
                              f"smaller than max_inflight_jobs={cfg.max_inflight_jobs}",
                              settings.sources["max_pinned_blocks"])
        return cfg


# -- derived defaults -------------------------------------------------------------------------------------


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
    master = _parse_address(None, "master_server_address", master_server_address, "config")
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


# -- import-time checks: the table, the dataclasses and the upstream table agree ---------------------------

def _check_table() -> None:
    for holder, cls in (("store", StoreConfig), ("connector", ConnectorConfig)):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        for key in _holds(holder):  # type: ignore[arg-type]
            if key.name not in fields or not _is_default(key, fields[key.name]):
                raise ImportError(f"config key {key.name}: not a field of {cls.__name__} with the table's default")
    for key in KEYS:
        if key.type in ("int", "size") and (key.lo is None or key.hi is None or key.lo > key.hi):
            raise ImportError(f"config key {key.name}: a number needs both bounds")
        if "|" in key.doc + key.tests:  # a table cell
            raise ImportError(f"config key {key.name}: '|' in its documentation")
    for row in upstream.KEYS:
        if row.ours is not None and row.ours not in BY_NAME:
            raise ImportError(f"upstream key {row.name} maps onto {row.ours}, not a config key")
        if "|" in row.here + row.tests + row.upstream_default:
            raise ImportError(f"upstream key {row.name}: '|' in its documentation")


_check_table()


# -- the generated documentation (README's settings table, docs/vs-upstream.md's config tables) ---------------

_ACCEPTS: dict[str, str] = {
    "address": "`host:port`", "metadata": "`http://host:port/metadata`, `P2PHANDSHAKE`, `etcd://…`, `redis://…`",
    "host": "host name or IP address", "protocol": "`tcp`, `rdma`", "devices": "comma list of device names",
    "bool": "`true`, `false`", "namespace": "`\"\"` or 1–64 of `A-Z a-z 0-9 . _ -`",
    "version": "`\"\"` or 1–64 of `A-Z a-z 0-9 . _ -`",
    "path": "path; `\"\"` or null: off", "integrity": "`checksum`, `mac`, `off`", "firewall": "`off`, `nftables`",
}


def _accepts(key: Key) -> str:
    if key.type == "int":
        lo, hi = key.bounds
        return f"{lo:,}–{hi:,}"
    if key.type == "size":
        lo, hi = key.bounds
        return f"{_size_text(lo)}–{_size_text(hi)} (bytes or e.g. `\"4GB\"`)"
    return _ACCEPTS[key.type]


def _shown_default(key: Key) -> str:
    if key.shown_default is not None:
        return key.shown_default
    if isinstance(key.default, bool):
        return str(key.default).lower()
    if key.type == "size":
        return _size_text(key.default)
    return '""' if key.default == "" else str(key.default)


def _also_from(key: Key) -> str:
    out = ["file" if key.in_file else "extra config only"]
    out += [f"upstream `{u.name}`" for u in upstream.KEYS if u.kind == "alias" and u.ours == key.name]
    out += [f"`{u.name}` (below a file or extra-config value)" for u in upstream.ENV if u.ours == key.name]
    return "; ".join(out)


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def settings_markdown() -> str:
    """README's settings table: every key, its default, what it accepts, where else it is read from."""
    lines = [_row("key", "default", "accepts", "also from", "meaning"), "|---|---|---|---|---|"]
    lines += [_row(f"`{k.name}`", _shown_default(k), _accepts(k), _also_from(k), k.doc) for k in KEYS]
    return "\n".join(lines)


def upstream_markdown() -> str:
    """docs/vs-upstream.md's config tables: each upstream key and variable, then the keys only here."""
    out: list[str] = []
    for where, title in (("file", "## Config keys: the `MOONCAKE_CONFIG_PATH` file"),
                         ("extra", "## Config keys: `kv_connector_extra_config`")):
        out += [title, "", _row("upstream key (upstream default)", "here", "test"), "|---|---|---|"]
        out += [_row(f"`{u.name}` ({u.upstream_default})", u.here, u.tests) for u in upstream.KEYS if u.where == where]
        out.append("")
    out += ["## Environment", "", _row("upstream variable", "here", "test"), "|---|---|---|"]
    out += [_row(f"`{u.name}`", u.here, u.tests) for u in upstream.KEYS if u.where == "env"]
    out += ["", "Not read here: `VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO` and upstream's disk-staging settings "
                "(upstream sizes a load-splitting budget with them; the tier here is `disk_offload`).", "",
            "## Config keys only here", "",
            "Meanings, defaults and bounds: README's settings table (rendered from the same table).", "",
            _row("key", "test"), "|---|---|"]
    upstream_names = {u.ours for u in upstream.KEYS if u.kind in ("same", "alias")}
    out += [_row(f"`{k.name}`", k.tests) for k in KEYS if k.name not in upstream_names]
    return "\n".join(out)


#: file (relative to the repository root) -> (region name, renderer)
GENERATED: dict[str, tuple[str, Callable[[], str]]] = {
    "README.md": ("settings", settings_markdown),
    "docs/vs-upstream.md": ("upstream config", upstream_markdown),
}


def _markers(region: str) -> tuple[str, str]:
    return (f"<!-- generated ({region}): python -m kvledger_connector.config --write; edit config.py, not this -->",
            f"<!-- end generated ({region}) -->")


def spliced(text: str, region: str, body: str) -> str:
    """`text` with its generated `region` replaced by `body`; ValueError when the markers are missing."""
    begin, end = _markers(region)
    head, sep, rest = text.partition(begin)
    old, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"generated region {region!r}: markers missing ({begin!r} ... {end!r})")
    return f"{head}{begin}\n{body}\n{end}{tail}"


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvledger_connector.config",
                                 description="Render the config tables; --write updates the checked-in copies.")
    ap.add_argument("--markdown", choices=["settings", "upstream"], help="print one table")
    ap.add_argument("--write", action="store_true", help="rewrite the generated regions of " + ", ".join(GENERATED))
    ap.add_argument("--check", action="store_true", help="exit 1 when a checked-in region differs")
    ap.add_argument("--root", default=".", help="the repository root (default: .)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(settings_markdown() if args.markdown == "settings" else upstream_markdown())
    stale = []
    for rel, (region, render) in GENERATED.items() if args.write or args.check else ():
        path = Path(args.root) / rel
        text = path.read_text(encoding="utf-8")
        new = spliced(text, region, render())
        if new != text:
            stale.append(rel)
            if args.write:
                path.write_text(new, encoding="utf-8")
    if stale:
        print(("rewrote " if args.write else "stale: ") + ", ".join(stale), file=sys.stderr)
    return 1 if stale and args.check and not args.write else 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
