"""Reading the configuration's sources, later wins: defaults, the JSON file named by ``MOONCAKE_CONFIG_PATH``,
``kv_connector_extra_config``. Upstream's ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` and
``VLLM_MOONCAKE_LOAD_RECV_THREADS`` set their keys only when no file or extra config does. Every value, the
environment's included, goes through its row's parser (keys.py); anything wrong raises `ConfigError` naming the
source, the field and the value as given, so a typo fails at start-up instead of running with a default, and no
key is ever dropped unread.

One default is read from the host: ``local_hostname``'s, the address of this host's route to the master
(`advertised_address`), probed where the store's settings are taken for start-up
(`model.StoreConfig.with_local_hostname`), never while a config is merely built or copied.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from kvledger.errors import LedgerInputError
from kvledger_connector import upstream_keys as upstream
from kvledger_connector.config.keys import BY_NAME, Key
from kvledger_connector.config.parsers import ConfigError
from kvledger_connector.ownfile import read_own_file
from kvledger_connector.upstream_keys import ENV_CONFIG_PATH

_EXTRA = "kv_connector_extra_config"
_ENVIRONMENT = "environment"
_LOOPBACK = "127.0.0.1"
_MAX_FILE_BYTES = 1 << 20  # a settings file, not a data file: anything larger is a wrong path
_DECIMAL_RE = re.compile(r"^\s*\d{1,20}\s*$")

#: what the sources gave: each key's parsed value, and the source that set it
Given = tuple[dict[str, Any], dict[str, str]]


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



def _parse_env(key: Key, variable: str, text: str) -> Any:
    """`Key.parse` for a string from the environment: numbers are decimal digits; the error names `text`."""
    try:
        if key.type != "int":
            return key.parse(variable, text.strip(), _ENVIRONMENT)
        if not _DECIMAL_RE.match(text):
            lo, hi = key.bounds
            raise ConfigError(variable, text, f"must be a decimal integer in {lo}..{hi}", _ENVIRONMENT)
        return key.parse(variable, int(text), _ENVIRONMENT)
    except ConfigError as e:
        raise ConfigError(variable, text, f"{e.reason} (or set {key.name} in {_EXTRA})", _ENVIRONMENT) from None


def read_sources(extra_config: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                 ignore: Iterable[str] = ()) -> Given:
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
        value = _parse_env(BY_NAME[row.ours], row.name, text)  # checked even when overridden
        if row.ours not in values:
            values[row.ours], sources[row.ours] = value, _ENVIRONMENT
    if "mode" in checked:
        mode, source = checked["mode"]
        reason = upstream.mode_refusal(mode, values.get("global_segment_size", BY_NAME["global_segment_size"].default))
        if reason is not None:
            raise ConfigError("mode", mode, reason, source)
    return values, sources


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
    master = BY_NAME["master_server_address"].parse("master_server_address", master_server_address, "config")
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
