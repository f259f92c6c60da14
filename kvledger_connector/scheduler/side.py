"""Scheduler side of the connector: vLLM's scheduler-side hooks, adapted to the thread-free steps.

Runs in vLLM's scheduler thread only (no lock). Every decision is kvledger_connector/scheduler/steps.py's
(`SchedulerSteps`, which the conformance replay drives too; `SchedulerSide.steps`); this class only reads
vLLM's objects — the Request, the allocator's block ids (one list per KV cache group), SchedulerOutput,
KVConnectorOutput — and hands plain values on.
Per engine step, in vLLM's order::

    schedule()
      get_num_new_matched_tokens(req, n)  -> lookup(req, n), load_is_async      Lookup
      update_state_after_alloc(req, ..)   -> emit_load(req, block ids, n)      EmitLoad (pinned)
      build_connector_meta(out)           -> notices(finished, preempted)      DropGeneration notices
                                             releases()                        ReleaseHeld (held requests)
                                             take_loads(), emit_stores(..)     EmitStore (pinned) / DEFER
    update_from_output()
      update_connector_output(out)        -> note_load_errors(invalid_block_ids) later lookups stop there
                                             collect_loads(finished_recving)   CollectLoad (async)
                                             collect_sync_loads(completed_loads) CollectLoad (sync)
                                             collect(completed_saves)          Collect
                                             note_freed(finished_sending)       held requests freed
      request_finished(req, ..)           -> request_finished(req)             delays the free only while
                                                                               the caps defer its save (held)
    has_requests() -> has_pending_push_work()  while any pin is held or a request is held

No hook raises into vLLM's step (binding, at start-up, does): an input the steps cannot serve becomes a
cache miss (a lookup), a load reported failed (`SchedulerSteps.refuse_load`), a save given up (per request,
inside `emit_stores`) or a report set aside (a collect), each logged and counted (``hook_errors``).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.metadata import KVLedgerConnectorMetadata, KVLedgerWorkerMetadata
from kvledger_connector.scheduler.steps import SchedulerSteps
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.store.contract import KVStore
from kvledger_connector.store.deadline import DeadlineStore

logger = logging.getLogger(__name__)


class SchedulerSide:
    """vLLM's scheduler-side hooks over `steps` (the decisions), which it holds and calls."""

    def __init__(self, config: ConnectorConfig, *, key_builders: Sequence[KeyBuilder], store: KVStore | None,
                 stats: StatsRecorder | None = None, trace: TraceSink | None = None,
                 weights_version: str = "") -> None:
        if not isinstance(config, ConnectorConfig):
            raise LedgerInputError("config", type(config).__name__, "must be a ConnectorConfig")
        self.steps = SchedulerSteps(config, key_builders=key_builders, stats=stats, trace=trace,
                                    weights_version=weights_version)
        self.config = config
        self.store = store  # the lookups' calls (the store-call wrapper); None: no lookups
        self._kv_cache_manager: Any = None
        self._step = 0

    # ------------------------------------------------------------------ binding
    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        steps = self.steps
        steps.bind_ledger(SchedulerLedger(block_pool, world_size=steps.world_size,
                                          max_inflight_jobs=self.config.max_inflight_jobs,
                                          max_pinned_blocks=steps.max_pinned_blocks, trace=steps.trace,
                                          counts=steps.stats))
        if steps.kinds.groups(may_give_back=True):  # blocks vLLM may give back while a job is deferred
            steps.block_hash_of = vllm_block_hash_of(block_pool)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.steps.sliding_groups:
            self.steps.reachable_blocks = vllm_reachable_blocks(kv_cache_manager)

    # ------------------------------------------------------------------ vLLM's hooks
    def _hook_error(self, hook: str, e: BaseException) -> None:
        logger.error("KVLedgerConnector %s: %s: %s", hook, type(e).__name__, e)
        self.steps.stats.add("hook_errors")

    def _log_step_errors(self) -> None:
        while self.steps.errors:
            logger.error("KVLedgerConnector: %s", self.steps.errors.popleft())

    def on_new_request(self, request: Any) -> None:
        try:
            self.steps.on_new_request(request)
        except Exception as e:  # its lookups then answer from a fresh state, or miss
            self._hook_error("on_new_request", e)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        steps = self.steps
        try:
            if steps.requeue_after_failed_load(request):
                return None, False  # vLLM skips it this step: out of its queue of KV-holding requests
            ext = ask_store(steps, self.store, request, num_computed_tokens)
            if ext is None:
                return None, False  # the store has not answered yet: asked again next step
            return (ext, steps.load_is_async(request.request_id, ext)) if ext > 0 else (0, False)
        except Exception as e:  # a cache miss
            self._hook_error("get_num_new_matched_tokens", e)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        ids: Any = ()
        try:
            ids = blocks.get_block_ids()  # one list per KV cache group
            self.steps.emit_load(request, ids, num_external_tokens)
        except Exception as e:  # vLLM counts on the load: it is reported failed instead
            self._hook_error("update_state_after_alloc", e)
            try:
                self.steps.refuse_load(request, ids, num_external_tokens, f"{type(e).__name__}: {e}")
            except Exception as e2:
                self._hook_error("update_state_after_alloc (refusing the load)", e2)
        self._log_step_errors()

    def build_connector_meta(self, scheduler_output: Any) -> KVLedgerConnectorMetadata:
        steps = self.steps
        self._step += 1
        meta = KVLedgerConnectorMetadata(step=self._step, weights_version=steps.weights_version,
                                         reset_epoch=steps.reset_epoch,
                                         idle=scheduler_output.total_num_scheduled_tokens == 0)
        meta.drops = steps.notices(sorted(scheduler_output.finished_req_ids),
                                   sorted(scheduler_output.preempted_req_ids or ())) + steps.releases()
        meta.loads = steps.take_loads()
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        manager = self._kv_cache_manager

        def table_of(req_id: str) -> Any:  # one table per KV cache group
            if block_state is not None:
                ids = block_state.get_block_ids(req_id)
                if ids:
                    return ids
            return None if manager is None else manager.get_block_ids(req_id)

        offers = getattr(block_state, "boundary_state_offloads", None) if steps.state_groups else None
        try:  # each request's save is guarded inside (`emit_stores`): this catches what is not a request's
            meta.saves = steps.emit_stores(scheduler_output.num_scheduled_tokens, table_of, offers)
        except Exception as e:
            self._hook_error("build_connector_meta", e)
        self._log_step_errors()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Each report applied on its own: one the ledger refuses (an unknown job or load, a duplicate, a bad
        count; the ledger applies the rest of its batch first) is logged and counted, and its pins are kept
        (holding a pin too long is safe, freeing early is not)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is not None and not isinstance(meta, KVLedgerWorkerMetadata):
            self._hook_error("update_connector_output", LedgerInputError(
                "kv_connector_worker_meta", type(meta).__name__, "expected KVLedgerWorkerMetadata"))
            meta = None
        s = self.steps
        reports: list[tuple[str, Any, Any]] = [  # load errors first, while the loads still hold their pins
            ("invalid_block_ids", s.note_load_errors, getattr(connector_output, "invalid_block_ids", None)),
            ("failed_recving", s.note_failed_loads, getattr(connector_output, "failed_recving", None)),
            ("finished_recving", s.collect_loads, getattr(connector_output, "finished_recving", None)),
            ("finished_sending", s.note_freed, getattr(connector_output, "finished_sending", None)),
        ]
        if meta is not None:
            reports += [("completed_loads", s.collect_sync_loads, meta.completed_loads),
                        ("completed_saves", s.collect, meta.completed_saves)]
        for name, apply, value in reports:
            try:
                apply(value)
            except Exception as e:
                self._hook_error(f"update_connector_output {name}", e)

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Delays the free only for a request held for its deferred save (`SchedulerSteps.request_finished`):
        every store job pinned its own blocks."""
        try:  # vLLM set the status first: FINISHED_ERROR ends e.g. a request whose KV load failed under "fail"
            errored = getattr(getattr(request, "status", None), "name", None) == "FINISHED_ERROR"
            return self.steps.request_finished(request, may_hold=not errored), None
        except Exception as e:
            self._hook_error("request_finished", e)
        return False, None


def ask_store(steps: SchedulerSteps, store: Any, request: Any, num_computed_tokens: int) -> int | None:
    """Lookup (`SchedulerSteps.ask` / `answer`) with its one store call made here, at the edge: vLLM's
    `get_num_new_matched_tokens` and the drivers that stand in for it. ``store`` None: nothing is asked.
    Through a `DeadlineStore` (the connector's), None while the store has not answered within the step's wait
    (`DeadlineStore.ask_exist`): vLLM leaves the request waiting and asks again next step."""
    ask = steps.ask(request, num_computed_tokens)
    if isinstance(ask, int):
        return ask
    if store is None:
        return 0
    keys = list(ask.keys)
    try:
        if isinstance(store, DeadlineStore):
            codes = store.ask_exist(keys)
            if codes is None:
                return None
        else:
            codes = store.batch_is_exist(keys)
    except Exception:  # the store wrapper returns codes; a raising test double is a miss
        codes = None
    return steps.answer(request, ask, codes)


def vllm_block_hash_of(block_pool: Any) -> Any:
    """vLLM's prefix-cache record of a block, block id -> ``KVCacheBlock.block_hash`` (None while the
    cache does not hold the block's bytes): what keeps a deferred job's Mamba state offers and freed
    sliding-window blocks valid past their step (`SchedulerSteps.block_hash_of`). None when this vLLM's
    BlockPool lacks it (a deferred job then saves only what its request still holds)."""
    blocks = getattr(block_pool, "blocks", None)
    if not isinstance(blocks, list) or not blocks or not hasattr(blocks[0], "block_hash"):
        return None

    def block_hash_of(block_id: int) -> object | None:
        return blocks[block_id].block_hash if 0 <= block_id < len(blocks) else None
    return block_hash_of


def vllm_reachable_blocks(kv_cache_manager: Any) -> Any:
    """vLLM's rule for which blocks of a KV cache group a later prefix hit can use, as its hybrid coordinator
    applies it when it caches a request's blocks (`KVCacheCoordinator.cache_blocks` ->
    ``reachable_block_mask`` of the group's manager: the window's tail at each replay boundary and
    shared-prefix junction under ``prefix_cache_retention_interval``): a function (request, group, start
    block, end block) -> mask or None (every block). The store then keeps what vLLM's own prefix cache
    would. None when this vLLM's manager lacks any part of it (every block is saved)."""
    coord = getattr(kv_cache_manager, "coordinator", None)
    try:
        from vllm.v1.core.kv_cache_coordinator import replay_boundaries
        managers = list(coord.single_type_managers)  # type: ignore[union-attr]
        eagle = bool(coord.eagle_group_ids)  # type: ignore[union-attr]
        block_size, retention = coord.scheduler_block_size, coord.retention_interval  # type: ignore[union-attr]
        args = [(type(m).reachable_block_mask, m.cache_hit_alignment_tokens, m.kv_cache_spec, m.use_eagle,
                 m.dcp_world_size) for m in managers]
    except (ImportError, AttributeError):
        return None

    def reachable(request: Any, group: int, start: int, end: int) -> Any:
        mask_of, alignment, spec, use_eagle, dcp = args[group]
        boundaries = [*replay_boundaries(request.num_prompt_tokens, block_size, use_eagle=eagle)]
        if getattr(request, "shared_prefix_boundary", 0):
            boundaries.append(request.shared_prefix_boundary)
        return mask_of(start_block=start, end_block=end, alignment_tokens=alignment, kv_cache_spec=spec,
                       use_eagle=use_eagle, retention_interval=retention, reachable_boundaries=boundaries,
                       dcp_world_size=dcp)
    return reachable
