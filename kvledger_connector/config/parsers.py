"""The value parsers of the config table (`keys.KEYS`): each turns what a source gave into a typed value
within its key's bounds, or raises `ConfigError` naming the source, the field and the value as given.

Sizes are ints (bytes) or strings such as ``"4GB"``, ``"512 MiB"``, ``"1.5gb"``; like Mooncake's own config
parser, ``KB/MB/GB/TB`` are binary (1024-based), as are ``KiB/MiB/GiB/TiB``.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from kvledger.errors import LedgerInputError

KeyType = Literal["address", "metadata", "host", "protocol", "devices", "size", "int", "bool", "namespace", "version",
                  "path", "integrity", "firewall"]

_MAX_TEXT = 4096  # longest string value (PATH_MAX); also bounds a size string before it is parsed

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,12})?)\s*([a-zA-Z]*)\s*$")
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


class Bounded(Protocol):
    """What a parser reads of its key (`keys.Key`): its type and, for a number, both inclusive bounds."""

    @property
    def type(self) -> KeyType: ...

    @property
    def bounds(self) -> tuple[int, int]: ...


def size_text(n: int) -> str:
    """`n` bytes in the largest binary unit that divides it ("16 MiB"), else the bare number."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _bounded(key: Bounded, field: str, raw: Any, value: int, source: str) -> int:
    lo, hi = key.bounds
    if value < lo:
        why = "must be > 0" if key.type == "size" and lo == 1 else f"must be >= {lo}"
        raise ConfigError(field, raw, why, source)
    if value > hi:
        raise ConfigError(field, raw, f"must be <= {size_text(hi) if key.type == 'size' else hi}", source)
    return value


def _parse_int(key: Bounded, field: str, raw: Any, source: str) -> int:
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


def _parse_size(key: Bounded, field: str, raw: Any, source: str) -> int:
    return _bounded(key, field, raw, parse_size(field, raw, source), source)


def _parse_bool(key: Bounded, field: str, raw: Any, source: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(field, raw, "must be a bool", source)
    return raw


def _host_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return bool(_HOST_RE.match(host))


def _parse_address(key: Bounded, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(field, raw, f"must be a 'host:port' string, got {type(raw).__name__}", source)
    host, sep, port = raw.rpartition(":")
    if (not sep or not host or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536
            or not _host_ok(host)):
        raise ConfigError(field, raw, "must be 'host:port' with a port in 1..65535", source)
    return raw


def _parse_metadata(key: Bounded, field: str, raw: Any, source: str) -> str:
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


def _parse_host(key: Bounded, field: str, raw: Any, source: str) -> str:
    if not isinstance(raw, str) or not _host_ok(raw):
        raise ConfigError(field, raw, "must be a host name or IP address", source)
    return raw


def _parse_protocol(key: Bounded, field: str, raw: Any, source: str) -> str:
    if raw not in ("tcp", "rdma") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'tcp' or 'rdma'", source)
    return raw


def _parse_devices(key: Bounded, field: str, raw: Any, source: str) -> str:
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


def _parse_namespace(key: Bounded, field: str, raw: Any, source: str) -> str:
    return _key_part(field, raw, source, "it becomes the first component of every store key")


def _parse_version(key: Bounded, field: str, raw: Any, source: str) -> str:
    return _key_part(field, raw, source, "it goes into every store key's layout digest")


def _parse_integrity(key: Bounded, field: str, raw: Any, source: str) -> str:
    if raw not in ("checksum", "mac", "off") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'checksum', 'mac' or 'off'", source)
    return raw


def _parse_firewall(key: Bounded, field: str, raw: Any, source: str) -> str:
    if raw not in ("off", "nftables") or not isinstance(raw, str):
        raise ConfigError(field, raw, "must be 'off' or 'nftables'", source)
    return raw


def _parse_path(key: Bounded, field: str, raw: Any, source: str) -> str | None:
    if raw is None or raw == "":  # off
        return None
    if not isinstance(raw, str) or "\0" in raw or len(raw) > _MAX_TEXT:
        raise ConfigError(field, raw, f"must be a path string of at most {_MAX_TEXT} characters ('' or null: off)",
                          source)
    return raw


#: a key's type -> its parser (`keys.Key.parse`)
PARSERS: dict[str, Callable[[Bounded, str, Any, str], Any]] = {
    "address": _parse_address, "metadata": _parse_metadata, "host": _parse_host, "protocol": _parse_protocol,
    "devices": _parse_devices, "size": _parse_size, "int": _parse_int, "bool": _parse_bool,
    "namespace": _parse_namespace, "version": _parse_version, "path": _parse_path,
    "integrity": _parse_integrity, "firewall": _parse_firewall,
}
