"""A worker extension for vLLM's real CPU worker (`worker_extension_cls=`): named RPCs the engine driver
calls through `collective_rpc`, so a test can read what each rank's connector did. It adds methods only;
the worker, its model runner and the model are vLLM's own."""
from __future__ import annotations

import os
from typing import Any

from testbed.connector_stats import connector_stats


class ConnectorProbe:
    """Mixed into vLLM's `CPUWorker` by `WorkerWrapperBase` (vLLM appends the class to the worker's bases)."""

    def connector_probe(self) -> dict[str, Any]:
        """This rank's connector counters and the KV cache view vLLM's model runner registered with it."""
        rank = getattr(self, "rank", None)
        caches = getattr(getattr(self, "model_runner", None), "kv_caches", None) or []
        first = caches[0] if caches and hasattr(caches[0], "shape") else None
        return {"rank": rank, "pid": os.getpid(), "connector": connector_stats(),
                "kv_view": None if first is None else {"shape": list(first.shape), "stride": list(first.stride()),
                                                       "dtype": str(first.dtype)}}
