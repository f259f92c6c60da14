"""The model of a checked configuration: `StoreConfig` (the Mooncake client and the worker's store/load
bounds), `ConnectorConfig` (all the connector's two sides are configured with) and `Settings` (what the sources
gave, `read_settings`).

Their fields are made from the key table: one keyword-only field per `KEYS` row each holds, with the row's
default, so a default is written once (keys.py). Every value, a config built in code included, is checked
through its row, then across fields. `Settings.store()` builds the `StoreConfig` for start-up (its
``local_hostname`` derived there, `StoreConfig.with_local_hostname`) and `ConnectorConfig.build` the whole
configuration with what vLLM's configs fix (`EngineFigures`), deriving the pin cap there, once: no consumer
sees an underived cap.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvledger_connector.config.keys import BY_NAME, CPU_SYNC_LOAD_MAX_TOKENS, DERIVED, Holder, Key, holds
from kvledger_connector.config.parsers import ConfigError, size_text
from kvledger_connector.config.sources import advertised_address, read_sources

#: vLLM's ``kv_load_failure_policy`` values
LOAD_FAILURE_POLICIES = ("fail", "recompute")
#: the smallest memory segment Mooncake's setup() takes (-600, "Total size must be at least 16777216")
MIN_OFFLOAD_SEGMENT = 16 << 20

_C = TypeVar("_C")


def _table_fields(holder: Holder) -> Callable[[type[_C]], type[_C]]:
    """A frozen dataclass of the class's own fields, then a keyword-only field per `KEYS` row that `holder`
    holds, typed and defaulted by its row: a key's default is written in its row only."""
    def make(cls: type[_C]) -> type[_C]:
        own: dict[str, Any] = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = own
        for key in holds(holder):
            if key.name in own:
                raise TypeError(f"{cls.__name__}.{key.name}: a config key's field is made from its row, not declared")
            own[key.name] = key.annotation
            setattr(cls, key.name, dataclasses.field(default=key.default, kw_only=True))
        return dataclass(frozen=True)(cls)
    return make


def _is_default(key: Key, value: Any) -> bool:
    return value is key.default or (type(value) is type(key.default) and value == key.default)


def _check_fields(obj: Any, holder: Holder) -> None:
    """Every table key `obj` holds, through its row (so a config built in code is checked like one read
    from a source); a default is valid by construction (None / "": absent, DERIVED: derived)."""
    for key in holds(holder):
        value = getattr(obj, key.name)
        if not _is_default(key, value):
            object.__setattr__(obj, key.name, key.parse(key.name, value, "config"))


# -- the store's settings ---------------------------------------------------------------------------------


@_table_fields("store")
class StoreConfig:
    """The Mooncake client's settings and the worker's store/load bounds: a field per `KEYS` row held by
    "store", each checked through its row.

    `master_server_address` None means *embedded mode*: the connector starts a private master on 127.0.0.1
    (kvledger_connector/store/embedded.py) and fills in its address and ``P2PHANDSHAKE`` (no metadata server).
    `local_hostname` "" is derived at start-up (`with_local_hostname`).
    """

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
                                  f"must be >= {size_text(MIN_OFFLOAD_SEGMENT)} with disk_offload (Mooncake's "
                                  "setup() refuses a smaller segment)")
        if self.master_server_address is None and self.metadata_server is not None:
            raise ConfigError("metadata_server", self.metadata_server,
                              "set without master_server_address (embedded mode starts its own)")
        if self.master_server_address is not None and self.metadata_server is None:
            raise ConfigError("metadata_server", None, "required when master_server_address is set")
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ConfigError("rdma_devices", self.rdma_devices, "required when protocol is 'rdma'")

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                     ignore: Iterable[str] = ()) -> StoreConfig:
        """The store's part of `read_settings` (every key of every source is still checked)."""
        return read_settings(extra_config, env=env, ignore=ignore).store()

    def with_local_hostname(self) -> StoreConfig:
        """This config with the address it advertises, for start-up: `local_hostname` as given, else derived
        from this host's route to the master (`advertised_address`, a UDP probe), once, so every use (setup,
        ``MC_TCP_BIND_ADDRESS``) sees one address."""
        if self.local_hostname:
            return self
        return dataclasses.replace(self, local_hostname=advertised_address(self.master_server_address))

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


# -- what the sources gave ---------------------------------------------------------------------------------


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
        return {k.name: self.values[k.name] for k in holds(holder) if k.name in self.values}

    def sourced(self, e: ConfigError) -> ConfigError:
        """`e` naming the source of its field's value (a cross-field check knows only the field)."""
        return e.at(self.sources[e.field]) if e.field in self.sources else e

    def store(self) -> StoreConfig:
        """The store's settings for start-up: checked, and `local_hostname` derived where none was given."""
        try:
            return StoreConfig(**self.given("store")).with_local_hostname()
        except ConfigError as e:
            raise self.sourced(e) from None

def read_settings(extra_config: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
                  ignore: Iterable[str] = ()) -> Settings:
    """Every key the sources give, checked through its row (sources.py `read_sources`: precedence, refusals).
    Keys in `ignore` are neither ours nor upstream's and are skipped; any other unknown key is a `ConfigError`."""
    values, sources = read_sources(extra_config, env=env, ignore=ignore)
    return Settings(values=values, sources=sources)


# -- the whole configuration ---------------------------------------------------------------------------------


def max_job_blocks(max_model_len: int, block_size: int) -> int:
    """The most blocks one store job pins of a KV cache group: the longest request's table,
    ceil(max_model_len / block_size). A partial tail is the table's own last block (read in place, never a
    copy-on-write block outside the table), so it adds nothing."""
    return -(-max_model_len // block_size)


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
    @property
    def device_type(self) -> str: ...


def derive_sync_load_cap(device_type: str) -> int:
    """The default ``sync_load_max_tokens`` for an engine on ``device_type``: on vLLM's CPU engine the KV cache
    is host memory, a load one copy out of the store, and the forward it would overlap runs on the same cores,
    so a load inside the step costs less than the step an async one waits to be reported
    (CPU_SYNC_LOAD_MAX_TOKENS); on an accelerator the key's default."""
    return CPU_SYNC_LOAD_MAX_TOKENS if device_type == "cpu" else int(BY_NAME["sync_load_max_tokens"].default)


def derive_pin_cap(*, max_model_len: int, block_size: int, num_gpu_blocks: int | None,
                   max_inflight_jobs: int, num_groups: int = 1) -> int:
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
    longest = num_groups * max_job_blocks(max_model_len, block_size)
    upper = max_inflight_jobs * longest
    if num_gpu_blocks is not None:
        upper = min(upper, num_gpu_blocks // 2)
    return min(max(longest, upper), BY_NAME["max_pinned_blocks"].bounds[1])  # never past the key's own bound


def _vllm_int(field: str, value: Any, source: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40:
        raise ConfigError(field, value, "must be an int in 1..2**40", source)


@_table_fields("connector")
class ConnectorConfig:
    """Everything the connector's two sides are configured with, checked once and handed to both: the
    store's settings, what vLLM's configs fix and a field per `KEYS` row held by "connector". `build` makes
    it from `Settings`; built directly (tests, drivers) it is checked the same way.

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
    # KV cache groups (a hybrid model under vLLM's hybrid KV cache manager: a job pins a block per group)
    num_groups: int = 1
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
        if self.num_groups.__class__ is not int or self.num_groups < 1:
            raise ConfigError("num_groups", self.num_groups, "must be an int >= 1", "vllm kv_cache_config")
        if self.key_parts.__class__ is not int or self.key_parts < 1:
            raise ConfigError("key_parts", self.key_parts, "must be an int >= 1", "engine")
        if self.num_state_groups.__class__ is not int or not 0 <= self.num_state_groups < self.num_groups:
            raise ConfigError("num_state_groups", self.num_state_groups,
                              f"must be an int in 0..{self.num_groups - 1} (num_groups={self.num_groups})",
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
                                  num_groups=self.num_groups)
        # a store job pins every block it may read (SchedulerLedger.open_job): one larger than the cap could
        # never be admitted, so a cap below the longest request's table would silently never save long prompts
        if self.save_enabled and self.max_model_len is not None:
            longest = self.num_groups * max_job_blocks(self.max_model_len, self.block_size)
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
        if "sync_load_max_tokens" not in given:
            given = {**given, "sync_load_max_tokens": derive_sync_load_cap(engine.device_type)}
        try:
            cfg = cls(store=settings.store(), block_size=engine.block_size, world_size=engine.world_size,
                      nnodes=engine.nnodes, max_model_len=engine.max_model_len, num_gpu_blocks=engine.num_gpu_blocks,
                      save_enabled=engine.save_enabled, load_enabled=engine.load_enabled,
                      kv_load_failure_policy=engine.kv_load_failure_policy,
                      num_groups=engine.num_groups, key_parts=engine.key_parts,
                      num_state_groups=engine.num_state_groups, **given)
        except ConfigError as e:
            raise settings.sourced(e) from None
        # a cap set below the job cap is a typo; a derived one may be (a small pool: the pin cap binds first)
        if "max_pinned_blocks" in given and cfg.max_pinned_blocks < cfg.max_inflight_jobs:
            raise ConfigError("max_pinned_blocks", cfg.max_pinned_blocks,
                              f"smaller than max_inflight_jobs={cfg.max_inflight_jobs}",
                              settings.sources["max_pinned_blocks"])
        return cfg
