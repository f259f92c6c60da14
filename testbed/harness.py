"""A reusable driver: vLLM 0.32.0's real `Scheduler` on CPU + our connector, in one process, 1..N ranks.

    Harness(store_config, tp_size=2, num_blocks=24) ──► vLLM Scheduler (real BlockPool, real preemption)
        │                                                 └─ KVLedgerConnector(SCHEDULER) via vLLM's factory
        ├─ per rank r: KVLedgerConnector(WORKER, tp_rank=r) + a KV cache from vLLM's own allocator
        │              (testbed.kvcache: `kv_layout`, kernel block size, CPU or CUDA)
        └─ step(): schedule → per rank: bind meta, then GPUModelRunner's order: start_load_kv before the
                   "forward" when the step has sync loads (`SchedulerOutput.has_sync_kv_loads`), else after
                   it; wait_for_save, get_finished, load errors, worker meta → vLLM's KVOutputAggregator →
                   update_from_output. The ranks' bind and start_load_kv run in parallel (threads: in vLLM
                   each rank is its own process)

No model weights: the model is a hand-written tiny Llama config written to a temp dir at run time
(`skip_tokenizer_init=True`). The "forward" stands in for attention: it writes into the request's blocks
the KV that position p of the request must hold, a deterministic function of (token prefix up to p,
layer, K|V, rank) — see `KVContent`. Before writing it checks that every earlier position the request
did not write itself (prefix-cache hits, loads from the store) already holds the right KV: a wrong value
there is a computation on garbage (S7), recorded in `garbage` — except for a request holding a block whose
sync load failed in this very step (vLLM discards that request's step and recomputes from the failure:
it is checked from position 0 again next step). As a model would, a forward that read wrong KV (either
case) writes wrong KV (`KVContent.slots` + 1): a save of those blocks pollutes the store, and
`check_store` sees it. Sampled tokens are a function of the
prefix too, so a finished request's output is checkable (`expected_output`).

Every loop over `step()` is bounded: a step that makes no progress (no token scheduled, no pin or load pin
released or taken, no request finished) for `stall_timeout_s` raises `HarnessStallError` with the engine's
and the ranks' state, so a lost report or a load that never finishes fails its test instead of spinning.

After a run, tests call `check_at_rest()` (NoLeakAtRest: every block free, no pin, nothing queued) and
`check_store()` (S1 NoPollution: every stored key of every request block, and of each prompt's partial tail,
holds that block's KV).

This is the harness the conformance suite reuses: `Harness(...)`, `add_request`, `step`, `run`,
`check_at_rest`, `check_store`, `connector(rank)`, `scheduler_connector`.

`connector=` picks what vLLM loads: "ours" (the default, everything above), "none" (no kv_transfer_config:
the same forward and KV checks, no store) or "upstream" (vLLM's own MooncakeStoreConnector on the same
master, testbed/upstream.py: `store_config` gives it the master's addresses and sizes, `extra` its
extra config; `check_store` is ours only). bench.scheduler runs the three on the same workloads.

`sliding_window=W` (connector "none" or "ours"): a sliding-window stand-in, every `full_every`-th layer attends to
all tokens and the others to the last W (`full_every` 2: gpt-oss-like, two KV cache groups; 6: Gemma-3-like, five
sliding layers to one full; 0: no full-attention layer, every layer sliding window, a Mistral-like model: one KV
cache group with a `SlidingWindowSpec`, managed by vLLM's sliding-window manager, and the model config declares
the window as Mistral-7B-v0.1's does, copied into `CacheConfig.sliding_window` as vLLM's EngineArgs would).
vLLM plans the KV cache groups and its hybrid KV cache manager runs, as in the real engine on the CPU platform
(the in-process platform is told it supports it: a labelled test double, `_hybrid_kv_platform`). Every
layer reads and writes through its own group's block table; a sliding-window layer is checked only over
the positions its attention reads (vLLM frees and reuses the blocks of older ones and puts its null block in
their place).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvledger_connector.config import StoreConfig  # noqa: E402
from kvledger_connector.connector import KVLedgerConnector  # noqa: E402
from kvledger_connector.shape.engine_facts import head_shard_views  # noqa: E402
from kvledger_connector.shape.integrity import BlockSeal  # noqa: E402
from kvledger_connector.shape.keys import KeyBuilder, partial_tail_hash  # noqa: E402
from kvledger_connector.shape.kvlayout import plan_block_copies, plan_state_copies  # noqa: E402
from kvledger_connector.store.contract import KVStore  # noqa: E402
from kvledger_connector.store.client import MooncakeStore  # noqa: E402
from testbed.emu_model import (EOS, VOCAB, KVContent, expected_output, mamba_state, shared_prefix_prompts,  # noqa: E402
                               write_jamba_dir, write_model_dir)
from testbed.kvcache import (align_mamba_block_size, allocate, attention_specs,  # noqa: E402
                             build_kv_cache_config, layer_names, mamba_hybrid_specs)


@dataclass
class RunStats:
    steps: int = 0
    preemptions: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished: dict[str, str] = field(default_factory=dict)  # req_id -> finish reason (last generation)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    load_error_blocks: int = 0
    push_work_steps: int = 0  # steps taken only because store jobs still held pins (has_pending_push_work)
    recovered_requests: set[str] = field(default_factory=set)
    # req_id -> tokens vLLM's own prefix cache gave its first scheduling (PrefillStats; latest generation)
    local_hit_tokens: dict[str, int] = field(default_factory=dict)


class HarnessStallError(TimeoutError):
    """The engine made no progress for `stall_timeout_s`; the message says what it was waiting for."""


class HarnessSetupError(RuntimeError):
    """vLLM planned something other than what the harness asked for (e.g. the hybrid manager turned off)."""


@contextlib.contextmanager
def _hybrid_kv_platform() -> Iterator[None]:
    """TEST DOUBLE: the platform declares hybrid KV cache support while the block runs.

    An in-process Scheduler gets vLLM's `UnspecifiedPlatform` (no VLLM_TARGET_DEVICE), whose
    `support_hybrid_kv_cache()` is False, so `VllmConfig.__post_init__` would turn the hybrid KV cache
    manager off and merge sliding-window layers into full attention. The CPU platform the real engine runs
    on (VLLM_TARGET_DEVICE=cpu) says True, as do CUDA, ROCm and XPU. `VllmConfig.__post_init__` is the only
    reader in vLLM 0.32 and 0.33, so the declaration is undone as soon as the config is built. A platform
    that already says True is left alone."""
    from vllm.platforms import current_platform  # resolved here, as VllmConfig would: not at import
    cls = type(current_platform)
    if cls.support_hybrid_kv_cache():
        yield
        return
    own = cls.__dict__.get("support_hybrid_kv_cache")  # None: inherited from Platform
    cls.support_hybrid_kv_cache = classmethod(lambda _cls: True)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del cls.support_hybrid_kv_cache
        else:
            cls.support_hybrid_kv_cache = own  # type: ignore[method-assign]


class Harness:
    # Trace validation (conformance.runlog): when `runlog_dir` is set (the integration conftest does, per
    # test), every harness that is not given its own `trace_path` logs into a fresh file there, and
    # registers in `opened`; the conftest checks each log with TLC after the test.
    runlog_dir: str | None = None
    opened: list[Harness] = []
    # The connector's `lookup_timeout_ms` for harnesses not given one (None: the connector's default). The
    # integration conftest raises it: on a busy machine a lookup past the production deadline is a miss and
    # trips the breaker, which a test of something else must not depend on; deadline tests set their own.
    lookup_timeout_ms: int | None = None

    def __init__(self, store_config: StoreConfig, *, tp_size: int = 1, num_blocks: int = 32,
                 block_size: int = 16, num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 8,
                 policy: str = "recompute", max_num_seqs: int = 8, max_num_batched_tokens: int = 128,
                 extra: dict[str, Any] | None = None, device: str = "cpu", workdir: str | None = None,
                 max_model_len: int = 1024, kv_role: str = "kv_both", stall_timeout_s: float = 60.0,
                 kv_layout: str = "LBNHC", kernel_block_size: int | None = None,
                 kv_events: Any = None, connector: str = "ours", forward_s: float = 0.0,
                 kv_kind: str = "per_rank", sliding_window: int | None = None, full_every: int = 2,
                 mamba: bool = False) -> None:
        if kv_kind not in ("per_rank", "replicated", "mla"):
            raise ValueError(f"Harness kv_kind={kv_kind!r}: must be 'per_rank', 'replicated' or 'mla'")
        # per_rank: each rank its own KV heads; replicated: one KV head that vLLM replicates on every TP
        # rank (GQA); mla: a DeepSeek-V2 model, one latent per token on every rank. In the last two every
        # rank holds the same KV, so the stand-in's content does not depend on the rank.
        self.kv_kind = kv_kind
        if kv_kind != "per_rank":
            num_kv_heads = 1
            if 8 % tp_size:
                raise ValueError(f"Harness tp_size={tp_size}: kv_kind={kv_kind!r} serves TP sizes dividing 8")
        if connector not in ("ours", "upstream", "none"):
            raise ValueError(f"Harness connector={connector!r}: must be 'ours', 'upstream' or 'none'")
        self.connector_kind = connector
        # sliding_window: every full_every-th layer full attention and the others sliding window (this many
        # tokens; full_every=0: every layer, one KV cache group), with vLLM's hybrid KV cache manager on
        if sliding_window is not None:
            if connector == "upstream":
                raise ValueError(f"Harness sliding_window={sliding_window!r}: not with connector='upstream' "
                                 f"(its hybrid support is not driven here)")
            if kv_kind == "mla":
                raise ValueError(f"Harness sliding_window={sliding_window!r}: not with kv_kind='mla'")
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
                raise ValueError(f"Harness sliding_window={sliding_window!r}: must be a token count >= 1")
            if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every == 1 or full_every < 0:
                raise ValueError(f"Harness full_every={full_every!r}: must be 0 (no full-attention layer) or >= 2")
            if num_layers < (1 if full_every == 0 else 2):
                raise ValueError(f"Harness sliding_window={sliding_window!r}: needs num_layers >= 2 "
                                 f"(got {num_layers}): one sliding-window and one full-attention layer "
                                 f"(full_every=0: every layer sliding, one is enough)")
        self.sliding_window = sliding_window
        # every layer sliding window (Mistral-like): vLLM plans one KV cache group, a SlidingWindowSpec
        self.uniform_sliding = sliding_window is not None and full_every == 0
        self.full_every = full_every
        # mamba: a Jamba-like hybrid (Mamba mixers and attention layers alternating), Mamba in vLLM's "align"
        # mode; vLLM aligns the block size to one page size for both (``block_size`` may grow)
        if mamba and (sliding_window is not None or kv_kind != "per_rank" or connector == "upstream"):
            raise ValueError(f"Harness mamba=True: not with sliding_window={sliding_window!r}, "
                             f"kv_kind={kv_kind!r} or connector={connector!r}")
        self.mamba = mamba
        hybrid = sliding_window is not None or mamba
        self._upstream: Any = None
        if not stall_timeout_s > 0:
            raise ValueError(f"Harness stall_timeout_s={stall_timeout_s!r}: must be > 0")
        self.stall_timeout_s = stall_timeout_s
        if not 0 <= forward_s <= 1:
            raise ValueError(f"Harness forward_s={forward_s!r}: must be in 0..1 (seconds)")
        self.forward_s = forward_s  # a stand-in for the model's time per step (benchmarks); 0 in tests
        self._rank_pool: Any = None  # threads running the ranks' start_load_kv in parallel (tp_size > 1)
        self._last_progress = time.monotonic()
        self._progress_mark: tuple[int, ...] = ()
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvledger-harness-")
            workdir = self._tmp.name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_size = tp_size
        self.device = device
        if mamba:
            model_dir = write_jamba_dir(os.path.join(workdir, "tiny-jamba"), num_layers=num_layers,
                                        num_kv_heads=num_kv_heads * tp_size, head_size=head_size)
        else:
            model_dir = write_model_dir(os.path.join(workdir, "tiny-llama"), num_layers=num_layers,
                                        num_kv_heads=num_kv_heads * (tp_size if kv_kind == "per_rank" else 1),
                                        # one model at every TP size up to 8 (the TP-shared layout's tests
                                        # compare engines of different sizes)
                                        num_attention_heads=8 if kv_kind != "per_rank" else None,
                                        head_size=head_size, mla=kv_kind == "mla",
                                        # the uniform case declares its window as Mistral's config does; a
                                        # hybrid's specs come from `attention_specs` alone (unchanged)
                                        **({"sliding_window": sliding_window, "full_every": 0}
                                           if self.uniform_sliding else {}))
        upstream_extra = extra
        extra = {**_store_extra(store_config), **(extra or {})}
        if connector == "ours" and Harness.lookup_timeout_ms is not None:
            extra.setdefault("lookup_timeout_ms", Harness.lookup_timeout_ms)
        if connector == "ours" and "trace_path" not in extra and Harness.runlog_dir is not None:
            extra["trace_path"] = os.path.join(Harness.runlog_dir, f"harness-{len(Harness.opened)}.ndjson")
        self.trace_path: str | None = extra.get("trace_path") if connector == "ours" else None
        kv_transfer_config = None
        if connector == "ours":
            kv_transfer_config = KVTransferConfig(kv_connector="KVLedgerConnector",
                                                  kv_connector_module_path="kvledger_connector.connector",
                                                  kv_role=kv_role, kv_connector_extra_config=extra,
                                                  kv_load_failure_policy=policy)
        elif connector == "upstream":
            from testbed import upstream
            kv_transfer_config = KVTransferConfig(kv_connector=upstream.UPSTREAM, kv_role=kv_role,
                                                  kv_connector_extra_config=upstream.extra_config(upstream_extra),
                                                  kv_load_failure_policy=policy)
        self.rested = False  # check_at_rest() found nothing (the log must then end at rest too)
        mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                         seed=0, max_model_len=max_model_len)
        cache_extra: dict[str, Any] = {"mamba_cache_mode": "align"} if mamba else {}
        if self.uniform_sliding:
            # what vLLM's EngineArgs.create_engine_config does for a model whose layers are all sliding window
            # (no `layer_types`): the window goes to CacheConfig.sliding_window, which each Attention layer takes
            if mc.get_sliding_window() != sliding_window:
                raise HarnessSetupError(f"Harness sliding_window={sliding_window}, full_every=0: vLLM's ModelConfig "
                                        f"reads the stand-in's window as {mc.get_sliding_window()!r}")
            cache_extra["sliding_window"] = mc.get_sliding_window()
        with _hybrid_kv_platform() if hybrid else contextlib.nullcontext():
            self.vllm_config = VllmConfig(
                model_config=mc,
                scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens,
                                                 max_model_len=max_model_len, enable_chunked_prefill=True,
                                                 is_encoder_decoder=False),
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True, **cache_extra),
                parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                kv_transfer_config=kv_transfer_config,
                device_config=DeviceConfig("cpu"),
                kv_events_config=kv_events)  # a vllm.config.KVEventsConfig: the Scheduler's publisher
        if hybrid and self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            raise HarnessSetupError(f"Harness sliding_window={sliding_window}, mamba={mamba}: vLLM turned the "
                                    "hybrid KV cache manager off (scheduler_config.disable_hybrid_kv_cache_manager)")
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.kv_layout = kv_layout
        self.kernel_block_sizes = [kernel_block_size] if kernel_block_size else None
        if mamba:
            align_mamba_block_size(self.vllm_config)
            self._specs = mamba_hybrid_specs(self.vllm_config)
            block_size = self.block_size = self.vllm_config.cache_config.block_size
            self.layer_names = list(self._specs)
        else:
            self.layer_names = layer_names(num_layers)
            self._specs = attention_specs(num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                                          head_size=head_size, dtype=torch.float32, mla=kv_kind == "mla",
                                          sliding_window=sliding_window, full_every=full_every)
        # the engine's KVCacheConfig (layout recorded on cache_config first, as EngineCore does)
        self.kv_cache_config = build_kv_cache_config(self.vllm_config, self._specs, num_blocks, kv_layout)
        groups = self.kv_cache_config.kv_cache_groups
        # per layer, the index of its KV cache group (its block table) and per group the window (None: full)
        self.group_of_layer: dict[str, int] = {n: g for g, grp in enumerate(groups) for n in grp.layer_names}
        self.window_of_group: list[int | None] = [
            grp.kv_cache_spec.sliding_window if isinstance(grp.kv_cache_spec, SlidingWindowSpec) else None
            for grp in groups]
        if self.uniform_sliding and self.window_of_group != [sliding_window]:
            kinds = [type(g.kv_cache_spec).__name__ for g in groups]
            raise HarnessSetupError(f"Harness sliding_window={sliding_window}, full_every=0: vLLM planned "
                                    f"{len(groups)} KV cache groups {kinds} (windows {self.window_of_group}), "
                                    f"expected one SlidingWindowSpec group of window {sliding_window}")
        if (sliding_window is not None and not self.uniform_sliding
                and {w is None for w in self.window_of_group} != {False, True}):
            kinds = [type(g.kv_cache_spec).__name__ for g in groups]
            raise HarnessSetupError(f"Harness sliding_window={sliding_window}: vLLM planned {len(groups)} KV cache "
                                    f"groups {kinds}, expected sliding-window groups and full-attention groups")
        # per Mamba group, its state's bytes (the rest of its page is vLLM's padding)
        self.state_bytes_of_group: dict[int, int] = {
            g: grp.kv_cache_spec.state_content_size_bytes for g, grp in enumerate(groups)
            if type(grp.kv_cache_spec).__name__ == "MambaSpec"}
        if mamba and (len(self.state_bytes_of_group) != 1 or len(groups) != 2):
            raise HarnessSetupError(f"Harness mamba=True: vLLM planned {[type(g.kv_cache_spec).__name__ for g in groups]}, "
                                    "expected one Mamba group and one attention group")
        if not hybrid and len(groups) != 1:
            raise HarnessSetupError(f"Harness: vLLM planned {len(groups)} KV cache groups, expected 1")
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.content = KVContent(num_kv_heads, head_size, device,
                                 total_kv_heads=num_kv_heads * tp_size if kv_kind == "per_rank" else 1)
        # workers first (as in vLLM: KV caches exist before the scheduler)
        self.workers: list[Any] = []  # KVLedgerConnector (ours) or MooncakeStoreConnector (upstream)
        self.kv_caches: list[dict[str, torch.Tensor]] = []
        try:
            if connector == "ours":
                self._build_workers(extra, tp_size, num_blocks, block_size, num_kv_heads, head_size, device)
            else:
                self._build_other_workers(store_config, workdir)
        except BaseException:
            for w in self.workers:
                w.shutdown()
            if self._upstream is not None:
                self._upstream.close()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=block_size, log_stats=True)
        conn = self.scheduler.get_kv_connector()
        want = {"ours": "KVLedgerConnector", "upstream": "MooncakeStoreConnector", "none": "NoneType"}[connector]
        if type(conn).__name__ != want or (connector == "ours" and not isinstance(conn, KVLedgerConnector)):
            raise TypeError(f"vLLM built {type(conn).__name__}, expected {want}")
        self.scheduler_connector: Any = conn
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.aggregator = KVOutputAggregator(tp_size)
        self.requests: dict[str, Request] = {}  # latest request per req_id (ids are reused)
        self._hash_cache: dict[str, list[int]] = {}
        self._verified: dict[str, int] = {}
        self.garbage: list[str] = []  # S7 violations: (req_id, position, rank) read wrong KV
        self.stats = RunStats()
        self._ours = connector == "ours"
        self._checker: MooncakeStore | None = None
        self._scratch: dict[str, torch.Tensor] | None = None
        self._scratch_plans: list[Any] = []
        self._scratch_seal: BlockSeal | None = None
        emb = self.workers[0]._embedded if store_config.embedded and connector == "ours" else None
        # embedded default: the connectors started a private master; the checker joins it
        self._store_config = (store_config.with_addresses(emb.master_address, emb.metadata_server)
                              if emb is not None else store_config)
        self._closed = False
        self.tails_checked = 0  # partial-tail keys check_store found and compared
        Harness.opened.append(self)

    def _build_workers(self, extra: dict[str, Any], tp_size: int, num_blocks: int, block_size: int,
                       num_kv_heads: int, head_size: int, device: str) -> None:
        for r in range(tp_size):
            vc = copy.copy(self.vllm_config)
            vc.kv_transfer_config = dataclasses.replace(
                self.vllm_config.kv_transfer_config, kv_connector_extra_config={**extra, "tp_rank": r})
            w = KVLedgerConnector(vc, KVConnectorRole.WORKER, self.kv_cache_config)
            self.workers.append(w)
            caches = allocate(self.kv_cache_config, self.kv_layout, device=device,
                              kernel_block_sizes=self.kernel_block_sizes)
            w.register_kv_caches(caches)
            self.kv_caches.append(caches)

    def _build_other_workers(self, store_config: StoreConfig, workdir: str) -> None:
        """KV caches from vLLM's allocator for every rank; for "upstream", its worker connector on each."""
        for _ in range(self.tp_size):
            self.kv_caches.append(allocate(self.kv_cache_config, self.kv_layout, device=self.device,
                                           kernel_block_sizes=self.kernel_block_sizes))
        if self.connector_kind != "upstream":
            return
        from testbed import upstream
        if store_config.embedded:
            raise ValueError("Harness connector='upstream': store_config must name a running master")
        path = upstream.write_config(os.path.join(workdir, "mooncake-upstream.json"), store_config.master_server_address,
                                     store_config.metadata_server,
                                     global_segment_size=store_config.global_segment_size,
                                     local_buffer_size=store_config.local_buffer_size)
        self._upstream = upstream.UpstreamRanks(self.vllm_config, self.kv_cache_config, path, self.tp_size)
        self.workers = self._upstream.workers
        for w, caches in zip(self.workers, self.kv_caches):
            w.register_kv_caches(caches)

    # ------------------------------------------------------------------ access
    def connector(self, rank: int) -> KVLedgerConnector:
        return self.workers[rank]

    def wrap_stores(self, wrap: Any) -> None:
        """Replace every connector's store by `wrap(store)` (e.g. a FaultyStore); the real client is kept
        and closed by its connector."""
        sc = self.scheduler_connector.scheduler_side.steps
        sc.store = wrap(sc.store)  # type: ignore[union-attr]
        for w in self.workers:
            w.worker_side.io.store = wrap(w.worker_side.io.store)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None, block_hasher=self._hasher)
        self.requests[req_id] = req
        self._hash_cache[req_id] = []
        self._verified[req_id] = 0
        self.stats.finished.pop(req_id, None)
        self.stats.outputs[req_id] = []
        self.scheduler.add_request(req)
        self._last_progress = time.monotonic()

    def expected_output(self, prompt: list[int], max_tokens: int) -> list[int]:
        return expected_output(prompt, max_tokens)

    def run_pass(self, prompts: list[list[int]], max_tokens: int, tag: str = "req") -> None:
        """Add `<tag>-<i>` for every prompt, run to the end, and check: no KV read wrong (S7), at rest,
        every output the model's."""
        for i, p in enumerate(prompts):
            self.add_request(f"{tag}-{i}", p, max_tokens)
        self.run()
        if self.garbage or self.check_at_rest():
            raise AssertionError(f"pass {tag!r}: wrong KV {self.garbage[:3]}, not at rest {self.check_at_rest()}")
        for i, p in enumerate(prompts):
            if self.stats.outputs[f"{tag}-{i}"] != expected_output(p, max_tokens):
                raise AssertionError(f"pass {tag!r}: {tag}-{i} output differs from the model's")

    @property
    def key_builders(self) -> list[Any]:
        """Each rank's key builder now (a reset may move them to a new weights version); [] for upstream."""
        if not self._ours:
            return []
        return [w.worker_side.steps.block_shape().builders[0] for w in self.workers]  # type: ignore[union-attr]

    def block_hashes_of(self, prompt: list[int]) -> list[Any]:
        """vLLM's block hashes of a prompt, as this engine's scheduler computes them."""
        from vllm.v1.request import Request
        return list(Request("probe", prompt, SamplingParams(max_tokens=1), None,
                            block_hasher=self._hasher).block_hashes)

    def reset_prefix_cache_when_idle(self, max_steps: int = 200, *, reset_connector: bool = False) -> None:
        """vLLM's `reset_prefix_cache(reset_connector=...)`, stepping until it succeeds: it refuses while a
        block is held, and pins of finished jobs are collected over the next steps. RuntimeError after
        ``max_steps`` steps."""
        for _ in range(max_steps):
            if self.scheduler.reset_prefix_cache(reset_connector=reset_connector):
                if reset_connector:
                    self.wait_reset_removals()
                return
            self.step()
        raise RuntimeError(f"reset_prefix_cache() never succeeded in {max_steps} steps")

    def wait_reset_removals(self, timeout_s: float = 30.0) -> None:
        """Until the connector's reset removals (their own thread: kvledger_connector/scheduler/reset.py) are done,
        removed or given up; RuntimeError past `timeout_s`. Nothing to wait for with another connector."""
        removals = getattr(self.scheduler_connector, "removals", None)
        if removals is not None and not removals.wait_idle(timeout_s):
            raise RuntimeError(f"the reset's store removals were not done within {timeout_s} s")

    # ------------------------------------------------------------------ one engine step
    def step(self) -> bool:
        """One engine step; False when the engine would stop (Scheduler.has_requests() is False)."""
        if not self.scheduler.has_requests():
            return False
        if (not self.scheduler.has_unfinished_requests() and self.scheduler_connector is not None
                and self.scheduler_connector.has_pending_push_work()):
            self.stats.push_work_steps += 1
        out = self.scheduler.schedule()
        self.stats.steps += 1
        for rid in out.preempted_req_ids or ():
            self.stats.preemptions += 1
            self.stats.preempted_req_ids.add(rid)
            self._verified[rid] = 0
        meta = out.kv_connector_metadata
        req_ids = list(out.num_scheduled_tokens)
        loads_first = bool(getattr(out, "has_sync_kv_loads", False))  # vLLM's flag: GPUModelRunner's order
        self._each_rank(lambda w: w.bind_connector_metadata(meta))  # ours begins the step here (its loads)
        early: list[set[int]] = [set() for _ in self.workers]
        if loads_first:
            self._start_loads()
            # taken before the forward (get-and-clear; merged into the step's output below) so the forward
            # knows which requests' sync loads failed in this step
            early = [set(w.get_block_ids_with_load_errors()) for w in self.workers]
        sampled = self._forward(out, req_ids, set().union(*early))
        if not loads_first:
            self._start_loads()
        outputs = []
        for w, errs in zip(self.workers, early):
            w.wait_for_save()
            results = w.get_transfer_results(out.finished_req_ids)  # what vLLM's model runner asks
            kvo = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                    finished_recving=results.finished_recving or None,
                                    failed_recving=results.failed_recving,
                                    invalid_block_ids=errs | set(w.get_block_ids_with_load_errors()),
                                    kv_connector_stats=w.get_kv_connector_stats(),
                                    kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=sampled, kv_connector_output=kvo))
        if not self.workers:  # no connector: one output, as a model runner without one returns
            outputs.append(ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=sampled))
        merged = self.aggregator.aggregate(outputs) if self.workers else outputs[0]
        if merged.kv_connector_output is not None:
            self.stats.load_error_blocks += len(merged.kv_connector_output.invalid_block_ids)
        eco = self.scheduler.update_from_output(out, merged)
        for outs in eco.values():
            for o in outs.outputs:
                self.stats.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                ps = getattr(o, "prefill_stats", None)
                if ps is not None:
                    self.stats.local_hit_tokens[o.request_id] = ps.num_local_cached_tokens
                if o.finish_reason is not None:
                    self.stats.finished[o.request_id] = str(o.finish_reason)
        self._check_progress(bool(req_ids))
        if not req_ids and self.scheduler.has_requests():
            time.sleep(0.001)  # only threads can make progress: let them
        return True

    def _start_loads(self) -> None:
        self._each_rank(lambda w: w.start_load_kv(None))

    def _each_rank(self, call: Callable[[Any], None]) -> None:
        """``call`` on every rank's worker connector, the ranks in parallel (vLLM runs each rank in its own
        process)."""
        if len(self.workers) < 2:
            for w in self.workers:
                call(w)
            return
        if self._rank_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._rank_pool = ThreadPoolExecutor(len(self.workers), thread_name_prefix="harness-rank")
        for f in [self._rank_pool.submit(call, w) for w in self.workers]:
            f.result()  # re-raises a rank's exception here

    def _check_progress(self, scheduled: bool) -> None:
        if self.connector_kind != "ours":
            return self._check_progress_other(scheduled)
        ss = self.scheduler_connector.scheduler_side.steps
        ledger = ss.ledger  # type: ignore[union-attr]
        mark = (ledger.num_jobs_opened, ledger.counts.total("jobs_released"), ss.num_load_pins,  # type: ignore[union-attr]
                ss.stats.total("loads_emitted"), len(self.stats.finished), len(self.scheduler.requests))  # type: ignore[union-attr]
        now = time.monotonic()
        if scheduled or mark != self._progress_mark:
            self._progress_mark = mark
            self._last_progress = now
            return
        if now - self._last_progress > self.stall_timeout_s:
            stalled, self._last_progress = now - self._last_progress, now  # a caller going on gets a new window
            busy = [r for r, w in enumerate(self.workers) if w.worker_side.busy()]  # type: ignore[union-attr]
            raise HarnessStallError(
                f"no progress for {stalled:.1f}s (stall_timeout_s={self.stall_timeout_s}) "
                f"after {self.stats.steps} steps: running={len(self.scheduler.running)} "
                f"waiting={len(self.scheduler.waiting)} pinned jobs={ledger.inflight_jobs()[:10]} "  # type: ignore
                f"load pins={ss.num_load_pins} ranks with queued/running work={busy}")  # type: ignore[union-attr]

    def _check_progress_other(self, scheduled: bool) -> None:
        """The same bound for "none" and "upstream" (its pins: `_pinned_saves`, its job counter)."""
        cs = getattr(self.scheduler_connector, "connector_scheduler", None)
        pins = (cs._next_store_job_id, len(cs._pinned_saves)) if cs is not None else ()
        mark = (*pins, len(self.stats.finished), len(self.scheduler.requests))
        now = time.monotonic()
        if scheduled or mark != self._progress_mark:
            self._progress_mark, self._last_progress = mark, now
            return
        if now - self._last_progress > self.stall_timeout_s:
            stalled, self._last_progress = now - self._last_progress, now
            raise HarnessStallError(
                f"no progress for {stalled:.1f}s (stall_timeout_s={self.stall_timeout_s}) after "
                f"{self.stats.steps} steps ({self.connector_kind}): running={len(self.scheduler.running)} "
                f"waiting={len(self.scheduler.waiting)} pinned jobs={sorted(cs._pinned_saves)[:10] if cs else []}")

    def _forward(self, out: Any, req_ids: list[str], failed_blocks: set[int] = frozenset()) -> list[list[int]]:  # type: ignore[assignment]
        """Stand-in for the model: check earlier KV (S7), write this step's KV, sample one token per
        request whose prefill is complete. A request holding a block in ``failed_blocks`` (a sync load
        that failed in this step) is not checked now: vLLM discards its step (checked from 0 next time)."""
        if self.forward_s:
            time.sleep(self.forward_s)  # the model's time (benchmarks only)
        sampled: list[list[int]] = []
        bs = self.block_size
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            n = out.num_scheduled_tokens[rid]
            end = req.num_computed_tokens  # advanced by schedule()
            start = end - n
            tokens = req.all_token_ids
            hashes = KVContent.prefix_hashes(tokens, end, self._hash_cache[rid])
            tables = self.scheduler.kv_cache_manager.get_block_ids(rid)  # one block table per KV cache group
            discarded = bool(failed_blocks) and any(not failed_blocks.isdisjoint(t) for t in tables)
            for r in range(self.tp_size):
                lo = self._verified.get(rid, 0)
                wrong = discarded  # its attention read what the failed load left
                if lo < start and not discarded:
                    wrong = not self._check_range(rid, r, tables, hashes, lo, start)
                self._write_range(r, tables, hashes, start, end, wrong=wrong)
            self._verified[rid] = 0 if discarded else end
            sampled.append([KVContent.token_after(hashes[end - 1])] if end >= req.num_tokens else [])
        del bs
        return sampled

    def _ranges(self, table: list[int], lo: int, hi: int):
        bs = self.block_size
        p = lo
        while p < hi:
            b, off = divmod(p, bs)
            n = min(bs - off, hi - p)
            yield table[b], off, p, n
            p += n

    def _token_slices(self, t: torch.Tensor, block: int, off: int, n: int):
        """Manager block `block`, tokens off..off+n of it, in a [B, H, N, C] view whose B may count
        kernel blocks: yields (kernel block, first token, last token + 1, index into the n tokens)."""
        nk = t.shape[2]
        ratio = self.block_size // nk
        q = off
        while q < off + n:
            kb, lo = divmod(q, nk)
            hi = min(nk, lo + off + n - q)
            yield block * ratio + kb, lo, hi, q - off
            q += hi - lo

    def _kv_of(self, t: torch.Tensor, kv: int) -> torch.Tensor:
        """K (kv=0) or V (kv=1) of a view: full attention packs them in C, K first."""
        if self.kv_kind == "mla":  # one latent per token: the whole of C
            return t
        d = t.shape[3] // 2
        return t[..., kv * d:(kv + 1) * d]

    @property
    def _kv_parts(self) -> tuple[int, ...]:
        return (0,) if self.kv_kind == "mla" else (0, 1)

    def _shard(self, rank: int) -> int:
        """The model's first KV head a rank holds: its own heads', or (replicated, MLA) the one every rank
        holds."""
        return rank * self.content.h if self.kv_kind == "per_rank" else 0

    def _write_range(self, rank: int, tables: Sequence[list[int]], hashes: list[int], lo: int, hi: int,
                     wrong: bool = False) -> None:
        """Write positions lo..hi of every layer through its group's table: their KV, or (``wrong``:
        computed on wrong KV) a value off by one."""
        caches = self.kv_caches[rank]
        for li, name in enumerate(self.layer_names):
            t = caches[name]
            table = tables[self.group_of_layer[name]]
            nbytes = self.state_bytes_of_group.get(self.group_of_layer[name])
            if nbytes is not None:  # a Mamba layer: its state after hi tokens, in block (hi - 1) // bs
                block = table[(hi - 1) // self.block_size]
                if block == 0:
                    raise HarnessSetupError(f"layer {li}: the state after {hi} tokens sits in the null block "
                                            f"(table {table})")
                want = mamba_state(hashes[hi - 1], li, rank, nbytes)
                t[block].view(-1)[:nbytes] = want + 1 if wrong else want
                continue
            for block, off, p, n in self._ranges(table, lo, hi):
                if block == 0:  # vLLM allocates every computed position (a window's old ones only are null)
                    raise HarnessSetupError(f"layer {li}: positions {p}..{p + n} being computed sit in the "
                                            f"null block (table {table})")
                for kv in self._kv_parts:
                    want = self.content.slots(hashes[p:p + n], li, kv, self._shard(rank))  # (n, H, D)
                    if wrong:
                        want = want + 1
                    for kb, a, b, i in self._token_slices(t, block, off, n):
                        self._kv_of(t, kv)[kb, :, a:b] = want[i:i + b - a].transpose(0, 1)

    def _check_range(self, rid: str, rank: int, tables: Sequence[list[int]], hashes: list[int], lo: int,
                     hi: int) -> bool:
        """Whether positions lo..hi hold their KV, for the chunk starting at ``hi``; the first wrong one is
        recorded in `garbage` (S7). A sliding-window layer (window W) is checked over what its attention
        reads, [max(lo, hi - W + 1), hi): vLLM nulls and reuses the blocks of older positions."""
        caches = self.kv_caches[rank]
        for li, name in enumerate(self.layer_names):
            t = caches[name]
            g = self.group_of_layer[name]
            table, window = tables[g], self.window_of_group[g]
            nbytes = self.state_bytes_of_group.get(g)
            if nbytes is not None:  # a Mamba layer reads the state after hi tokens, from block (hi - 1) // bs
                block = table[(hi - 1) // self.block_size] if hi > 0 else -1
                if block == 0:
                    self.garbage.append(f"{rid} rank {rank} state after {hi} tokens layer {li}: in the null block "
                                        f"(S7)")
                    return False
                if block > 0 and not torch.equal(t[block].view(-1)[:nbytes],
                                                 mamba_state(hashes[hi - 1], li, rank, nbytes)):
                    self.garbage.append(f"{rid} rank {rank} state after {hi} tokens (block {block}) layer {li}: "
                                        f"wrong state before compute (S7)")
                    return False
                continue
            first = lo if window is None else max(lo, hi - window + 1)
            for block, off, p, n in self._ranges(table, first, hi):
                if block == 0:  # attention would read the null block
                    self.garbage.append(f"{rid} rank {rank} positions {p}..{p + n} layer {li}: in the null "
                                        f"block, read by attention (S7)")
                    return False
                for kv in self._kv_parts:
                    want = self.content.slots(hashes[p:p + n], li, kv, self._shard(rank))
                    for kb, a, b, i in self._token_slices(t, block, off, n):
                        if not torch.equal(self._kv_of(t, kv)[kb, :, a:b], want[i:i + b - a].transpose(0, 1)):
                            self.garbage.append(f"{rid} rank {rank} positions {p}..{p + n} (block {block}) "
                                                f"layer {li} {'KV'[kv]}: wrong KV before compute (S7)")
                            return False
        return True

    def corrupt_kv(self, req_id: str, layer: int, position: int, rank: int = 0) -> int:
        """FAULT INJECTION (tests only): add 1 to the K of ``position`` of a running request in ``layer``,
        in the block its group's table maps it to now, as a stray write would. Returns that block id."""
        name = self.layer_names[layer]
        table = self.scheduler.kv_cache_manager.get_block_ids(req_id)[self.group_of_layer[name]]
        block, off = table[position // self.block_size], position % self.block_size
        if block == 0:
            raise ValueError(f"corrupt_kv: position {position} of {req_id} is in the null block in layer {layer}")
        t = self.kv_caches[rank][name]
        for kb, a, b, _ in self._token_slices(t, block, off, 1):
            self._kv_of(t, 0)[kb, :, a:b] += 1
        return block

    # ------------------------------------------------------------------ runs
    def run(self, max_steps: int = 20000, timeout_s: float = 240.0) -> RunStats:
        deadline = time.monotonic() + timeout_s
        self._last_progress = time.monotonic()
        for _ in range(max_steps):
            if not self.step():
                return self.stats
            if time.monotonic() > deadline:
                break
        raise TimeoutError(f"engine still busy after {self.stats.steps} steps: running="
                           f"{len(self.scheduler.running)} waiting={len(self.scheduler.waiting)} "
                           f"pins={self._num_pinned_jobs()}")

    def _num_pinned_jobs(self) -> int:
        if self.connector_kind == "ours":
            return self.scheduler_connector.scheduler_side.steps.ledger.num_inflight_jobs  # type: ignore
        if self.connector_kind == "upstream":
            return len(self.scheduler_connector.connector_scheduler._pinned_saves)
        return 0

    @property
    def max_inflight_jobs(self) -> int:
        """The scheduler connector's pin cap on jobs (as its config validated it)."""
        return self.scheduler_connector.config.max_inflight_jobs

    # ------------------------------------------------------------------ checks
    def check_at_rest(self) -> list[str]:
        """NoLeakAtRest: every block free (ref 0), no pin held, no job or load left on any rank."""
        problems = []
        free = self.block_pool.get_num_free_blocks()
        if free != self.num_blocks - 1:
            problems.append(f"{self.num_blocks - 1 - free} blocks not free")
        held = [b.block_id for b in self.block_pool.blocks[1:] if b.ref_cnt != 0]
        if held:
            problems.append(f"blocks with ref_cnt != 0: {held[:20]}")
        if self.connector_kind != "ours":
            if self.connector_kind == "upstream":
                from testbed import upstream
                problems += upstream.at_rest_problems(self.scheduler_connector, self.workers)
            self.rested = not problems
            return problems
        ledger = self.scheduler_connector.scheduler_side.steps.ledger  # type: ignore[union-attr]
        if ledger.has_pending_work():
            problems.append(f"pins held by jobs {ledger.inflight_jobs()[:20]}")
        if self.scheduler_connector.scheduler_side.steps.num_load_pins:  # type: ignore[union-attr]
            problems.append("load pins held")
        for r, w in enumerate(self.workers):
            ws = w.worker_side
            if ws.has_pending_work():  # type: ignore[union-attr]
                problems.append(f"rank {r} has pending jobs or loads")
            if ws.steps.errors:  # type: ignore[union-attr]
                problems.append(f"rank {r} handler errors: {ws.steps.errors[:3]}")  # type: ignore[union-attr]
        self.rested = not problems
        return problems

    def checker(self) -> MooncakeStore:
        """A client of this harness's store of its own (no segment): what a test reads the store with."""
        if self._checker is None:
            self._checker = MooncakeStore.connect(self._store_config.replace(global_segment_size=0))
        return self._checker

    def check_store(self) -> tuple[int, int]:
        """S1 NoPollution over every full block of every request seen: (keys checked, polluted keys).
        Each stored object is read into block 1 of a scratch KV cache that vLLM's allocator builds with
        the same spec and layout, and compared through vLLM's view, token by token."""
        if self.connector_kind != "ours":
            raise NotImplementedError(f"check_store reads our keys; this harness runs {self.connector_kind!r}")
        store = self.checker()
        if self._scratch is None:  # one registered cache per harness (a re-registered address is -600)
            vc = copy.copy(self.vllm_config)
            vc.cache_config = copy.copy(vc.cache_config)
            cfg = build_kv_cache_config(vc, self._specs, 2, self.kv_layout)
            self._scratch = allocate(cfg, self.kv_layout, kernel_block_sizes=self.kernel_block_sizes)
            # one plan per part of a block, as the workers key it: per KV cache group over its layers (a hybrid
            # model's groups alias one allocation), per head shard in the TP-shared layout
            k = self._heads_per_key
            self._scratch_plans = [
                plan_state_copies({n: self._scratch[n] for n in names}, page_bytes=self._specs[names[0]].page_size_bytes,
                                  num_blocks=2) if g in self.state_bytes_of_group else
                plan_block_copies(head_shard_views({n: self._scratch[n] for n in names}, k, j),
                                  layout=self.kv_layout, block_size=self.block_size, num_blocks=2)
                for g, names in enumerate(self._group_layers()) for j in range(self._key_parts)]
            for ptr, nbytes in sorted({s for p in self._scratch_plans for s in p.storages}):
                store.register_buffer(ptr, nbytes)
            seal = self.workers[0].worker_side.steps.seal if self.workers else None  # type: ignore[union-attr]
            if seal is not None:  # the objects' trailers, read and checked with the workers' integrity key
                self._scratch_seal = BlockSeal(seal.ikey, self._scratch_plans, self._scratch, slots=1, max_keys=1)
                for ptr, nbytes in self._scratch_seal.regions:
                    store.register_buffer(ptr, nbytes)
        bs = self.block_size
        checked = polluted = 0
        seen: set[tuple[int, int, bytes]] = set()
        builders = [list(w.worker_side.steps.block_shape().builders) for w in self.workers]  # type: ignore[union-attr]
        for req in self.requests.values():
            tokens = req.all_token_ids
            hashes = KVContent.prefix_hashes(tokens, len(tokens), [])
            objects = [(bh, bi * bs, bs) for bi, bh in enumerate(req.block_hashes)]
            k, r = divmod(req.num_prompt_tokens, bs)
            if r >= 2 and 1 <= k <= len(req.block_hashes):  # the prompt's partial tail (save_partial_tail)
                objects.append((partial_tail_hash(req.block_hashes[k - 1], req.prompt_token_ids[k * bs:k * bs + r]),
                                k * bs, r))
            for bh, first, n in objects:
                for r, p, kb in [(r, p, kb) for r, per_part in enumerate(builders) for p, kb in enumerate(per_part)]:
                    if (r, p, bytes(bh)) in seen:
                        continue
                    seen.add((r, p, bytes(bh)))
                    ok = self._stored_object_ok(store, kb.key(bh), r, p, hashes, first, n)
                    if ok is None:
                        continue  # not stored (or evicted between the two calls)
                    checked += 1
                    self.tails_checked += n < bs
                    polluted += 0 if ok else 1
        return checked, polluted

    def _stored_object_ok(self, store: Any, key: str, r: int, p: int, hashes: list[int], first: int, n: int
                          ) -> bool | None:
        """Rank ``r``'s object of part ``p`` under ``key``, read into scratch block 1: whether its first ``n``
        token slots hold the KV of positions first..first + n (a Mamba part: the state after first + n
        tokens) and its trailer matches; None when the store does not hold it."""
        if store.batch_is_exist([key])[0] != 1:
            return None
        ptrs, sizes = self._scratch_buffers(p)
        if store.batch_get([key], [ptrs], [sizes])[0] <= 0:
            return None
        scratch, k = self._scratch, self._heads_per_key
        if scratch is None:
            raise RuntimeError("check_store: no scratch KV cache")
        shape = self.workers[0].worker_side.steps.block_shape()  # type: ignore[union-attr]
        g = shape.parts[p].group  # the workers' order of a block's parts
        j = p - shape.parts_of(g).start
        pos = hashes[first:first + n]
        layers = self._group_layers()[g]
        ok = self._trailer_ok(key, p)
        for li, name in enumerate(self.layer_names):
            if name not in layers:
                continue  # another group's layer: not in this object
            nbytes = self.state_bytes_of_group.get(g)
            if nbytes is not None:  # the state after the block's last token
                ok = ok and torch.equal(scratch[name][1].view(-1)[:nbytes],
                                        mamba_state(hashes[first + n - 1], li, r, nbytes))
                continue
            t = head_shard_views({name: scratch[name]}, k, j)[name]  # this key's heads
            for kv in self._kv_parts:
                want = self.content.slots(pos, li, kv, self._shard(r)).cpu()
                want = want if not k else want[:, j * k:(j + 1) * k]
                for kbk, a, b, i in self._token_slices(t, 1, 0, n):
                    ok = ok and torch.equal(self._kv_of(t, kv)[kbk, :, a:b], want[i:i + b - a].transpose(0, 1))
        return ok

    def _group_layers(self) -> list[list[str]]:
        """The layer names of each KV cache group, in group order (one group: every layer)."""
        n = max(self.group_of_layer.values(), default=0) + 1
        return [[name for name in self.layer_names if self.group_of_layer.get(name, 0) == g] for g in range(n)]

    @property
    def _heads_per_key(self) -> int:
        """The workers' `kv_heads_per_key` (0: a key per TP shard)."""
        return self.workers[0].engine.kv_heads_per_key if self._ours and self.workers else 0

    @property
    def _key_parts(self) -> int:
        """Keys per block and KV cache group on a rank (head shards in the TP-shared layout)."""
        return self.workers[0].engine.key_parts if self._ours and self.workers else 1

    def _scratch_buffers(self, part: int = 0) -> tuple[list[int], list[int]]:
        """Block 1 of the scratch cache (of one part of a block: a KV cache group's layers, a head shard's
        heads), then the trailer slot when the workers tag their objects."""
        ptrs, sizes = self._scratch_plans[part].buffers(1)
        if self._scratch_seal is not None:
            ptrs, sizes = ptrs + self._scratch_seal.trailer_ptrs(0, 1), sizes + [self._scratch_seal.trailer_bytes]
        return ptrs, sizes

    def _trailer_ok(self, key: str, part: int = 0) -> bool:
        """The object just read into the scratch block (of part ``part`` of a block) matches its trailer's
        tag (True without integrity)."""
        return self._scratch_seal is None or self._scratch_seal.verify(0, [key], [1], [part]) == [True]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._checker is not None:  # before an embedded master goes away with the last connector
            self._checker.close()
        for w in self.workers:
            w.shutdown()
        if self._rank_pool is not None:
            self._rank_pool.shutdown(wait=True)
        if self._upstream is not None:
            self._upstream.close()
        if self.scheduler_connector is not None:
            self.scheduler_connector.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store_extra(cfg: StoreConfig) -> dict[str, Any]:
    """A StoreConfig as extra-config keys (only the fields that differ from the defaults)."""
    default = StoreConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(default, f.name)}


__all__ = ["EOS", "VOCAB", "Harness", "HarnessStallError", "KVContent", "RunStats", "expected_output",
           "shared_prefix_prompts", "write_model_dir", "KVStore", "KeyBuilder"]
