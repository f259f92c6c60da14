"""The table of configuration keys (`KEYS`): one `Key` row per setting, and each setting's default written here
only.

A row gives the key's name, its type (which picks its parser, parsers.py), its default, its bounds (every
number has both), whether the ``MOONCAKE_CONFIG_PATH`` file may set it, which object holds it (`StoreConfig`,
`ConnectorConfig`, or the engine facts: the ranks) and its documentation. The fields of `StoreConfig` and
`ConnectorConfig` are made from the rows they hold (model.py), README's settings table and
docs/vs-upstream.md's config tables are rendered from them (docs.py). Upstream MooncakeStoreConnector's names
for our keys and its environment variables are in kvledger_connector/upstream_keys.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from kvledger_connector import upstream_keys as upstream
from kvledger_connector.config.parsers import PARSERS, KeyType

Holder = Literal["store", "connector", "engine"]
#: `ConnectorConfig.max_pinned_blocks` given as DERIVED (the default) is derived (`derive_pin_cap`)
DERIVED: Final = 0
#: `sync_load_max_tokens`' default, and its value when not given on vLLM's CPU engine (`config.derive_sync_load_cap`)
SYNC_LOAD_MAX_TOKENS: Final = 256
CPU_SYNC_LOAD_MAX_TOKENS: Final = 2048

#: the Python type of a key's value (None too where its default is None: absent)
_VALUE_TYPES: dict[str, type] = {
    "address": str, "metadata": str, "host": str, "protocol": str, "devices": str, "size": int, "int": int,
    "bool": bool, "namespace": str, "version": str, "path": str, "integrity": str, "firewall": str,
}


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
        return PARSERS[self.type](self, field, raw, source)

    @property
    def annotation(self) -> Any:
        """The type of the field that holds this key (`model.StoreConfig`, `model.ConnectorConfig`)."""
        value = _VALUE_TYPES[self.type]
        return value | None if self.default is None or self.type == "path" else value


_T = 1 << 40
_MS_BOUND = 600_000  # ten minutes: a longer RPC bound or back-off stalls an engine step, not a cap

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
              "test_load.py::test_a_load_batch_fits_the_tiers_staging_buffer"),
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
    Key("sync_load_max_tokens", "int", SYNC_LOAD_MAX_TOKENS, "connector",
        "a load of at most this many tokens runs inside the engine step that schedules its request (vLLM's "
        "`load_kv_async=False`: every rank loads before the forward); a longer one runs on the load threads "
        "while the request waits in WAITING_FOR_REMOTE_KVS, holding its blocks and admitted past "
        "`max_num_seqs`. 0: every load asynchronous (upstream's behaviour). Not set, on vLLM's CPU engine "
        f"(`device_type` cpu): {CPU_SYNC_LOAD_MAX_TOKENS}, since there the KV cache is host memory, a load one copy "
        "and the forward it would overlap runs on the same cores. Only under vLLM's "
        "`kv_load_failure_policy` \"fail\" (its default): under \"recompute\" vLLM keeps a failed sync load's "
        "blocks in its prefix cache, so every load is asynchronous there, as for a hybrid model (vLLM takes "
        "a failed load of several KV cache groups per request)", lo=0, hi=1 << 24,
        shown_default=f"{SYNC_LOAD_MAX_TOKENS} (CPU engine: {CPU_SYNC_LOAD_MAX_TOKENS})",
        tests="test_sync_loads.py::test_short_load_runs_in_the_step_that_schedules_it, "
              "::test_on_a_cpu_engine_a_load_past_the_keys_default_runs_in_the_step, "
              "::test_sync_load_max_tokens_zero_keeps_every_load_async, "
              "::test_recompute_policy_keeps_every_load_async"),
    Key("lookup_timeout_ms", "int", 200, "connector",
        "deadline of each store call the scheduler makes (lookups, the KV-events check), from when it is sent; "
        "one past it answers a miss and opens the store's breaker, so a store that stops answering costs this "
        "long once, not a reconnect (~4-5 s) per lookup", lo=1, hi=60_000,
        tests="test_store_breaker.py::test_a_lookup_past_its_deadline_misses_and_trips_the_breaker"),
    Key("lookup_wait_ms", "int", 20, "connector",
        "the longest one engine step waits for a lookup's answer (at most `lookup_timeout_ms`); a store slower "
        "than this, e.g. a master the engine's compute threads starve of CPU, leaves the request waiting for "
        "the next step while the call goes on, instead of holding every other request's step", lo=1,
        hi=60_000, tests="test_lookup_wait.py::test_a_slow_answer_leaves_the_request_waiting_then_hits"),
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


def holds(holder: Holder) -> tuple[Key, ...]:
    """The rows `holder` holds, in the table's order."""
    return tuple(k for k in KEYS if k.holder == holder)


def _check_table() -> None:
    """The table and upstream's agree, every number has both bounds and no documentation breaks a table cell."""
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
