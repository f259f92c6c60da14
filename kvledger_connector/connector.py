"""`KVLedgerConnector`: vLLM's KV connector (v1 API, vLLM 0.32.0 and 0.33.0) over kvledger and a Mooncake store.

Loaded by vLLM's own factory (when the package is installed, by name alone: kvledger_connector/plugin.py)::

    --kv-transfer-config '{"kv_connector": "KVLedgerConnector",
                           "kv_connector_module_path": "kvledger_connector.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"max_inflight_jobs": 64}}'

The scheduler role delegates to `kvledger_connector.scheduler.SchedulerSide`, the worker role to
`kvledger_connector.worker.WorkerSide`; this module only adapts vLLM's hooks, reads the configuration and owns
the store client(s). Store configuration: `StoreConfig` (kvledger_connector/config.py) from
``MOONCAKE_CONFIG_PATH`` and the extra config; the keys below (`CONNECTOR_KEYS`) are the connector's own.

Embedded default: with no ``master_server_address`` the first connector of the engine starts a private
`mooncake_master` + metadata server on 127.0.0.1 (`EmbeddedMooncake`); the engine's other connectors, in
this process (reference counted) or in its other processes (kvledger_connector/rendezvous.py: one file per engine
id), attach to it. The servers stop with the connector that started them (or die with its process). A
multi-node engine configures a master.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvledger_connector.config import (
    CONNECTOR_KEYS,
    ConfigError,
    ConnectorConfig,
    StoreConfig,
    map_upstream_connector_keys,
)
from kvledger_connector import rendezvous
from kvledger_connector.embedded import EmbeddedMooncake
from kvledger_connector.rendezvous import AttachedMooncake
from kvledger_connector.keys import KeyBuilder, KeyLayout
from kvledger_connector.metadata import KVLedgerConnectorMetadata
from kvledger_connector.events import StoreEvents
from kvledger_connector.reset import reset_scheduler_side
from kvledger_connector.scheduler import SchedulerSide
from kvledger_connector.scheduler_steps import max_job_blocks
from kvledger_connector.stats import KVLedgerPromMetrics, KVLedgerStats, StatsRecorder, TimedLookups
from kvledger_connector.store import KVStore, MooncakeStore
from kvledger_connector.kvlayout import LAYOUT_HNC_ORDER, KVLayoutError, plan_block_copies
from kvledger_connector.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_EMBEDDED_LOCK = threading.Lock()
_EMBEDDED: dict[str, list[Any]] = {}  # engine_id -> [EmbeddedMooncake, refcount]


def _acquire_embedded(engine_id: str, rpc_timeout_ms: int) -> EmbeddedMooncake | AttachedMooncake:
    """This process's handle on the engine's embedded servers: shared by the connectors of this process
    (reference counted), found across the engine's processes through kvledger_connector/rendezvous.py."""
    with _EMBEDDED_LOCK:
        ent = _EMBEDDED.get(engine_id)
        if ent is None:
            handle = rendezvous.acquire(engine_id, lambda: EmbeddedMooncake(rpc_timeout_ms=rpc_timeout_ms))
            ent = _EMBEDDED[engine_id] = [handle, 0]
        ent[1] += 1
        return ent[0]


def _release_embedded(engine_id: str) -> None:
    with _EMBEDDED_LOCK:
        ent = _EMBEDDED.get(engine_id)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] <= 0:
            del _EMBEDDED[engine_id]
            if isinstance(ent[0], EmbeddedMooncake):
                rendezvous.release(engine_id)
            ent[0].stop()


def _vllm_tp_rank() -> int | None:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized
        return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else None
    except Exception:  # no distributed state: an in-process driver
        return None


def _vllm_pp_rank() -> int | None:
    try:
        from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized
        return get_pp_group().rank_in_group if model_parallel_is_initialized() else None
    except Exception:
        return None


def kv_cache_spec(kv_cache_config: KVCacheConfig | None) -> Any:
    """The one attention spec this connector serves; anything else is refused at start-up (several KV
    cache groups would need block ids per group; Mamba state has no per-block pages)."""
    if kv_cache_config is None:
        raise KVLayoutError("kv_cache_config is None: vLLM 0.32 passes the engine's KVCacheConfig to every "
                            "connector; the connector needs its KV cache spec")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KVLayoutError(f"{len(groups)} KV cache groups ("
                            + "; ".join(f"{type(g.kv_cache_spec).__name__}: {g.layer_names[:2]}..." for g in groups)
                            + "): the connector serves models with one KV cache group (no hybrid models)")
    spec = groups[0].kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    if specs is not None:
        kinds = set(specs.values())
        if len(kinds) != 1:
            raise KVLayoutError(f"layers {sorted(specs)[:4]}...: {len(kinds)} different KV cache specs in "
                                f"one group; the connector serves one spec for all layers")
        spec = kinds.pop()
    if not (hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size") and spec.has_layer_views):
        raise KVLayoutError(f"layers {groups[0].layer_names[:4]}: {type(spec).__name__} has no per-layer "
                            f"[B, H, N, C] pages; the connector serves attention KV caches only")
    return spec


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The `KVCacheLayout` the engine resolved (EngineCore does it before any connector exists)."""
    name = vllm_config.cache_config.kv_cache_layout or getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        raise KVLayoutError("the KV cache layout is not resolved (cache_config.kv_cache_layout is None): "
                            "vLLM's EngineCore resolves it before creating connectors; a driver that builds "
                            "connectors itself must set it (see testbed.kvcache.build_kv_cache_config)")
    if name not in LAYOUT_HNC_ORDER:
        raise KVLayoutError(f"KV cache layout {name!r}: not one of {sorted(LAYOUT_HNC_ORDER)}")
    return str(name)


def key_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, tp_rank: int,
               pp_rank: int = 0) -> KeyLayout:
    """What a block's bytes depend on besides its tokens: the resolved layout and the KV cache spec,
    from the configs alone (the scheduler has no tensors; the worker checks its tensors against it)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    spec = kv_cache_spec(kv_cache_config)
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(spec.dtype)
    extra = (("spec", type(spec).__name__), ("content_bytes", str(spec.state_content_size_bytes)),
             ("head_size_v", str(spec.head_size_v)), ("kv_quant", str(getattr(spec, "kv_quant_mode", ""))),
             ("spec_dtype", str(spec.dtype)))
    return KeyLayout(model=str(mc.model), tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                     pp_rank=pp_rank, pp_size=pc.pipeline_parallel_size,
                     block_size=cc.block_size, dtype=dtype, kv_layout=resolved_layout(vllm_config, kv_cache_config),
                     num_layers=mc.get_total_num_hidden_layers(), num_kv_heads=spec.num_heads,
                     head_size=spec.head_size, extra=extra)


class KVLedgerConnector(KVConnectorBase_V1):
    """Saves prompt KV blocks to Mooncake and loads prefix hits back, with kvledger's job ledger."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None, *, store: KVStore | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):  # 0.33 refuses it earlier, 0.32 never
            raise ConfigError("enable_sleep_mode", True, "KVLedgerConnector does not support sleep mode (the "
                              "store's buffer registrations would not follow the KV cache across sleep/wake); "
                              "turn sleep mode off", "model_config")
        # upstream MooncakeStoreConnector names mapped (config.py); an unset pin cap derived for this engine
        extra = map_upstream_connector_keys(self._kv_transfer_config.kv_connector_extra_config or {})
        self.store_config = StoreConfig.from_sources(extra, connector_keys=CONNECTOR_KEYS).for_engine(
            max_model_len=vllm_config.model_config.max_model_len, block_size=vllm_config.cache_config.block_size,
            num_gpu_blocks=getattr(kv_cache_config, "num_blocks", None) or vllm_config.cache_config.num_gpu_blocks)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._embedded: EmbeddedMooncake | AttachedMooncake | None = None
        self._owns_store = store is None
        self._trace_file: Any = None  # kvledger_connector.tracefile.SharedTrace when `trace_path` is set
        self.store: KVStore | None = None
        pc = vllm_config.parallel_config
        # every connector key is validated once, before anything is started or connected
        self.config = cfg = ConnectorConfig.from_extra(
            extra, store=self.store_config, block_size=vllm_config.cache_config.block_size,
            world_size=pc.world_size, save_enabled=self._kv_transfer_config.is_kv_producer,
            load_enabled=self._kv_transfer_config.is_kv_consumer)
        if role == KVConnectorRole.SCHEDULER:
            tp_rank = pp_rank = 0
        else:
            tp_rank = self._rank(extra, "tp_rank", pc.tensor_parallel_size, _vllm_tp_rank)
            pp_rank = self._rank(extra, "pp_rank", pc.pipeline_parallel_size, _vllm_pp_rank)
        self._check_caps(self.store_config, vllm_config)
        self.layout = key_layout(vllm_config, kv_cache_config, tp_rank, pp_rank)  # refuses what it cannot serve
        trace = None
        if cfg.trace_path:
            from kvledger_connector.tracefile import open_trace
            trace = self._trace_file = open_trace(cfg.trace_path)
        bs = cfg.block_size
        self.stats = StatsRecorder()
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        sc_cfg = cfg.store
        if role == KVConnectorRole.SCHEDULER:
            if store is None:  # lookups only: this client contributes no memory
                store = self._connect(sc_cfg.replace(global_segment_size=0))
            self.store = store
            # a hit needs every shard of every stage
            builders = [KeyBuilder(key_layout(vllm_config, kv_cache_config, t, p), sc_cfg.max_key_bytes,
                                   sc_cfg.namespace)
                        for p in range(pc.pipeline_parallel_size) for t in range(pc.tensor_parallel_size)]
            self.scheduler_side = SchedulerSide(
                cfg, key_builders=builders,
                store=TimedLookups(store, self.stats),  # the lookup latency histogram
                stats=self.stats, trace=trace)
            kvev = vllm_config.kv_events_config
            if kvev is not None and kvev.enable_kv_cache_events:  # BlockStored/BlockRemoved for routers
                self.scheduler_side.events = StoreEvents(key_builders=builders, store=store, block_size=bs,
                                                         max_pending=cfg.max_kv_events, stats=self.stats)
        else:
            if store is None:
                store = self._connect(sc_cfg)
            self.store = store
            sc = vllm_config.scheduler_config
            self.worker_side = WorkerSide(
                cfg, store=store, keys=KeyBuilder(self.layout, sc_cfg.max_key_bytes, sc_cfg.namespace),
                tp_rank=tp_rank, max_requests=sc_cfg.max_inflight_jobs + 4 * sc.max_num_seqs,
                stats=self.stats, trace=trace)

    def _check_caps(self, cfg: StoreConfig, vllm_config: VllmConfig) -> None:
        """Start-up check of the pin caps against the model: a store job pins every block it may read
        (SchedulerLedger.open_job), and one larger than `max_pinned_blocks` could never be admitted, so a
        cap below the longest request's blocks would silently never save long prompts. The longest request
        has ceil(max_model_len / block_size) blocks in its table; a partial tail (`save_partial_tail`) is the
        table's own last block, so no job pins a block outside the table. Checked on every role, before anything
        is started; only a role that saves pins (kv_consumer never opens a store job)."""
        if cfg.max_inflight_jobs < 1:  # StoreConfig.from_dict refuses it too; a StoreConfig built directly not
            raise ConfigError("max_inflight_jobs", cfg.max_inflight_jobs, "must be >= 1",
                              "kv_connector_extra_config")
        if not self._kv_transfer_config.is_kv_producer:
            return
        max_model_len = vllm_config.model_config.max_model_len
        bs = vllm_config.cache_config.block_size
        longest = max_job_blocks(max_model_len, bs)
        if cfg.max_pinned_blocks < longest:
            raise ConfigError("max_pinned_blocks", cfg.max_pinned_blocks,
                              f"smaller than the {longest} blocks of the longest request (max_model_len="
                              f"{max_model_len}, block_size={bs}): its store job could never be admitted; "
                              f"raise max_pinned_blocks or lower max_model_len", "kv_connector_extra_config")

    def _connect(self, cfg: StoreConfig) -> MooncakeStore:
        if cfg.embedded and self._vllm_config.parallel_config.nnodes > 1:
            raise ConfigError("master_server_address", None,
                              f"required with nnodes={self._vllm_config.parallel_config.nnodes}: the embedded "
                              f"default starts a master on 127.0.0.1 that other nodes cannot reach; run "
                              f"mooncake_master and set master_server_address and metadata_server",
                              "kv_connector_extra_config")
        if cfg.embedded:
            self._embedded = _acquire_embedded(self._engine_id, cfg.rpc_timeout_ms)
        return MooncakeStore.connect(cfg, embedded=self._embedded)

    @staticmethod
    def _rank(extra: dict[str, Any], key: str, size: int, from_vllm: Any) -> int:
        """This worker's rank in a parallel group: vLLM's, or `extra[key]` for in-process drivers that
        build several ranks' connectors without a process group. With size > 1 and neither, refuse:
        falling back to 0 would make this worker write rank 0's keys."""
        rank = from_vllm()
        given = extra.get(key)
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < size:
                raise ConfigError(key, given, f"must be an int in 0..{size - 1}", "kv_connector_extra_config")
            if rank is not None and rank != given:
                raise ConfigError(key, given, f"differs from vLLM's rank {rank} in that group",
                                  "kv_connector_extra_config")
            rank = given
        if rank is None:
            if size > 1:
                raise ConfigError(key, None, f"this worker cannot learn its rank from vLLM (no process group "
                                  f"set up) and the group has {size} ranks; refusing to guess rank 0, whose "
                                  f"keys it would share", "kv_connector_extra_config")
            rank = 0
        return rank

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

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's Scheduler publishes these with its own each step (kvledger_connector/events.py)."""
        events = self.scheduler_side.events if self.scheduler_side is not None else None
        return events.take() if events is not None else ()

    def reset_cache(self) -> bool | None:
        """Drop every key of this engine's model and namespace (kvledger_connector/reset.py); False while
        anything in flight could bring pre-reset KV back. The worker role has nothing to reset: None."""
        if self.scheduler_side is None or self.store is None:
            return None
        return reset_scheduler_side(self.scheduler_side, self.store)

    # ============================================================ worker side
    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("worker-side hook called on a scheduler-role KVLedgerConnector")
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer [B, H, N, C] views, as its allocator made them: checked against the spec the
        keys promise, then read as a per-block copy plan (kvledger_connector/kvlayout.py)."""
        lay = self.layout
        spec = kv_cache_spec(self._kv_cache_config)
        for name, t in kv_caches.items():
            if isinstance(t, torch.Tensor) and t.dim() == 4 and (
                    t.shape[1] != spec.num_heads or t.shape[3] * t.element_size() != spec.state_content_size_bytes):
                raise KVLayoutError(
                    f"layer {name!r}: shape {tuple(t.shape)} of {t.dtype} (layout {lay.kv_layout}), the KV cache "
                    f"spec promises {spec.num_heads} head slots of {spec.state_content_size_bytes} content bytes")
        plan = plan_block_copies(kv_caches, layout=lay.kv_layout, block_size=lay.block_size,
                                 num_blocks=self._kv_cache_config.num_blocks)
        want = len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        if len(plan.layers) != want:
            raise KVLayoutError(f"{len(plan.layers)} distinct KV cache views ({list(plan.layers)[:4]}...), the KV "
                                f"cache config has {want} layers (layout {lay.kv_layout})")
        self._worker().register_kv_caches(plan)

    def _meta(self) -> KVLedgerConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVLedgerConnectorMetadata):
            raise TypeError(f"connector metadata is {type(meta).__name__}, expected KVLedgerConnectorMetadata")
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous (between steps): nothing to wait for inside the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves read whole blocks after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker().end_step(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._worker().take_finished_loads()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_worker_meta()

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
        """Every step is bounded (thread joins, store close) and runs even if an earlier one raised, so the
        embedded servers are always released; the first error is raised at the end."""
        steps = []
        if self.worker_side is not None:
            steps.append(self.worker_side.shutdown)
        if self.scheduler_side is not None:
            # no worker reads or writes any more (they shut down first in vLLM): every pin can go
            steps.append(self.scheduler_side.release_all)
        if self._owns_store and self.store is not None:
            steps.append(self.store.close)
        if self._embedded is not None:
            self._embedded = None
            steps.append(lambda: _release_embedded(self._engine_id))
        if self._trace_file is not None:
            from kvledger_connector.tracefile import close_trace
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
        if first is not None:
            raise first
