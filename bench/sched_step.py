"""The connectors' scheduler-side work per engine step, ours and upstream's, driven by vLLM's own Scheduler.

One vLLM 0.32 `Scheduler` (real `KVCacheManager` and `BlockPool`, real `Request`s with sha256 block hashes,
real preemption) is built with `TeeSchedulerConnector` below as its KV connector. The tee holds both
connectors' scheduler-side components and forwards every scheduler-side hook vLLM calls to each of them,
timing each call; the order of the two alternates every step:

    ours      kvledger_connector.scheduler.side.SchedulerSide (inside a KVLedgerConnector built by its own
              constructor; the decisions are kvledger_connector/scheduler/steps.py's SchedulerSteps):
              on_new_request, get_num_new_matched_tokens, update_state_after_alloc,
              build_connector_meta (notices, take_loads, emit_stores: save ranges, open_job pins, SaveSpecs),
              update_connector_output (collect_loads, collect), request_finished, has_pending_push_work
    upstream  vLLM 0.32's MooncakeStoreScheduler (the object MooncakeStoreConnector's scheduler role
              delegates to, built by its own constructor): get_num_new_matched_tokens,
              update_state_after_alloc, build_connector_meta (request trackers, ReqMeta per request,
              current block tables, _reference_save_blocks pins), update_connector_output,
              has_pending_push_work. Its connector's request_finished returns (False, None) without calling
              the scheduler component and has no on_new_request: nothing to time there.

Both see the same SchedulerOutput and the same Request objects in the same step. Lookups are off on
both sides (the store round trip is not scheduler-side CPU work): the role is kv_producer, which turns
ours' lookups off, and upstream gets ``enable_lookup: false``. Both pin into the scheduler's one
BlockPool (each its own touch/free pairs). The bench plays the workers: a job built in step k is
reported done by rank 0 in step k+1 (and, with 2 ranks, by rank 1 in step k+2), to each side in its own
worker-metadata class, built outside the timed calls. At the end both ledgers must be empty and every
block free.

`run(workload)` returns per-step records; bench/ledger.py prints the timing table, bench/metadata.py the
pickled metadata sizes (a `probe` reads each step's metadata objects).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402

from testbed.store_double import StoreDouble  # noqa: E402

SIDES = ("ours", "upstream")


class BenchError(RuntimeError):
    pass


class NullStore(StoreDouble):
    """The scheduler side's store when lookups are off: never asked (kv_producer does no lookup)."""

    def register_buffer(self, ptr: int, size: int) -> None:
        raise BenchError("NullStore.register_buffer called")

    def batch_is_exist(self, keys: Any) -> list[int]:
        raise BenchError("lookups are off, yet the scheduler side asked the store")

    def batch_put(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        raise BenchError("NullStore.batch_put called")

    def batch_get(self, keys: Any, ptrs: Any, sizes: Any) -> list[int]:
        raise BenchError("NullStore.batch_get called")

    def remove(self, key: str, force: bool = False) -> int:
        return 0

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        return None


@dataclass
class StepRecord:
    ns: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIDES})
    hook_ns: Counter[tuple[str, str]] = field(default_factory=Counter)  # (side, hook) -> ns
    jobs: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SIDES})
    metas: dict[str, Any] = field(default_factory=dict)  # this step's metadata objects
    extra: dict[str, Any] = field(default_factory=dict)  # what a `probe` recorded
    sched_ns: int = 0  # schedule() + update_from_output(), hooks of both sides included
    scheduled: int = 0  # requests scheduled this step


class TeeSchedulerConnector(KVConnectorBase_V1):
    """Scheduler role only: every hook goes to ours and to upstream's scheduler component, each timed."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role != KVConnectorRole.SCHEDULER:
            raise BenchError("TeeSchedulerConnector is scheduler-side only")
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import MooncakeStoreScheduler

        from kvledger_connector.connector import KVLedgerConnector
        ktc = vllm_config.kv_transfer_config
        bench = dict(ktc.kv_connector_extra_config["bench"])
        self.world_size = vllm_config.parallel_config.world_size

        def side_config(name: str, module: str | None, extra: dict[str, Any]) -> Any:
            vc = copy.copy(vllm_config)
            vc.kv_transfer_config = dataclasses.replace(ktc, kv_connector=name, kv_connector_module_path=module,
                                                        kv_connector_extra_config=extra)
            return vc

        ours_extra = {"save_decode": bool(bench["save_decode"]), "max_inflight_jobs": int(bench["max_jobs"]),
                      "max_pinned_blocks": int(bench["max_pinned_blocks"])}
        self.ours_conn = KVLedgerConnector(side_config("KVLedgerConnector", "kvledger_connector.connector",
                                                       ours_extra), role, kv_cache_config, store=NullStore())
        self.ours = self.ours_conn.scheduler_side
        up_extra = {"enable_lookup": False, "save_decode_cache": bool(bench["save_decode"])}
        self.up = MooncakeStoreScheduler(side_config("MooncakeStoreConnector", None, up_extra), kv_cache_config)
        self._flip = False
        self.step = StepRecord()
        self._history: dict[str, list[list[int]]] = {s: [] for s in SIDES}

    # ------------------------------------------------------------------ timing
    def _both(self, hook: str, ours: Callable[[], Any], up: Callable[[], Any]) -> tuple[Any, Any]:
        """Call ours() and up(), in this step's order, adding each one's time; both results returned."""
        pc = time.perf_counter_ns
        first, second = (up, ours) if self._flip else (ours, up)
        t0 = pc()
        r1 = first()
        t1 = pc()
        r2 = second()
        t2 = pc()
        if self._flip:
            r_up, r_ours, dt_up, dt_ours = r1, r2, t1 - t0, t2 - t1
        else:
            r_ours, r_up, dt_ours, dt_up = r1, r2, t1 - t0, t2 - t1
        st = self.step
        st.ns["ours"] += dt_ours
        st.ns["upstream"] += dt_up
        st.hook_ns["ours", hook] += dt_ours
        st.hook_ns["upstream", hook] += dt_up
        return r_ours, r_up

    def _ours_only(self, hook: str, fn: Any) -> Any:
        t0 = time.perf_counter_ns()
        r = fn()
        dt = time.perf_counter_ns() - t0
        self.step.ns["ours"] += dt
        self.step.hook_ns["ours", hook] += dt
        return r

    def take_step(self) -> StepRecord:
        rec, self.step = self.step, StepRecord()
        self._flip = not self._flip
        return rec

    # ------------------------------------------------------------------ binding
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.ours_conn.bind_kv_cache_manager(kv_cache_manager)  # binds the pool too
        self.up.bind_gpu_block_pool(kv_cache_manager.block_pool)

    # ------------------------------------------------------------------ vLLM's scheduler-side hooks
    def on_new_request(self, request: Any) -> None:
        self._ours_only("on_new_request", lambda: self.ours.on_new_request(request))  # upstream has none

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        ours, up = self._both("get_num_new_matched_tokens",
                              lambda: self.ours.get_num_new_matched_tokens(request, num_computed_tokens),
                              lambda: self.up.get_num_new_matched_tokens(request, num_computed_tokens))
        if ours[0] != 0 or (up[0] or 0) != 0:
            raise BenchError(f"a lookup answered a hit with lookups off: ours {ours}, upstream {up}")
        return ours

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._both("update_state_after_alloc",
                   lambda: self.ours.update_state_after_alloc(request, blocks, num_external_tokens),
                   lambda: self.up.update_state_after_alloc(request, blocks, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta, up_meta = self._both("build_connector_meta", lambda: self.ours.build_connector_meta(scheduler_output),
                                   lambda: self.up.build_connector_meta(scheduler_output))
        ours_jobs = [s.store_job_id for s in meta.saves]
        up_jobs = [m.store_job_id for m in up_meta.requests if m.can_save and m.store_job_id is not None]
        self._history["ours"].append(ours_jobs)
        self._history["upstream"].append(up_jobs)
        self.step.jobs = {"ours": len(ours_jobs), "upstream": len(up_jobs)}
        self.step.metas = {"ours": meta, "upstream": up_meta}
        return meta

    def _reports(self, side: str) -> dict[int, int]:
        """What the ranks report this step: rank r finished the jobs built r + 1 steps ago."""
        hist = self._history[side]
        done: Counter[int] = Counter()
        for r in range(self.world_size):
            if len(hist) >= r + 2:
                done.update(hist[-(r + 2)])
        return dict(done)

    def update_connector_output(self, connector_output: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        from kvledger_connector.metadata import KVLedgerWorkerMetadata
        ours_out = dataclasses.replace(connector_output,
                                       kv_connector_worker_meta=KVLedgerWorkerMetadata(self._reports("ours")))
        up_out = KVConnectorOutput(finished_recving=connector_output.finished_recving,
                                   kv_connector_worker_meta=MooncakeStoreWorkerMetadata(
                                       completed_saves=self._reports("upstream")))
        self._both("update_connector_output", lambda: self.ours.update_connector_output(ours_out),
                   lambda: self.up.update_connector_output(up_out))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # upstream's MooncakeStoreConnector.request_finished: (False, None), its scheduler component untouched
        return self._ours_only("request_finished", lambda: self.ours.request_finished(request))

    def has_pending_push_work(self) -> bool:
        ours, up = self._both("has_pending_push_work", self.ours.steps.has_pending_push_work,
                              self.up.has_pending_push_work)
        return bool(ours or up)

    def get_kv_connector_stats(self) -> Any:
        return None

    def shutdown(self) -> None:
        self.ours_conn.shutdown()
        self.up.client.close()

    # ------------------------------------------------------------------ worker-side hooks: never called
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise BenchError("worker hook on the scheduler-side tee")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise BenchError("worker hook on the scheduler-side tee")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise BenchError("worker hook on the scheduler-side tee")

    def wait_for_save(self) -> None:
        raise BenchError("worker hook on the scheduler-side tee")


# ----------------------------------------------------------------------------- the driver
@dataclass(frozen=True)
class Workload:
    max_num_seqs: int  # requests running at once
    prompt_blocks: int  # prompt length in blocks (distinct random tokens: no prefix-cache hit)
    max_tokens: int  # output tokens per request: uniform in [1, 2 * max_tokens - 1] (seeded) unless fixed
    num_requests: int
    world_size: int = 1
    save_decode: bool = False
    fixed_tokens: bool = False  # every request generates exactly max_tokens
    block_size: int = 16
    seed: int = 7

    def label(self) -> str:
        return (f"N={self.max_num_seqs} B={self.prompt_blocks} ws={self.world_size} "
                f"out={'=' if self.fixed_tokens else '~'}{self.max_tokens} save_decode={int(self.save_decode)}")


@dataclass
class RunResult:
    workload: Workload
    steps: list[StepRecord]
    admission: StepRecord  # hooks vLLM called while the requests were added (counted in the totals)
    preemptions: int
    jobs_total: dict[str, int]
    deferrals: int

    def total_ns(self, side: str, hooks: tuple[str, ...] | None = None) -> int:
        recs = [self.admission, *self.steps]
        if hooks is None:
            return sum(r.ns[side] for r in recs)
        return sum(r.hook_ns[side, h] for r in recs for h in hooks)


def _build(w: Workload, workdir: str) -> tuple[Any, TeeSchedulerConnector]:
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from testbed.emu_model import write_model_dir
    from testbed.kvcache import attention_specs, build_kv_cache_config

    bs = w.block_size
    longest = w.prompt_blocks * bs + (2 * w.max_tokens if not w.fixed_tokens else w.max_tokens)
    max_model_len = -(-(longest + bs) // bs) * bs
    blocks_per_req = -(-max_model_len // bs)
    num_blocks = 2 * w.max_num_seqs * blocks_per_req + 16  # room for pins held past a request's finish
    batched = max(w.max_num_seqs * w.prompt_blocks * bs // 2, max_model_len)
    model_dir = write_model_dir(os.path.join(workdir, "tiny-llama"), num_layers=2,
                                num_kv_heads=2 * w.world_size, head_size=8)
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                     max_model_len=max_model_len)
    bench = {"save_decode": w.save_decode, "max_jobs": 8 * w.max_num_seqs,
             "max_pinned_blocks": num_blocks}  # no cap in the way: upstream has none
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=batched,
                                         max_model_len=max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=w.world_size),
        kv_transfer_config=KVTransferConfig(kv_connector="TeeSchedulerConnector",
                                            kv_connector_module_path="bench.sched_step", kv_role="kv_producer",
                                            kv_connector_extra_config={"bench": bench}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = num_blocks
    specs = attention_specs(2, block_size=bs, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kvc = build_kv_cache_config(vc, specs, num_blocks, "LBNHC")
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=bs, log_stats=False)
    tee = sched.get_kv_connector()
    if not isinstance(tee, TeeSchedulerConnector):
        raise BenchError(f"vLLM built {type(tee).__name__}, expected TeeSchedulerConnector")
    return sched, tee


def run(w: Workload, *, probe: Callable[[StepRecord], None] | None = None) -> RunResult:
    """Every request of `w` through vLLM's Scheduler with the tee; one StepRecord per engine step.
    `probe(record)` is called after each step (untimed) while `record.metas` holds both sides' metadata
    objects; they are dropped afterwards."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    from testbed.emu_model import EOS, VOCAB

    rng = random.Random(w.seed)
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-sched-") as wd:
        sched, tee = _build(w, wd)
        try:
            init_none_hash(sha256)
            hasher = get_request_block_hasher(w.block_size, sha256)
            for i in range(w.num_requests):
                n_out = w.max_tokens if w.fixed_tokens else rng.randint(1, 2 * w.max_tokens - 1)
                sp = SamplingParams(max_tokens=n_out, ignore_eos=True)
                sp.update_from_generation_config({}, EOS)
                prompt = [rng.randrange(3, VOCAB) for _ in range(w.prompt_blocks * w.block_size)]
                sched.add_request(Request(request_id=f"req-{i}", prompt_token_ids=prompt, sampling_params=sp,
                                          pooling_params=None, block_hasher=hasher))
            admission = tee.take_step()  # add_request's hooks (ours' on_new_request), before the first step
            steps: list[StepRecord] = []
            preemptions = 0
            pc = time.perf_counter_ns
            while sched.has_requests():
                if len(steps) > 50 * w.num_requests + 1000:
                    raise BenchError(f"{w.label()}: no end after {len(steps)} steps")
                t0 = pc()
                out = sched.schedule()
                t1 = pc()
                preemptions += len(out.preempted_req_ids or ())
                req_ids = list(out.num_scheduled_tokens)
                sampled = [[11] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
                           for r in req_ids]
                mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                        sampled_token_ids=sampled, kv_connector_output=KVConnectorOutput())
                t2 = pc()
                sched.update_from_output(out, mro)
                t3 = pc()
                rec = tee.take_step()
                rec.sched_ns = (t1 - t0) + (t3 - t2)
                rec.scheduled = len(req_ids)
                if probe is not None:
                    probe(rec)
                rec.metas = {}
                steps.append(rec)
            ours, up = tee.ours, tee.up
            pool = sched.kv_cache_manager.block_pool
            if ours.has_pending_push_work() or up._pinned_saves:
                raise BenchError(f"{w.label()}: pins left: ours {ours.ledger.inflight_jobs()[:5]}, "
                                 f"upstream {list(up._pinned_saves)[:5]}")
            if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
                raise BenchError(f"{w.label()}: {pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()} blocks "
                                 "still held at the end")
            jobs = {s: sum(r.jobs[s] for r in steps) for s in SIDES}
            deferrals = int(ours.stats.total("deferrals"))
            return RunResult(w, steps, admission, preemptions, jobs, deferrals)
        finally:
            sched.shutdown()
