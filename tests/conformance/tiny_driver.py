"""Replay driver for the tiny spec (tests/conformance/tiny/TinyPin.tla) on real parts: kvledger's
SchedulerLedger and WorkerLedger on vLLM's real BlockPool. One request holds one block; every
store job pins it. Receive is folded into EmitStore (every rank registers the job at once) since the
tiny model has no queue."""
from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool

from conformance.engine.replay import Refused
from kvledger.errors import LedgerError
from kvledger.metadata import aggregate_into
from kvledger.scheduler import SchedulerLedger
from kvledger.worker import WorkerLedger

RANKS = ("w0", "w1")
MAX_JOBS = 3


class TinyPinDriver:
    def reset(self, init: dict[str, Any]) -> None:
        self.pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
        (self.block,) = self.pool.get_new_blocks(1)  # the request's own reference
        self.sched = SchedulerLedger(self.pool, world_size=len(RANKS), max_inflight_jobs=3,
                                     max_pinned_blocks=8, first_job_id=1)
        self.workers = {w: WorkerLedger(i, max_live_jobs=4) for i, w in enumerate(RANKS)}
        self.merged: dict[int, int] = {}  # reports taken from the workers, not yet collected

    def apply(self, action: dict[str, Any], pre: dict[str, Any], post: dict[str, Any]) -> None:
        name = action["name"]
        try:
            if name == "EmitStore":
                if self.sched.next_job_id > MAX_JOBS:  # the model's finite bound, not a system rule
                    raise Refused(f"the model emits at most {MAX_JOBS} jobs")
                # the new id is an output: observe() compares it with the model's nextJob
                job = self.sched.open_job("r1", [self.block.block_id])
                for w in self.workers.values():
                    w.register("r1", job)
            elif name == "Report":
                wl = self.workers[action["w"]]
                wl.begin(action["job"])
                wl.record_saved(action["job"], 16)
                wl.finish(action["job"])
                aggregate_into(self.merged, wl.take_completed())
            elif name == "Collect":
                j = action["job"]
                if self.merged.get(j, 0) < len(RANKS):  # Collect(j) in the tiny model = release j
                    raise Refused(f"job {j}: {self.merged.get(j, 0)} of {len(RANKS)} reports")
                self.sched.collect({j: self.merged.pop(j)})
            else:
                raise Refused(f"no mapping for {name}")
        except LedgerError as e:
            raise Refused(str(e)) from e

    def observe(self) -> dict[str, Any]:
        pinned = sorted(self.sched.inflight_jobs())
        return {
            "pinned": pinned,
            "nextJob": self.sched.next_job_id,
            "reported": {w: sorted(j for j in pinned if self._reported(wl, j))
                         for w, wl in self.workers.items()},
            "block_ref": self.block.ref_cnt,
        }

    @staticmethod
    def _reported(wl: WorkerLedger, job: int) -> bool:
        try:
            return wl.job_state(job) == "reported"
        except LedgerError:
            return False

    def expect(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"pinned": state["pinned"], "nextJob": state["nextJob"], "reported": state["reported"],
                "block_ref": 1 + len(state["pinned"])}

    def inputs(self, action: dict[str, Any]) -> Any:
        # EmitStore's job id is an output of the system, not a choice of the caller
        return {k: v for k, v in action.items() if not (action["name"] == "EmitStore" and k == "job")}

    def check_invariants(self) -> None:
        obs = self.observe()
        if obs["block_ref"] != 1 + len(obs["pinned"]):  # S3 RefCountExact on the real BlockPool
            raise AssertionError(f"S3 RefCountExact: ref {obs['block_ref']} for {obs['pinned']}")

    def close(self) -> None:
        pass
