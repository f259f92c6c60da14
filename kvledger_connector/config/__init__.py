"""The connector's configuration, a contract every room reads; importers name this package, and it hands on
its modules' names:

    parsers.py   `ConfigError` and the value parsers (types, bounds, sizes)
    keys.py      the key table (`KEYS`): one row per setting, its default written there only
    sources.py   reading the file, ``kv_connector_extra_config`` and the environment; the route probe
    model.py     `StoreConfig`, `ConnectorConfig` (fields made from the table), `Settings`, the pin cap
    docs.py      the Markdown tables rendered from the key tables (``python -m kvledger_connector.config``)
"""
from kvledger_connector.config.docs import GENERATED, settings_markdown, spliced, upstream_markdown
from kvledger_connector.config.keys import BY_NAME, CPU_SYNC_LOAD_MAX_TOKENS, DERIVED, KEYS, Key
from kvledger_connector.config.model import (LOAD_FAILURE_POLICIES, MIN_OFFLOAD_SEGMENT, ConnectorConfig,
                                             EngineFigures, Settings, StoreConfig, derive_pin_cap,
                                             derive_sync_load_cap, integrity_mode, max_job_blocks, read_settings)
from kvledger_connector.config.parsers import ConfigError, parse_size
from kvledger_connector.config.sources import advertised_address
from kvledger_connector.upstream_keys import ENV_CONFIG_PATH

__all__ = ["BY_NAME", "CPU_SYNC_LOAD_MAX_TOKENS", "DERIVED", "ENV_CONFIG_PATH", "GENERATED", "KEYS",
           "LOAD_FAILURE_POLICIES", "MIN_OFFLOAD_SEGMENT", "ConfigError", "ConnectorConfig", "EngineFigures", "Key",
           "Settings", "StoreConfig", "advertised_address", "derive_pin_cap", "derive_sync_load_cap", "integrity_mode",
           "max_job_blocks", "parse_size", "read_settings", "settings_markdown", "spliced", "upstream_markdown"]
