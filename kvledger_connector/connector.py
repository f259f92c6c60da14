"""`KVLedgerConnector`: vLLM's KV connector (v1 API, vLLM 0.32.0 and 0.33.0) over kvledger and a Mooncake store.

Loaded by vLLM's own factory (when the package is installed, by name alone: kvledger_connector/plugin.py)::

    --kv-transfer-config '{"kv_connector": "KVLedgerConnector",
                           "kv_connector_module_path": "kvledger_connector.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"max_inflight_jobs": 64}}'

An adapter: at construction it reads the settings (kvledger_connector/config/: every key, every source),
the engine's facts (kvledger_connector/shape/engine_facts.py: KV cache spec, layout, ranks, sizes) and builds the
one `ConnectorConfig`, all before anything is started; then it starts the store client and the role's side.
Each vLLM hook delegates to `kvledger_connector.scheduler.side.SchedulerSide` (scheduler role) or
`kvledger_connector.worker.side.WorkerSide` (worker role).

Embedded default: with no ``master_server_address`` the first connector of the engine starts a private
`mooncake_master` on 127.0.0.1, no metadata server (`EmbeddedMooncake`); the engine's other connectors, in
this process (reference counted) or in its other processes (kvledger_connector/store/rendezvous.py: one file per engine
id), attach to it. The servers stop with the connector that started them (or die with its process). A
multi-node engine configures a master. Where the connector starts the store it also protects it: integrity
'mac' under a secret generated for the engine in the same private directory (rendezvous.engine_secret).
With ``firewall: "nftables"`` each process also closes its store's ports to every other local uid
(kvledger_connector/store/firewall.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvledger_connector.store import firewall, rendezvous
from kvledger.errors import LedgerInputError
from kvledger_connector.config import ConfigError, ConnectorConfig, StoreConfig, read_settings
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.shape.engine_facts import (
    EngineFacts,
    key_layout,
    kv_cache_spec,
    read_weights_version,
    resolved_layout,
)
from kvledger_connector.telemetry.events import StoreEvents, spec_metadata
from kvledger_connector.shape.integrity import CHECKSUM_ONLY, IntegrityKey
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.metadata import KVLedgerConnectorMetadata
from kvledger_connector.store.rendezvous import AttachedMooncake
from kvledger_connector.scheduler.reset import StoreRemovals, reset_scheduler_side
from kvledger_connector.scheduler.side import SchedulerSide
from kvledger_connector.telemetry.stats import KVLedgerPromMetrics, KVLedgerStats, StatsRecorder
from kvledger_connector.store.contract import KVStore
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.worker.side import WorkerSide
from kvledger_connector.worker.steps import WorkerReport

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# the engine facts' functions, re-exported: drivers and tests import them from here
__all__ = ["KVLedgerConnector", "key_layout", "kv_cache_spec", "resolved_layout"]

logger = logging.getLogger(__name__)

# the parts of a step's `WorkerReport` vLLM reads, each through its own hook
_REPORT_PARTS = frozenset({"transfers", "load_errors", "worker_meta"})

class KVLedgerConnector(KVConnectorBase_V1, SupportsHMA):
    """Saves prompt KV blocks to Mooncake and loads prefix hits back, with kvledger's job ledger.

    A `SupportsHMA` connector: vLLM keeps its hybrid KV cache manager on with it. A hybrid model's KV cache
    groups of full attention, sliding window and Mamba in "align" mode are served
    (engine_facts.kv_cache_groups): a key per group and block, every group's blocks of a hit loaded (a
    sliding window's below the window are vLLM's null block; a Mamba group's one state block at the hit's
    end), a hit by vLLM's rule (a sliding group's keys needed only within its window, a Mamba group's state
    key at the hit's end), a Mamba state saved only from the blocks vLLM hands off
    (``boundary_state_offloads``), loads asynchronous and failed per request."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None, *, store: KVStore | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        # everything is read and checked before anything is started or connected
        settings = read_settings(self._kv_transfer_config.kv_connector_extra_config or {})
        self.integrity = self._integrity(settings, is_scheduler)
        self._weights_version_file: str | None = settings.get("weights_version_file")
        self.engine = facts = EngineFacts.of(vllm_config, kv_cache_config, scheduler=is_scheduler,
                                             tp_rank=settings.get("tp_rank"), pp_rank=settings.get("pp_rank"),
                                             weights_version=self._first_weights_version(settings, is_scheduler),
                                             replicated_once=settings.get("store_replicated_kv_once") is not False,
                                             integrity_tag=self.integrity.key_tag,
                                             kv_heads_per_key=settings.get("kv_heads_per_key") or 0)
        self.config = cfg = ConnectorConfig.build(settings, facts)
        self._embedded: EmbeddedMooncake | AttachedMooncake | None = None
        self._walled = False  # this connector holds a reference on the process's firewall table
        self._owns_store = store is None
        self._trace_file: Any = None  # kvledger_connector.telemetry.tracefile.SharedTrace when `trace_path` is set
        self.stats = StatsRecorder()
        self.store: KVStore | None = None
        self._lookups: DeadlineStore | None = None
        self.removals: StoreRemovals | None = None  # the resets' removals (scheduler role)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self._report = WorkerReport()  # the worker side's last report (`_report_part`)
        self._unhanded: set[str] = set()  # its parts not yet handed to vLLM
        try:
            self._start(store)
        except BaseException:
            self._stop(quiet=True)  # what was started before the failure (store client, embedded servers, trace)
            raise

    def _integrity(self, settings: Any, is_scheduler: bool) -> IntegrityKey:
        """The engine's integrity key (`IntegrityKey.resolve`): with the embedded store, 'mac' under a secret
        generated for this engine id and read by each of its processes (rendezvous.engine_secret), before
        anything starts, since the key's tag is in every key. The scheduler (one per engine) says once when
        the tags stop no forger."""
        try:
            embedded = settings.store().embedded
            engine_id = str(self._kv_transfer_config.engine_id)
            ikey = IntegrityKey.resolve(settings.get("integrity"), settings.get("integrity_secret_file"),
                                        embedded=embedded, generated=lambda: rendezvous.engine_secret(engine_id),
                                        device=self._vllm_config.device_config.device_type)
        except ConfigError as e:
            raise settings.sourced(e) from None
        if is_scheduler and ikey.mode == "checksum":
            logger.warning(CHECKSUM_ONLY)
        return ikey

    def _first_weights_version(self, settings: Any, is_scheduler: bool) -> str:
        """`weights_version`, or the scheduler's reading of `weights_version_file`. Workers do not read the
        file: every step's metadata names the version its keys are built under, and they follow it."""
        path, fixed = self._weights_version_file, settings.get("weights_version") or ""
        if path is not None and fixed:
            raise ConfigError("weights_version_file", path, f"set together with weights_version={fixed!r}: "
                              f"choose one", "kv_connector_extra_config")
        return read_weights_version(path) if path is not None and is_scheduler else fixed

    def _key_builders(self, weights_version: str | None = None, reset_epoch: str = "") -> list[KeyBuilder]:
        """The scheduler's key builders: one per shard (a hit needs every one)."""
        sc = self.config.store
        return [KeyBuilder(lay, sc.max_key_bytes, sc.namespace)
                for lay in self.engine.shard_layouts(weights_version, reset_epoch)]

    def _start(self, store: KVStore | None) -> None:
        cfg, facts, sc = self.config, self.engine, self.config.store
        trace = None
        if cfg.trace_path:
            from kvledger_connector.telemetry.tracefile import open_trace
            trace = self._trace_file = open_trace(cfg.trace_path)
        if facts.scheduler:
            # lookups only: this client contributes no memory
            self.store = store if store is not None else self._connect(sc.replace(global_segment_size=0))
            builders = self._key_builders()
            # the resets' removals run on their own thread (nothing reads the keys they remove)
            self.removals = StoreRemovals(self.store, stats=self.stats)
            # the engine step's store calls: each bounded by lookup_timeout_ms, a lookup's wait in one step
            # by lookup_wait_ms, timed
            bounded = self._lookups = DeadlineStore(self.store, cfg.lookup_timeout_ms / 1000.0, self.stats,
                                                    wait_s=cfg.lookup_wait_ms / 1000.0)
            self.scheduler_side = SchedulerSide(cfg, key_builders=builders, stats=self.stats, trace=trace,
                                                store=bounded, weights_version=facts.weights_version)
            if facts.kv_events:  # BlockStored/BlockRemoved for routers, per KV cache group
                self.scheduler_side.steps.events = StoreEvents(
                    key_builders=builders, store=bounded.untimed(), block_size=cfg.block_size,
                    max_pending=cfg.max_kv_events,
                    stats=self.stats, group_specs=spec_metadata([g.spec for g in facts.groups]))
        else:
            self.store = store if store is not None else self._connect(sc)
            self.worker_side = WorkerSide(
                cfg, store=self.store, shape=facts.block_shape(max_key_bytes=sc.max_key_bytes, namespace=sc.namespace),
                tp_rank=facts.tp_rank, max_requests=cfg.max_inflight_jobs + 4 * facts.max_num_seqs,
                stats=self.stats, trace=trace, integrity=self.integrity, weights_version=facts.weights_version,
                rekey=lambda v, e: facts.block_shape(v, e, max_key_bytes=sc.max_key_bytes,
                                                    namespace=sc.namespace).builders,
                readers=facts.world_size)

    @property
    def store_config(self) -> StoreConfig:
        return self.config.store

    def _connect(self, cfg: StoreConfig) -> MooncakeStore:
        engine_id, walled = self.engine.engine_id, self.config.firewall == firewall.NFTABLES
        if walled:
            firewall.sweep()  # before anything listens: no nft, or no permission, fails start-up here
        if cfg.embedded:
            # a restarted master may have moved: this process's table follows it
            self._embedded = rendezvous.acquire_shared(
                engine_id, cfg.rpc_timeout_ms, disk_offload=cfg.disk_offload, stats=self.stats,
                on_restart=(lambda: firewall.refresh(engine_id)) if walled else None)
        store = MooncakeStore.connect(cfg, embedded=self._embedded)
        store.stats = self.stats  # breaker_trips, breaker_probes, master_unauthentic
        if walled:  # once the client listens: its ports and those of the servers this process started
            servers = self._embedded
            try:
                firewall.acquire(engine_id, lambda: servers.server_pids if servers is not None else [])
            except BaseException:
                store.close()  # not yet ours to close at _stop
                raise
            self._walled = True
        return store

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, never a correctness issue

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM >= 0.33 asks this when ``enable_sleep_mode`` is set and refuses to start if False (0.32 never
        asks). Sleep remaps the KV cache, so the store's registered buffers would then point at memory that
        is no longer the cache; we do not re-register across sleep/wake (the cumem allocator sleep needs is
        CUDA-only, so a CPU run cannot test it), hence unsupported, as upstream's Mooncake store connector."""
        return False

    # ============================================================ scheduler side
    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("scheduler-side hook called on a worker-role KVLedgerConnector")
        return self.scheduler_side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)  # calls bind_gpu_block_pool
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched().bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook under its hybrid KV cache manager: the same (a held request keeps every group's
        blocks; every store job pinned its own blocks of every group)."""
        return self._sched().request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.steps.has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's Scheduler publishes these with its own each step (kvledger_connector/telemetry/events.py)."""
        events = self.scheduler_side.steps.events if self.scheduler_side is not None else None
        return events.take() if events is not None else ()

    def reset_cache(self) -> bool | None:
        """Drop every key of this engine's model and namespace (kvledger_connector/scheduler/reset.py): the keys move at
        once (to a new weights version, or under a fresh reset epoch), their removal runs on its own thread;
        False while anything in flight could bring pre-reset KV back. With `weights_version_file`, the file is read again and the keys move
        to the version it names; a file that cannot be read refuses the reset (going on under the old version
        after a weight update would read the old weights' KV). The worker role has nothing to reset: None."""
        side, removals = self.scheduler_side, self.removals
        if side is None or removals is None:
            return None
        version = None
        if self._weights_version_file is not None:
            try:
                version = read_weights_version(self._weights_version_file)
            except LedgerInputError as e:  # a ConfigError too
                logger.error("reset_cache refused: %s", e)
                self.stats.add("resets_refused")
                return False
        return reset_scheduler_side(side.steps, removals, self._key_builders, version)

    # ============================================================ worker side
    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("worker-side hook called on a scheduler-role KVLedgerConnector")
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(self.engine.copy_plans(kv_caches), kv_caches)

    def _meta(self) -> KVLedgerConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVLedgerConnectorMetadata):
            raise TypeError(f"connector metadata is {type(meta).__name__}, expected KVLedgerConnectorMetadata")
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM binds a step's metadata before its forward, but calls start_load_kv before it only when the
        step has a sync load: otherwise after the forward, which on a CPU backend has then run to the end.
        The step begins here (`WorkerSide.start_step`: drops, then loads), so an async load's bytes travel
        during the forward, not after it; start_load_kv then finds the step begun (once per step)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.start_step(self._meta())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads finished in start_load_kv, async ones between steps: nothing to wait for here

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves read whole blocks after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker().end_step(self._meta())

    def _report_part(self, part: str) -> WorkerReport:
        """The worker side's report (`WorkerSide.take_report`) whose ``part`` vLLM reads now. vLLM reads a
        step's results through three hooks, each once (get_transfer_results, get_block_ids_with_load_errors,
        build_connector_worker_meta): the first of them takes a report, and the next is taken once every part
        of it was handed over; a part asked for again before that is empty."""
        if not self._unhanded:
            self._report, self._unhanded = self._worker().take_report(), set(_REPORT_PARTS)
        if part not in self._unhanded:
            return WorkerReport()
        self._unhanded.discard(part)
        return self._report

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return (results.finished_sending or None), (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Held requests released this step (finished_sending: vLLM frees their blocks), finished async
        loads; unless failed loads are reported by block (`GroupKinds.fails_by_block`: one full-attention
        group), also the failed ones, per request (vLLM takes no block-level load error with several groups, and a cut
        inside a sliding window would leave its older blocks null: a failed load's request recomputes or
        fails whole)."""
        report = self._report_part("transfers")
        return KVConnectorTransferResults(finished_sending=set(report.finished_sending),
                                          finished_recving=set(report.finished_recving),
                                          failed_recving=set(report.failed_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._report_part("load_errors").invalid_block_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._report_part("worker_meta").worker_meta

    # ============================================================ both
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVLedgerStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVLedgerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._stop(quiet=False)

    def _stop(self, *, quiet: bool) -> None:
        """Every step is bounded (thread joins, store close) and runs even if an earlier one raised, so the
        embedded servers are always released; the first error is raised at the end unless `quiet` (a
        failed start-up, whose own error is the one to raise)."""
        steps = []
        if self.worker_side is not None:
            steps.append(self.worker_side.shutdown)
        if self.scheduler_side is not None:
            # no worker reads or writes any more (they shut down first in vLLM): every pin can go
            steps.append(self.scheduler_side.steps.release_all)
        if self._lookups is not None:
            steps.append(self._lookups.stop)
        if self.removals is not None:
            steps.append(self.removals.stop)
        if self._owns_store and self.store is not None:
            steps.append(self.store.close)
        if self._embedded is not None:
            self._embedded = None
            engine_id = self.engine.engine_id
            steps.append(lambda: rendezvous.release_shared(engine_id))
        if self._walled:  # after the servers and the client stopped: no port is open without its rule
            self._walled = False
            steps.append(lambda: firewall.release(self.engine.engine_id))
        if self._trace_file is not None:
            from kvledger_connector.telemetry.tracefile import close_trace
            sink, self._trace_file = self._trace_file, None
            steps.append(lambda: close_trace(sink))
        first: BaseException | None = None
        for fn in steps:
            try:
                fn()
            except Exception as e:
                logger.error("KVLedgerConnector shutdown: %s: %s: %s", getattr(fn, "__qualname__", fn),
                             type(e).__name__, e)
                first = first or e
        if first is not None and not quiet:
            raise first
