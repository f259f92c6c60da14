"""What vLLM 0.32's `MooncakeStoreConnector` reads (its ``MOONCAKE_CONFIG_PATH`` file, its
``kv_connector_extra_config``, its environment variables) and what each means here.

Data and predicates only: `kvledger_connector.config` applies them while it reads the sources (the same
rules in the file and in the extra config) and renders docs/vs-upstream.md's config tables from `KEYS`.
Each upstream name is one `UpstreamKey`:

    same     the same key here (our table's row of that name)
    alias    renamed onto one of our keys (`ours`)
    env      an environment variable that sets one of our keys, below an explicit setting
    checked  not a key of ours: accepted at the values that ask for nothing this connector lacks
             (`accepts`), refused with `why` at any other value
    file     ``MOONCAKE_CONFIG_PATH`` itself: the JSON file read as a source
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"
ENV_REQUESTER_HOSTNAME = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"  # upstream's override of the advertised address
ENV_PREFERRED_SEGMENT = "MOONCAKE_PREFERRED_SEGMENT"  # upstream's placement hint
ENV_LOAD_RECV_THREADS = "VLLM_MOONCAKE_LOAD_RECV_THREADS"  # upstream's load threads per rank

Kind = Literal["same", "alias", "env", "checked", "file"]
Where = Literal["file", "extra", "env"]


def _off(v: Any) -> bool:
    """Upstream reads its flags loosely (bool(...), or str(...).lower() == "true"): the spellings of off."""
    return v is None or v is False or v == 0 or (isinstance(v, str) and v.strip().lower() in ("", "false", "0"))


def _on(v: Any) -> bool:
    return v is True or v == 1 or (isinstance(v, str) and v.strip().lower() in ("true", "1"))


def _unset(v: Any) -> bool:
    return v is None


def _any(v: Any) -> bool:
    return True


@dataclass(frozen=True)
class UpstreamKey:
    name: str
    kind: Kind
    where: Where  # where upstream reads it (ours are read from the file and the extra config alike)
    upstream_default: str  # as the docs table shows it
    here: str  # what this connector does with it (docs/vs-upstream.md's "here" column)
    tests: str  # the tests that back `here`
    ours: str | None = None  # same / alias / env: the key of ours it sets
    accepts: Callable[[Any], bool] | None = None  # checked: the values that ask for nothing we lack
    why: str = ""  # checked: why any other value is refused, and what to use instead

    def refusal(self, raw: Any) -> str | None:
        """None when `raw` is accepted, else the reason (a `checked` key at a value we cannot honour)."""
        if self.accepts is None or self.accepts(raw):
            return None
        return f"upstream MooncakeStoreConnector key not supported at this value: {self.why}"


_T_FILE = "test_config.py::test_upstream_file_is_accepted_and_mapped"
_T_REFUSED = "test_config.py::test_upstream_keys_we_cannot_honour_are_refused_with_what_to_do"
_T_ACCEPTED = "test_config.py::test_upstream_keys_at_values_that_ask_for_nothing_we_lack_are_accepted"
_TP_SHARING = ("upstream's cross-TP key layout (its keys are not this connector's): engines of different "
               "tensor_parallel_size share a prefix here with kv_heads_per_key (a key per KV-head shard); remove it")
_TP_HERE = ("refused (upstream's key scheme); engines of different `tensor_parallel_size` share a prefix here with "
            "`kv_heads_per_key`, a key per KV-head shard")

KEYS: tuple[UpstreamKey, ...] = (
    # -- the MOONCAKE_CONFIG_PATH file
    UpstreamKey("metadata_server", "same", "file", '""', "same; absent with no master: embedded mode (private "
                "master, `P2PHANDSHAKE`)", _T_FILE, ours="metadata_server"),
    UpstreamKey("master_server_address", "same", "file", '""', "same; absent: embedded mode", _T_FILE,
                ours="master_server_address"),
    UpstreamKey("protocol", "same", "file", '"rdma"', "same values (`tcp`, `rdma`); **default differs**: tcp here",
                "test_config.py::test_bad_extra_config_names_field_and_value", ours="protocol"),
    UpstreamKey("device_name", "alias", "file", '""', "mapped → `rdma_devices` (required with rdma)",
                "test_config.py::test_file_then_extra_config_extra_wins", ours="rdma_devices"),
    UpstreamKey("global_segment_size", "same", "file", "4 GiB", "same (same units, plus KiB/MiB/GiB/TB); **default "
                "differs**: 512 MiB here", _T_FILE, ours="global_segment_size"),
    UpstreamKey("local_buffer_size", "same", "file", "4 GiB", "same; **default differs**: 16 MiB here (the "
                "zero-copy path does not use it)", _T_FILE, ours="local_buffer_size"),
    UpstreamKey("mode", "checked", "file", '"embedded"', "mapped: checked against `global_segment_size` "
                "(`embedded` needs > 0, `standalone-store` needs 0 = a consumer-only worker); other values refused",
                "test_config.py::test_upstream_mode_must_agree_with_the_segment, "
                "::test_upstream_standalone_store_mode_is_a_consumer_only_worker",
                accepts=lambda v: v in ("embedded", "standalone-store"),
                why="must be 'embedded' (this worker contributes global_segment_size > 0) or 'standalone-store' "
                    "(global_segment_size 0; an external mooncake_client owns the pool)"),
    UpstreamKey("enable_offload", "alias", "file", "false", "mapped → `disk_offload`: Mooncake's disk tier, written "
                "by this worker's own client (upstream's embedded mode writes nothing to disk); with a segment it "
                "needs `disk_offload_dir`", "test_disk_tier.py::test_upstream_enable_offload_turns_the_tier_on, "
                "test_config.py::test_upstream_keys_at_values_that_ask_for_nothing_we_lack_are_accepted",
                ours="disk_offload"),
    UpstreamKey("tenant_id", "checked", "file", '"default"', "accepted \"default\"/\"\"/null; others refused: use "
                "`namespace` to keep tenants' keys apart",
                f"{_T_REFUSED}, test_namespace.py::test_two_namespaces_never_share_keys_on_one_store",
                accepts=lambda v: v is None or (isinstance(v, str) and v.strip() in ("", "default")),
                why="Mooncake tenants are not used by this connector; to keep tenants' keys apart on one store set "
                    "namespace (upstream's cache_prefix)"),
    # -- kv_connector_extra_config
    UpstreamKey("cache_prefix", "alias", "extra", '""', "mapped → `namespace`: the first key component (1–64 of "
                "`A-Z a-z 0-9 . _ -`; upstream takes any string and joins with `@`); two namespaces never share a key",
                "test_namespace.py::test_two_namespaces_never_share_keys_on_one_store, "
                "test_connector_config.py::test_upstream_extra_config_through_the_connector", ours="namespace"),
    UpstreamKey("save_decode_cache", "alias", "extra", "false", "mapped → `save_decode` (both set to different "
                "values: refused)", "test_config.py::test_upstream_save_decode_cache_maps_to_save_decode, "
                "test_connector_config.py::test_upstream_extra_config_through_the_connector", ours="save_decode"),
    UpstreamKey("preferred_segment", "checked", "extra", "unset", "refused: no placement hints, the master places "
                "every put", _T_REFUSED, accepts=_unset,
                why="placement hints are not supported: the master places every put; remove it"),
    UpstreamKey("enable_lookup", "checked", "extra", "true", "accepted true; false refused: use `kv_role: "
                "kv_producer`", _T_REFUSED, accepts=lambda v: v is None or _on(v),
                why="to save without loading, use kv_role 'kv_producer' instead"),
    UpstreamKey("load_async", "checked", "extra", "true", "accepted true; false refused: `sync_load_max_tokens` "
                "decides per load (a load of at most that many tokens runs inside the step that schedules it, a "
                "longer one asynchronously)", _T_REFUSED, accepts=lambda v: v is None or _on(v),
                why="whether a load is synchronous is decided per load here: set sync_load_max_tokens (the most "
                    "tokens a load run inside the engine step may have) instead"),
    UpstreamKey("lookup_async", "checked", "extra", "false", "accepted false (a lookup is one `batch_is_exist` in "
                "the scheduler step); true refused", _T_REFUSED, accepts=_off,
                why="lookups are one batch_is_exist call in the scheduler's step here: remove it"),
    UpstreamKey("store_tp_size", "checked", "extra", "unset", _TP_HERE, _T_REFUSED, accepts=_unset, why=_TP_SHARING),
    UpstreamKey("enable_store_tp_lcm", "checked", "extra", "false", _TP_HERE, _T_REFUSED, accepts=_off,
                why=_TP_SHARING),
    UpstreamKey("prefill_tp_sizes", "checked", "extra", "unset", _TP_HERE, _T_REFUSED, accepts=_unset,
                why=_TP_SHARING),
    UpstreamKey("custom_mem_pool", "checked", "extra", "unset", "refused: the KV cache stays in vLLM's allocator, "
                "registered in place", _T_REFUSED, accepts=lambda v: v is None or v == "",
                why="the KV cache stays in vLLM's own allocator here (registered with Mooncake in place): "
                    "remove it"),
    UpstreamKey("enable_group_semantics", "checked", "extra", "false", "accepted false; true refused (no replica "
                "groups)", _T_REFUSED, accepts=_off,
                why="puts carry no replica groups here: remove it or set false"),
    UpstreamKey("enable_cross_layers_blocks", "checked", "extra", "false", "accepted false; true refused (vLLM's "
                "per-layer layout is stored as is)", _T_REFUSED, accepts=_off,
                why="a block is stored in vLLM's own per-layer layout here (docs/models.md: KV cache layouts): remove it or "
                    "set false"),
    # upstream's ZMQ lookup-server port: there is no lookup server here, so any value asks for nothing we lack
    UpstreamKey("lookup_rpc_port", "checked", "extra", "0", "accepted, no effect: there is no lookup server here "
                "(the scheduler asks the store)", _T_ACCEPTED, accepts=_any),
    # -- the environment
    UpstreamKey(ENV_CONFIG_PATH, "file", "env", "", "same (optional here: without it, defaults and extra config); "
                "the file must hold a JSON object of at most 1 MiB and, as every file an operator names, be this "
                "user's regular file, not a link, that no one else may write (it sets the master and integrity)",
                "test_config.py::test_file_then_extra_config_extra_wins, "
                "::test_the_config_file_is_checked_as_every_file_an_operator_names"),
    UpstreamKey(ENV_REQUESTER_HOSTNAME, "env", "env", "", "mapped → `local_hostname` (an explicit `local_hostname` "
                "wins; validated like it)", _T_FILE, ours="local_hostname"),
    UpstreamKey(ENV_PREFERRED_SEGMENT, "checked", "env", "", "refused when set (no placement hints)",
                "test_config.py::test_upstream_preferred_segment_from_the_environment_is_refused",
                accepts=lambda v: v is None or v == "",
                why="placement hints are not supported: the master places every put; unset it"),
    UpstreamKey(ENV_LOAD_RECV_THREADS, "env", "env", "", "mapped → `load_threads` (an explicit `load_threads` wins; "
                "not an int in `load_threads`' bounds: refused, where upstream clamps to 1)",
                "test_connector_config.py::test_upstream_load_recv_threads_env_sets_load_threads",
                ours="load_threads"),
)

BY_NAME: dict[str, UpstreamKey] = {u.name: u for u in KEYS}
if len(BY_NAME) != len(KEYS):
    raise ImportError("upstream_keys.KEYS names a key twice")
#: upstream config keys renamed onto ours
ALIASES: dict[str, str] = {u.name: u.ours for u in KEYS if u.kind == "alias" and u.ours is not None}
#: upstream config keys that are not ours: checked, never stored
CHECKED: dict[str, UpstreamKey] = {u.name: u for u in KEYS if u.kind == "checked" and u.where != "env"}
#: environment variables read here besides MOONCAKE_CONFIG_PATH, in table order
ENV: tuple[UpstreamKey, ...] = tuple(u for u in KEYS if u.where == "env" and u.kind != "file")


def mode_refusal(mode: Any, global_segment_size: int) -> str | None:
    """Upstream's ``mode`` names who contributes the pool's memory; here that is global_segment_size."""
    if mode == "embedded" and global_segment_size == 0:
        return ("with global_segment_size=0: upstream's 'embedded' mode has each worker contribute memory; set "
                "global_segment_size > 0, or mode 'standalone-store' for a worker that contributes none")
    if mode == "standalone-store" and global_segment_size != 0:
        return (f"with global_segment_size={global_segment_size}: upstream's 'standalone-store' mode has an external "
                "mooncake_client own the pool; set global_segment_size 0 (this worker contributes no memory)")
    return None
