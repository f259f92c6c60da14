"""What a worker's connector did over a whole run, read in the worker's own process: the stand-in worker
(`testbed.emu_worker.EmuWorker.emu_stats`) and vLLM's real CPU worker (`testbed.real_worker.ConnectorProbe`,
a worker extension) report the same fields, so one set of test checks reads both."""
from __future__ import annotations

import os
from typing import Any

#: result field -> the connector's whole-run counter (the worker steps' one counter sink)
_COUNTERS = (("num_loads", "loads"), ("num_load_blocks_failed", "load_errors_reported"),
             ("num_saves_run", "run_jobs"), ("num_saves_stale", "stale_jobs"),
             ("num_saves_skipped", "skipped_jobs"), ("num_saves_failed", "failed_jobs"),
             ("num_saves_rejected", "rejected_jobs"),
             ("num_store_exceptions", "store_exceptions"), ("put_keys", "put_keys"), ("get_keys", "get_keys"))


def connector_stats() -> dict[str, Any] | None:
    """This process's KV connector: its class, and for ours the whole-run counters, errors, key prefixes,
    pending work and which master it joined. None when the engine has no connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    ws = getattr(conn, "worker_side", None)
    info: dict[str, Any] = {"class": type(conn).__name__}
    if ws is not None:
        steps = ws.steps
        for name, counter in _COUNTERS:
            info[name] = int(steps.stats.total(counter))
        info["loads_finished"] = int(steps.loads.counts.total("loads_finished"))
        info["errors"] = list(steps.errors)[:5]
        info["key_prefix"] = steps.shape.parts[0].builder.prefix if steps.shape is not None else None
        info["key_prefixes"] = [kb.prefix for kb in steps.block_shape().builders]  # a key per part of a block
        info["pending_work"] = bool(ws.has_pending_work())
        injected = getattr(ws.io.store, "injected_total", None)  # a FaultyStore (FaultyEmuWorker)
        if injected is not None:
            info["faults_injected"] = injected
    info["store"] = store_info(conn)
    return info


def store_info(conn: Any) -> dict[str, Any]:
    """Which Mooncake master this connector's store client joined, and how: the embedded servers' owner
    (this process started them), attached (another process of the engine did), or configured."""
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.store.rendezvous import AttachedMooncake
    store = getattr(conn, "store", None)
    cfg = getattr(store, "config", None)
    emb = getattr(conn, "_embedded", None)
    info: dict[str, Any] = {"master_server_address": getattr(cfg, "master_server_address", None),
                            "metadata_server": getattr(cfg, "metadata_server", None), "embedded": None}
    if isinstance(emb, EmbeddedMooncake):
        info.update(embedded="owner", owner_pid=os.getpid(), master_pid=emb.master_pid,
                    metadata_pid=emb.metadata_pid)
    elif isinstance(emb, AttachedMooncake):
        info.update(embedded="attached", owner_pid=emb.owner_pid)
    return info
