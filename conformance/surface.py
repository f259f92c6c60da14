"""The surface the conformance suite patches: every name a runtime mutant replaces (conformance/mutants.py and
the probes' MUTANTS), as "module:qualified.name" where the name is defined. It is the connector's promise to
its checker: a refactor that keeps these names where they are keeps `make verify`'s mutant table meaningful;
one that moves or renames one moves it here in the same change. `mutants.patched` refuses a name that is not
listed, and tests/unit/test_surface.py fails naming every listed name that no longer exists or that no mutant
patches any more. (A mutant's body is a changed copy of the method it replaces, so it may read that class's
own state; the list is of what is replaced.)"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

PATCHED: frozenset[str] = frozenset({
    # kvledger.codes
    "kvledger.codes:check_count",
    "kvledger.codes:classify_put",
    "kvledger.codes:is_loaded",
    "kvledger.codes:missing",
    # kvledger.load
    "kvledger.load:LoadLedger.record_ok",
    "kvledger.load:LoadLedger.record_results",
    # kvledger.scheduler
    "kvledger.scheduler:SchedulerLedger.collect",
    "kvledger.scheduler:SchedulerLedger.open_job",
    "kvledger.scheduler:SchedulerLedger.pin_load",
    "kvledger.scheduler:SchedulerLedger.release_all",
    # kvledger.worker
    "kvledger.worker:WorkerLedger.drop_generation",
    "kvledger.worker:WorkerLedger.finish",
    "kvledger.worker:WorkerLedger.register",
    "kvledger.worker:WorkerLedger.take_completed",
    "kvledger.worker:put_positions",
    # kvledger_connector.config.model
    "kvledger_connector.config.model:derive_pin_cap",
    "kvledger_connector.config.model:integrity_mode",
    # kvledger_connector.connector
    "kvledger_connector.connector:reset_scheduler_side",
    # kvledger_connector.metadata
    "kvledger_connector.metadata:KVLedgerWorkerMetadata.aggregate",
    "kvledger_connector.metadata:block_ids_error",
    # kvledger_connector.scheduler.collect
    "kvledger_connector.scheduler.collect:CollectSteps.collect",
    # kvledger_connector.scheduler.lookup
    "kvledger_connector.scheduler.lookup:LookupSteps._hit",
    "kvledger_connector.scheduler.lookup:LookupSteps._hit_run",
    "kvledger_connector.scheduler.lookup:LookupSteps.ask",
    "kvledger_connector.scheduler.lookup:LookupSteps.load_is_async",
    "kvledger_connector.scheduler.lookup:LookupSteps.requeue_after_failed_load",
    # kvledger_connector.scheduler.plan
    "kvledger_connector.scheduler.plan:_reachable_rows",
    "kvledger_connector.scheduler.plan:_state_rows",
    "kvledger_connector.scheduler.plan:partial_tail_hash",
    # kvledger_connector.scheduler.requests
    "kvledger_connector.scheduler.requests:_RequestTable.current",
    "kvledger_connector.scheduler.requests:_RequestTable.set_deferred",
    # kvledger_connector.scheduler.reset
    "kvledger_connector.scheduler.reset:StoreRemovals._remove",
    "kvledger_connector.scheduler.reset:engine_key_regex",
    "kvledger_connector.scheduler.reset:keys_after_reset",
    # kvledger_connector.scheduler.saves
    "kvledger_connector.scheduler.saves:SaveSteps._due_tail",
    "kvledger_connector.scheduler.saves:SaveSteps._keep_blocks",
    "kvledger_connector.scheduler.saves:SaveSteps._kept_blocks",
    "kvledger_connector.scheduler.saves:SaveSteps.emit_store",
    "kvledger_connector.scheduler.saves:SaveSteps.load_done",
    # kvledger_connector.scheduler.steps
    "kvledger_connector.scheduler.steps:SchedulerSteps.emit_load",
    "kvledger_connector.scheduler.steps:SchedulerSteps.held_release_due",
    "kvledger_connector.scheduler.steps:SchedulerSteps.notices",
    "kvledger_connector.scheduler.steps:SchedulerSteps.refuse_load",
    "kvledger_connector.scheduler.steps:SchedulerSteps.request_finished",
    "kvledger_connector.scheduler.steps:SchedulerSteps.switch_keys",
    "kvledger_connector.scheduler.steps:SchedulerSteps.take_loads",
    # kvledger_connector.shape.engine_facts
    "kvledger_connector.shape.engine_facts:key_identity",
    "kvledger_connector.shape.engine_facts:kv_head_shard",
    "kvledger_connector.shape.engine_facts:kv_replicas",
    "kvledger_connector.shape.engine_facts:model_identity",
    # kvledger_connector.shape.integrity
    "kvledger_connector.shape.integrity:BlockSeal.verify",
    "kvledger_connector.shape.integrity:IntegrityKey.bind",
    "kvledger_connector.shape.integrity:IntegrityKey.key_tag",
    "kvledger_connector.shape.integrity:IntegrityKey.resolve",
    "kvledger_connector.shape.integrity:integrity_mode",
    "kvledger_connector.shape.integrity:read_own_file",
    # kvledger_connector.shape.keys
    "kvledger_connector.shape.keys:KeyBuilder.__init__",
    "kvledger_connector.shape.keys:KeyLayout.digest",
    "kvledger_connector.shape.keys:partial_tail_hash",
    # kvledger_connector.shape.kvlayout
    "kvledger_connector.shape.kvlayout:LAYOUT_HNC_ORDER",
    "kvledger_connector.shape.kvlayout:_layer_runs",
    # kvledger_connector.store.breaker
    "kvledger_connector.store.breaker:Breaker.backoff_s",
    # kvledger_connector.store.client
    "kvledger_connector.store.client:MooncakeStore.authentic",
    # kvledger_connector.store.deadline
    "kvledger_connector.store.deadline:DeadlineStore.ask_exist",
    "kvledger_connector.store.deadline:DeadlineStore.check_exist",
    # kvledger_connector.store.embedded
    "kvledger_connector.store.embedded:EmbeddedMooncake._restart",
    "kvledger_connector.store.embedded:EmbeddedMooncake._supervise",
    "kvledger_connector.store.embedded:EmbeddedMooncake._wait_ready",
    "kvledger_connector.store.embedded:EmbeddedMooncake.metadata_server",
    # kvledger_connector.store.io
    "kvledger_connector.store.io:StoreIO.remove",
    # kvledger_connector.store.rendezvous
    "kvledger_connector.store.rendezvous:AttachedMooncake.authentic",
    "kvledger_connector.store.rendezvous:_alive",
    "kvledger_connector.store.rendezvous:_start_time",
    "kvledger_connector.store.rendezvous:engine_secret",
    "kvledger_connector.store.rendezvous:master_listed",
    "kvledger_connector.store.rendezvous:parse_info",
    "kvledger_connector.store.rendezvous:private_dir",
    "kvledger_connector.store.rendezvous:read_own_file",
    "kvledger_connector.store.rendezvous:republish",
    "kvledger_connector.store.rendezvous:runtime_dir",
    # kvledger_connector.store.tier
    "kvledger_connector.store.tier:TIER_DIR_PREFIX",
    # kvledger_connector.worker.loads
    "kvledger_connector.worker.loads:LoadSteps._verified",
    "kvledger_connector.worker.loads:LoadSteps.begin_load",
    "kvledger_connector.worker.loads:LoadSteps.run_load",
    "kvledger_connector.worker.loads:check_load_spec",
    "kvledger_connector.worker.loads:load_pairs",
    # kvledger_connector.worker.saves
    "kvledger_connector.worker.saves:SavePlan.run",
    "kvledger_connector.worker.saves:SaveSteps.begin_save",
    "kvledger_connector.worker.saves:SaveSteps.fail_save",
    "kvledger_connector.worker.saves:SaveSteps.receive",
    "kvledger_connector.worker.saves:SaveSteps.report_save",
    "kvledger_connector.worker.saves:check_drop_notice",
    "kvledger_connector.worker.saves:check_save_spec",
    "kvledger_connector.worker.saves:put_positions",
    # kvledger_connector.worker.sent
    "kvledger_connector.worker.sent:SentBlocks.resolve",
    "kvledger_connector.worker.sent:check_save_spec",
})


def surface_name(obj: Any, attr: str) -> str:
    """`obj.attr` as PATCHED spells it: "module:attr" for a module, "module:Class.attr" for a class."""
    if inspect.ismodule(obj):
        return f"{obj.__name__}:{attr}"
    return f"{obj.__module__}:{obj.__qualname__}.{attr}"


def resolve(name: str) -> Any:
    """The object a PATCHED name names (AttributeError or ImportError when it is gone)."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
    return obj
