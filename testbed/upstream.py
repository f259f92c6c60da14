"""vLLM 0.32's own `MooncakeStoreConnector` in the in-process harness (testbed/harness.py,
``Harness(..., connector="upstream")``): its scheduler side built by vLLM's Scheduler through the connector
factory, one worker side per emulated TP rank, each on a KV cache from vLLM's allocator, all on the same
Mooncake master as ours.

Configured as its docs say: a ``MOONCAKE_CONFIG_PATH`` file (metadata_server, master_server_address,
protocol "tcp", device_name "", global_segment_size, local_buffer_size), read by each worker's constructor;
a ``lookup_rpc_port`` of its own per harness (the scheduler's lookups go over ZMQ IPC to rank 0's
`LookupKeyServer`, and a second harness in the same process must not reach the first one's server).

Two TEST DOUBLES, each only because the harness runs every rank in one process on CPU:

* rank identity: `MooncakeStoreWorker.__init__` asks vLLM's distributed groups for its TP rank and size and
  its PCP/DCP groups. In a real engine each worker process has initialised those groups; here the ranks
  share one process, so for the duration of each rank's constructor the worker module's four names answer
  that rank's identity (TP rank r of `tp_size`, PCP and DCP of size 1, as a TP-only engine has). Nothing
  else of vLLM is replaced, and the names are restored after each constructor.
* ``torch.cuda.Event``: upstream's `wait_for_save` records one; a CPU-only torch cannot create it. The
  labelled no-op stand-in of testbed/cuda_event_stub.py is installed while an upstream harness is open
  (CPU only; with CUDA nothing is installed) and the real class restored on close.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import types
from collections.abc import Iterator
from typing import Any

UPSTREAM = "MooncakeStoreConnector"
_RANK_NAMES = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_pcp_group",
               "get_dcp_group")


@contextlib.contextmanager
def rank_identity(rank: int, tp_size: int) -> Iterator[None]:
    """TEST DOUBLE (see the module doc): the worker module's group look-ups answer rank `rank` of a TP-only
    engine of `tp_size` ranks while the block runs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as uw
    saved = {n: getattr(uw, n) for n in _RANK_NAMES}
    single = types.SimpleNamespace(world_size=1, rank_in_group=0)
    uw.get_tensor_model_parallel_rank = lambda: rank
    uw.get_tensor_model_parallel_world_size = lambda: tp_size
    uw.get_pcp_group = lambda: single
    uw.get_dcp_group = lambda: single
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(uw, n, f)


def write_config(path: str, master_address: str, metadata_server: str, *, global_segment_size: int,
                 local_buffer_size: int) -> str:
    """Upstream's MOONCAKE_CONFIG_PATH file (vllm.distributed.mooncake_store.MooncakeStoreConfig.from_file)."""
    with open(path, "w") as f:
        json.dump({"metadata_server": metadata_server, "master_server_address": master_address,
                   "protocol": "tcp", "device_name": "", "global_segment_size": global_segment_size,
                   "local_buffer_size": local_buffer_size}, f)
    return path


def extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    """Upstream's kv_connector_extra_config: the caller's keys, plus a lookup port of this harness's own."""
    out = dict(extra or {})
    out.setdefault("lookup_rpc_port", random.randrange(20000, 60000))
    return out


class UpstreamRanks:
    """The upstream worker connectors of one harness and what they need while open (config file, stand-in)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config_path: str, tp_size: int) -> None:
        from testbed.cuda_event_stub import install
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
        import torch
        self._event = torch.cuda.Event
        self.stand_in = install()
        self.workers: list[Any] = []
        old_env = os.environ.get("MOONCAKE_CONFIG_PATH")
        os.environ["MOONCAKE_CONFIG_PATH"] = config_path
        try:
            for r in range(tp_size):
                vc = copy.copy(vllm_config)
                vc.parallel_config = copy.copy(vllm_config.parallel_config)
                vc.parallel_config.rank = r  # rank 0 serves the scheduler's lookups, as in an engine
                with rank_identity(r, tp_size):
                    self.workers.append(MooncakeStoreConnector(vc, KVConnectorRole.WORKER, kv_cache_config))
        except BaseException:
            self.close()
            raise
        finally:
            if old_env is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = old_env

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
            ls = w.connector_worker.lookup_server if w.connector_worker is not None else None
            if ls is not None:
                ls.running = False
        self.workers = []
        import torch
        torch.cuda.Event = self._event  # type: ignore[misc]


def at_rest_problems(scheduler_connector: Any, workers: list[Any]) -> list[str]:
    """Upstream's side of NoLeakAtRest: no store job pinned, no save or load queued on any rank."""
    problems = []
    pinned = scheduler_connector.connector_scheduler._pinned_saves
    if pinned:
        problems.append(f"pins held by jobs {sorted(pinned)[:20]}")
    for r, w in enumerate(workers):
        cw = w.connector_worker
        st = cw.kv_send_thread
        if st is not None and st.request_queue.unfinished_tasks:
            problems.append(f"rank {r}: {st.request_queue.unfinished_tasks} saves queued or running")
        if cw.recv_request_queue.qsize():
            problems.append(f"rank {r}: loads queued")
    return problems
