"""`EmuWorker`: a stand-in for the MODEL inside vLLM's real engine — not a stand-in for vLLM.

    LLM(..., worker_cls="testbed.emu_worker.EmuWorker", skip_tokenizer_init=True, enforce_eager=True)

Everything around the model is vLLM 0.32's own code, unchanged: `LLM` → `LLMEngine` → `EngineCore` (real
`Scheduler`, `KVCacheManager`, `BlockPool`, the scheduler-side connector) → `UniProcExecutor` or
`MultiprocExecutor` (worker processes, shared-memory queues, pickled `SchedulerOutput`s, vLLM's
`KVOutputAggregator`) → this class, called through `WorkerWrapperBase` like any worker. vLLM's distributed
set-up (gloo TP group), its layout resolution, its `KVCacheConfig`, its allocator (`allocate_kv_cache`), its
connector factory (`ensure_kv_transfer_initialized`) and its connector call sequence
(`KVConnectorModelRunnerMixin`, the `maybe_transfer_kv_layer` per-layer hooks) are used as they are.

What is emulated is only the model's arithmetic (testbed/emu_model.py): the "attention" of layer l writes,
for every scheduled position p, the KV that `KVContent` defines for (prefix of p, l, K|V, KV head) into the
request's blocks through vLLM's [B, H, N, C] views (K in C[:D], V in C[D:]); the sampled token is a
function of the prefix. Before writing, each layer CHECKS every earlier position of the request that this
worker did not write itself in the request's current lifetime (local prefix-cache hits, blocks loaded by
the connector, blocks kept across a preemption) and that its attention reads: a mismatch is KV the model
would have computed on (`wrong_kv`) — unless the step's own connector output reports one of the request's
blocks as a failed load (a sync load that failed inside this step: vLLM discards that request's step and
recomputes from the failure, so the read is counted in `discarded_wrong_reads` instead and the request
checked from 0 again). Outputs are checkable with `emu_model.expected_output`.

A model whose config declares `sliding_window` and `layer_types` (`emu_model.write_model_dir(sliding_window=W)`)
is a gpt-oss-like (or Gemma-3-like) hybrid: the sliding layers report a `SlidingWindowSpec`, the full ones a
`FullAttentionSpec`, and with vLLM's hybrid KV cache manager on there are several KV cache groups, each with
its own block table (vLLM's `block_ids` carry one list per group). A config that declares `sliding_window`
without `layer_types` (`write_model_dir(sliding_window=W, full_every=0)`, as Mistral-7B-v0.1's does) is a
uniform sliding-window model: vLLM's EngineArgs copies the window into `CacheConfig.sliding_window`, which
every layer takes (as vLLM's `Attention` does without a per-layer window), every layer reports a
`SlidingWindowSpec`, and vLLM plans one KV cache group managed by its sliding-window manager. Each layer writes
and reads through its group's table; a sliding-window layer reads only the last W positions,
[start - W + 1, start), since vLLM puts its null block (block 0) below the window and frees and reuses the
blocks it replaces.

Per-request state follows `GPUModelRunner._update_states`: new requests, cached/resumed requests (block
ids appended, or replaced on resumption), `num_computed_tokens`, output tokens trimmed to the scheduler's
`num_output_tokens`, finished requests dropped (a finished id may come back as a new request in the same
step). Tests read what a rank saw with `llm.collective_rpc("emu_stats")`.

`FaultyEmuWorker` is the same worker with the connector's worker-side store wrapped in `testbed.faults.
FaultyStore` (a FAULT-INJECTION TEST DOUBLE around the real Mooncake store) per a plan in the environment
(`EMU_FAULT_PLAN`, see the class).
"""
from __future__ import annotations

import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from testbed.connector_stats import connector_stats
from testbed.emu_model import KVContent, hybrid_layer_types, mamba_state
from testbed.kvcache import (align_mamba_block_size, attention_specs, layer_names, mamba_hybrid_specs,
                             mamba_layer_names)

# under vLLM's logger namespace: vLLM configures handlers and level for "vllm" only
logger = init_logger(f"vllm.{__name__}")

#: KV cache bytes reported when the engine sets no `kv_cache_memory_bytes` (tests set
#: `num_gpu_blocks_override`, which vLLM applies after this answer)
DEFAULT_KV_CACHE_BYTES = 32 << 20
#: wrong-KV messages kept per rank (the counter counts them all)
MAX_MESSAGES = 10

#: vLLM's null block: what a sliding-window table holds below the window
NULL_BLOCK_ID = 0

_R = TypeVar("_R")


class EmuWorkerError(RuntimeError):
    """The engine handed the stand-in something it cannot emulate (or a block table that breaks vLLM's own
    invariants, e.g. a position being computed in the null block)."""


def hybrid_window(model_config: Any, num_layers: int, cache_config: Any = None) -> tuple[int, int] | None:
    """(sliding window, full_every) of a sliding-window config, or None for a model whose layers all attend to
    everything. A hybrid (`sliding_window` + `layer_types`, every ``full_every``-th layer full attention:
    `emu_model.hybrid_layer_types`) gives its ``full_every`` >= 2. A config without `layer_types`, or with every
    layer "sliding_attention", is a uniform sliding-window model (Mistral-like): ``full_every`` 0, its window
    the one each of vLLM's `Attention` layers would take, ``cache_config.sliding_window`` (EngineArgs copies the
    model's there for such a model; it must agree with the model's). Another pattern is refused: the
    stand-in's specs (`testbed.kvcache.attention_specs`) would not match the config."""
    window = model_config.get_sliding_window()
    if window is None:
        return None
    types = getattr(model_config.hf_text_config, "layer_types", None)
    if types is None or list(types) == hybrid_layer_types(num_layers, 0):
        layer_window = getattr(cache_config, "sliding_window", None) if cache_config is not None else window
        if layer_window != window:
            raise EmuWorkerError(f"EmuWorker: every layer sliding, the model's window {window} but "
                                 f"cache_config.sliding_window={layer_window} (what vLLM's layers take)")
        return int(window), 0
    types = list(types)
    for every in range(2, num_layers + 1):
        if types == hybrid_layer_types(num_layers, every):
            return int(window), every
    raise EmuWorkerError(f"EmuWorker: sliding_window={window} with layer_types={types}; the stand-in emulates "
                         f"every k-th layer full attention, the others sliding (k >= 2), or every layer sliding")


def _rpc(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Counts calls per method: `emu_stats()["rpc_calls"]` shows what the engine asked of the worker."""
    @functools.wraps(fn)
    def wrapper(self: EmuWorker, *args: Any, **kwargs: Any) -> _R:
        self.rpc_calls[fn.__name__] += 1
        return fn(self, *args, **kwargs)
    return wrapper


class _StandInAttention:
    """What a model's `Attention` layer leaves in `static_forward_context[layer_name]` for vLLM's
    per-layer connector hooks (`maybe_transfer_kv_layer` reads `.kv_cache` through it)."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name
        self.kv_cache = torch.empty(0)


@dataclass(frozen=True)
class _AttnMetadata:
    """Per-layer attention metadata of one step (the hooks only need it to be present)."""
    layer_name: str
    num_tokens: int


@maybe_transfer_kv_layer
def _attention(layer_name: str, worker: EmuWorker) -> None:
    """One attention layer's forward, wrapped by vLLM's own decorator exactly as `Attention` ops are:
    `wait_for_layer_load(layer_name)` before, `save_kv_layer(layer_name, kv_cache, attn_metadata)` after."""
    worker._attend(layer_name)


@dataclass
class _ReqState:
    """This worker's view of one request lifetime (GPUModelRunner's `CachedRequestState`, reduced)."""
    tokens: list[int]  # prompt + sampled tokens, as the model runner keeps them
    num_prompt_tokens: int
    tables: list[list[int]]  # one block table per KV cache group (a sliding-window one starts with nulls)
    num_computed_tokens: int
    hashes: list[int] = field(default_factory=list)  # KVContent prefix hashes, a cache over `tokens`
    # positions [0, valid_upto) of the current block table were written or checked in this lifetime
    valid_upto: int = 0


@dataclass
class _StepPlan:
    """The positions one step reads (check) and writes, per request."""
    req_ids: list[str]
    check: dict[str, tuple[int, int]]
    write: dict[str, tuple[int, int]]
    num_tokens: int


class EmuWorker(WorkerBase):
    """vLLM worker class whose "model" is `testbed.emu_model` (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.rpc_calls: Counter[str] = Counter()
        mc, pc = self.model_config, self.parallel_config
        self.num_layers = mc.get_num_layers(pc)
        self.num_kv_heads = mc.get_num_kv_heads(pc)  # per TP shard
        self.head_size = mc.get_head_size()
        self.kv_dtype = kv_cache_dtype_str_to_dtype(self.cache_config.cache_dtype, mc)
        # a Mamba hybrid (`emu_model.write_jamba_dir`): mixers report a MambaSpec ("align" mode), and each
        # chunk writes the state after its last token into the block vLLM's align mode keeps it in
        self.mamba = getattr(mc.hf_config, "model_type", None) == "jamba"
        self.layer_names = mamba_layer_names(mc.hf_config) if self.mamba else layer_names(self.num_layers)
        # a sliding-window model (every full_every-th layer full attention, the others sliding window; 0:
        # every layer sliding); None: every layer full attention
        hybrid = hybrid_window(mc, self.num_layers, self.cache_config)
        self.sliding_window, self.full_every = hybrid if hybrid is not None else (None, 2)
        if self.sliding_window is not None and mc.use_mla:
            raise EmuWorkerError("EmuWorker: a sliding-window model with MLA is not emulated")
        self.content = KVContent(self.num_kv_heads, self.head_size,
                                 total_kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads())
        # MLA: one latent of head_size per token (no K/V halves), the same on every TP rank
        self.mla = bool(mc.use_mla)
        self.tp_rank = 0
        self.shard = 0  # the model's first KV head this rank holds (the stand-in's content): set with the TP rank
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_layout: str | None = None
        self.requests: dict[str, _ReqState] = {}
        self._plan: _StepPlan | None = None
        self._pending: ModelRunnerOutput | None = None  # execute_model's output until sample_tokens
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        # checked tokens are counted once per step, at the first attention layer (a Mamba hybrid's layer 0 is a mixer)
        self._first_attention_layer = next(i for i, n in enumerate(self.layer_names) if not n.endswith(".mixer"))
        # per layer, its KV cache group (block table); per group, the window its attention reads (None: all).
        # Set from the KVCacheConfig vLLM planned (initialize_from_config)
        self.group_of_layer: dict[str, int] = {}
        self.window_of_group: list[int | None] = []
        self.state_bytes_of_group: dict[int, int] = {}  # per Mamba group, its state's bytes in a page
        self.group_specs: list[str] = []
        self.counts: Counter[str] = Counter()
        self.messages: list[str] = []
        self._wrong_reads: dict[str, list[tuple[int, str]]] = {}  # this step's, judged after its connector output

    # ------------------------------------------------------------------ start-up (EngineCore's order)
    @_rpc
    def init_device(self) -> None:
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
        self.device = torch.device("cpu")
        if current_platform.is_cpu():
            # the CPU communicator names its shared-memory group after this (as CPUWorker sets it)
            im = self.distributed_init_method
            os.environ["VLLM_DIST_IDENT"] = (os.path.basename(im.removeprefix("file://"))
                                             if im.startswith("file://") else im.split(":")[-1])
        # init_distributed_environment + ensure_model_parallel_initialized: the real TP group, from
        # which the connector learns its rank
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        self.tp_rank = get_tp_group().rank_in_group
        # the KV this rank holds, as vLLM's layers would compute it: MLA's latent is every rank's; with more
        # ranks than KV heads, QKVParallelLinear gives rank r head r // (tp / heads), shared by its replicas
        tp, heads = self.parallel_config.tensor_parallel_size, self.model_config.get_total_num_kv_heads()
        self.shard = (0 if self.mla else self.tp_rank // (tp // heads) if tp > heads
                      else self.tp_rank * self.num_kv_heads)

    @_rpc
    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """No weights. The attention layers register in the forward context, as `Attention` does."""
        sfc = self.compilation_config.static_forward_context
        for name in self.layer_names:
            sfc[name] = _StandInAttention(name)
        if self.mamba:  # TEST DOUBLE for the engine's update_block_size_for_backend: no real layers to ask
            align_mamba_block_size(self.vllm_config)

    @_rpc
    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    @_rpc
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        if self.mamba:
            return mamba_hybrid_specs(self.vllm_config, self.kv_dtype)
        if self.sliding_window is not None:
            return attention_specs(self.num_layers, block_size=self.cache_config.block_size,
                                   num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=self.kv_dtype,
                                   sliding_window=self.sliding_window, full_every=self.full_every)
        spec: KVCacheSpec
        if self.mla:
            spec = MLAAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=1,
                                    head_size=self.head_size, dtype=self.kv_dtype)
        else:
            spec = FullAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                                     head_size=self.head_size, dtype=self.kv_dtype)
        return {n: spec for n in self.layer_names}

    def _kv_part(self, kv: int) -> slice:
        """Where K (kv 0) or V (kv 1) lives in a view's last dim; MLA's one latent is all of it."""
        return slice(None) if self.mla else slice(kv * self.head_size, (kv + 1) * self.head_size)

    @_rpc
    def get_supported_kv_cache_layouts(self) -> list[str]:
        """The emulation writes through whatever view vLLM's allocator makes, so every layout is
        supported; vLLM resolves one (`VLLM_KV_CACHE_LAYOUT` picks another). LBNHC first: the layout
        this machine's CPU backend resolves by default."""
        names = [lay.name for lay in KVCacheLayout]
        return ["LBNHC"] + [n for n in names if n != "LBNHC"]

    @_rpc
    def set_kv_cache_layout(self, kv_cache_layout: str, *cp_kv_cache_interleave_size: int) -> None:
        # vLLM 0.33's core also sends the context-parallel interleave size it resolved; 0.32 only the layout
        super().set_kv_cache_layout(kv_cache_layout, *cp_kv_cache_interleave_size)

    @_rpc
    def determine_available_memory(self) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        return int(explicit) if explicit is not None else DEFAULT_KV_CACHE_BYTES

    @_rpc
    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    @_rpc
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """As `Worker.initialize_from_config` + `GPUModelRunner.initialize_kv_cache`: the connector
        first (it needs the KVCacheConfig), then vLLM's allocator, whose views go to the connector
        unchanged."""
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if kv_cache_config.kv_cache_layout is not None:
            record_kv_cache_layout(self.cache_config, kv_cache_config.kv_cache_layout)
        self.cache_config.hash_block_size = kv_cache_config.hash_block_size
        self.cache_config.cache_hit_alignment_tokens = kv_cache_config.cache_hit_alignment_tokens
        groups = kv_cache_config.kv_cache_groups
        self.group_of_layer = {n: g for g, grp in enumerate(groups) for n in grp.layer_names}
        # with the hybrid manager off vLLM merges a hybrid's sliding-window layers into full attention (one
        # group): the stand-in then checks every earlier position, which the merged table still holds (a
        # uniform sliding-window model stays one SlidingWindowSpec group either way)
        self.window_of_group = [grp.kv_cache_spec.sliding_window if isinstance(grp.kv_cache_spec, SlidingWindowSpec)
                                else None for grp in groups]
        self.group_specs = [type(grp.kv_cache_spec).__name__ for grp in groups]
        self.state_bytes_of_group = {g: grp.kv_cache_spec.state_content_size_bytes for g, grp in enumerate(groups)
                                     if self.group_specs[g] == "MambaSpec"}
        ungrouped = [n for n in self.layer_names if n not in self.group_of_layer]
        if ungrouped:
            raise EmuWorkerError(f"EmuWorker: vLLM's KVCacheConfig puts layers {ungrouped} in no KV cache group")
        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        if has_kv_transfer_group():
            self._connector_created(get_kv_transfer_group())
        layout = self.cache_config.get_resolved_kv_cache_layout()
        self.kv_layout = layout.name
        # kernel_block_sizes None: one kernel block per block (no attention backend asks for less)
        self.kv_caches = allocate_kv_cache(kv_cache_config, self.device or torch.device("cpu"), layout, None)
        missing = [n for n in self.layer_names if n not in self.kv_caches]
        if missing:
            raise RuntimeError(f"EmuWorker: vLLM's allocator made no view for layers {missing}")
        sfc = self.compilation_config.static_forward_context
        for name, view in self.kv_caches.items():
            sfc[name].kv_cache = view  # as bind_kv_cache does for Attention layers
        if has_kv_transfer_group():
            get_kv_transfer_group().register_kv_caches(self.kv_caches)

    def _connector_created(self, connector: Any) -> None:
        """Called once the worker-side connector exists, before the KV caches are registered (subclasses
        wrap its store here)."""
        return

    @_rpc
    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    @_rpc
    def get_kv_connector_handshake_metadata(self) -> dict[tuple[int, int], Any] | None:
        if not has_kv_transfer_group():
            return None
        md = get_kv_transfer_group().get_handshake_metadata()
        return None if md is None else {(get_pp_group().rank_in_group, self.tp_rank): md}

    # ------------------------------------------------------------------ steps
    @_rpc
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """GPUModelRunner.execute_model's order: handle_preemptions, state update, then either the
        no-forward connector round or the forward inside the connector's context. Returns None (the
        engine then calls sample_tokens), or the no-forward output."""
        if self._pending is not None:
            raise RuntimeError("EmuWorker: execute_model called twice without sample_tokens")
        so = scheduler_output
        self.counts["steps"] += 1
        if has_kv_transfer_group():
            meta = so.kv_connector_metadata
            if meta is None:
                raise RuntimeError("EmuWorker: a connector is configured but the step carries no metadata")
            get_kv_transfer_group().handle_preemptions(meta)
        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            self.counts["no_forward_steps"] += 1
            if not has_kv_transfer_group():
                return EMPTY_MODEL_RUNNER_OUTPUT
            out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.vllm_config)
            self._note_connector_output(out.kv_connector_output)
            return out
        plan = self._plan_step(so)
        attn_metadata = {n: _AttnMetadata(n, plan.num_tokens) for n in self.layer_names}
        self._plan = plan
        self._wrong_reads = {}
        try:
            with (set_forward_context(attn_metadata, self.vllm_config, num_tokens=plan.num_tokens, slot_mapping={}),
                  KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_output):
                for name in self.layer_names:
                    _attention(name, self)
        finally:
            self._plan = None
        self.counts["forward_steps"] += 1
        self._note_connector_output(kv_output)
        sampled: list[list[int]] = []
        for rid in plan.req_ids:
            st = self.requests[rid]
            _, end = plan.write[rid]
            st.valid_upto = end
            self.counts["tokens_written"] += end - plan.write[rid][0]
            # a token is sampled once the request's known tokens are all computed (not mid-prefill)
            sampled.append([KVContent.token_after(st.hashes[end - 1])] if end >= len(st.tokens) else [])
        self._judge_wrong_reads(kv_output)  # after valid_upto moved: a discarded step moves it back to 0
        self._pending = ModelRunnerOutput(req_ids=plan.req_ids,
                                          req_id_to_index={r: i for i, r in enumerate(plan.req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_output)
        return None

    @_rpc
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        out, self._pending = self._pending, None
        if out is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            if toks:
                self.requests[rid].tokens.extend(toks)
                self.counts["sampled_tokens"] += len(toks)
        return out

    @_rpc
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None  # no speculative decoding

    @_rpc
    def check_health(self) -> None:
        return

    @_rpc
    def reset_mm_cache(self) -> None:
        return

    @_rpc
    def reset_encoder_cache(self) -> None:
        return

    @_rpc
    def shutdown(self) -> None:
        logger.info("EmuWorker rank %d shutdown: wrong_kv=%d, calls %s", self.rank, self.counts["wrong_kv"],
                    dict(self.rpc_calls))
        t0 = time.monotonic()
        if ensure_kv_transfer_shutdown is not None:  # None during interpreter shutdown (as Worker checks)
            ensure_kv_transfer_shutdown()
        logger.info("EmuWorker rank %d: connector shut down in %.2fs", self.rank, time.monotonic() - t0)

    # ------------------------------------------------------------------ named RPCs for tests
    def emu_stats(self) -> dict[str, Any]:
        """What this rank saw: its counters, wrong-KV messages, the view it registered, the RPCs vLLM
        made, and the connector's worker-side whole-run counters (when it has them)."""
        first = self.kv_caches.get(self.layer_names[0]) if self.layer_names else None
        stats: dict[str, Any] = {
            "rank": self.rank, "tp_rank": self.tp_rank, "pid": os.getpid(),
            "wrong_kv": self.counts["wrong_kv"], "messages": list(self.messages),
            "counts": dict(self.counts), "rpc_calls": dict(self.rpc_calls),
            "live_requests": len(self.requests), "kv_layout": self.kv_layout,
            "kv_cache_groups": [{"spec": spec, "sliding_window": w,
                                 "layers": [self._layer_index[n] for n, g in self.group_of_layer.items() if g == i]}
                                for i, (spec, w) in enumerate(zip(self.group_specs, self.window_of_group))],
            "kv_view": None if first is None else {"shape": list(first.shape), "stride": list(first.stride()),
                                                   "dtype": str(first.dtype)},
            "connector": connector_stats(),
        }
        return stats

    # ------------------------------------------------------------------ state (GPUModelRunner._update_states)
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:  # before new requests: an id can finish and return in one step
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            self.counts["preemptions"] += 1
            st = self.requests.get(rid)
            if st is not None:
                st.valid_upto = 0  # its blocks went back to the pool
        for nr in so.scheduled_new_reqs:
            if nr.prompt_token_ids is None:
                raise RuntimeError(f"EmuWorker: request {nr.req_id} has no prompt token ids (embeddings?)")
            self.requests[nr.req_id] = _ReqState(tokens=list(nr.prompt_token_ids),
                                                 num_prompt_tokens=len(nr.prompt_token_ids),
                                                 tables=self._tables(nr.req_id, nr.block_ids),
                                                 num_computed_tokens=nr.num_computed_tokens)
            self.counts["new_requests"] += 1
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = cr.num_computed_tokens[i]
            num_out = cr.num_output_tokens[i]
            if num_out < len(st.tokens) - st.num_prompt_tokens:
                # the scheduler discarded outputs (e.g. a failed sync load): drop them here too
                del st.tokens[st.num_prompt_tokens + num_out:]
                del st.hashes[len(st.tokens):]
            new_ids = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:  # a resumed request's tables are replaced, not appended to
                self.counts["resumptions"] += 1
                st.tables = self._tables(rid, new_ids)
                st.valid_upto = 0
            elif new_ids is not None:
                for table, ids in zip(st.tables, self._tables(rid, new_ids)):
                    table.extend(ids)

    def _tables(self, rid: str, block_ids: tuple[list[int], ...] | None) -> list[list[int]]:
        """A scheduler output's block ids (one list per KV cache group, or None: no new block) as tables."""
        n = len(self.window_of_group)
        if block_ids is None:
            return [[] for _ in range(n)]
        if len(block_ids) != n:
            raise EmuWorkerError(f"EmuWorker: {rid} got block ids for {len(block_ids)} KV cache groups, the "
                                 f"KVCacheConfig has {n}")
        return [list(ids) for ids in block_ids]

    def _plan_step(self, so: SchedulerOutput) -> _StepPlan:
        req_ids = list(so.num_scheduled_tokens)
        check: dict[str, tuple[int, int]] = {}
        write: dict[str, tuple[int, int]] = {}
        bs = self.cache_config.block_size
        for rid in req_ids:
            st = self.requests[rid]
            start = st.num_computed_tokens
            end = start + so.num_scheduled_tokens[rid]
            if end > len(st.tokens):
                raise RuntimeError(f"EmuWorker: {rid} scheduled up to position {end}, it has {len(st.tokens)} "
                                   f"tokens")
            for g, table in enumerate(st.tables):
                if end > len(table) * bs:
                    raise RuntimeError(f"EmuWorker: {rid} scheduled up to position {end}, its block table of "
                                       f"group {g} covers {len(table) * bs}")
            KVContent.prefix_hashes(st.tokens, end, st.hashes)
            write[rid] = (start, end)
            if st.valid_upto < start:
                check[rid] = (st.valid_upto, start)
        return _StepPlan(req_ids, check, write, sum(so.num_scheduled_tokens.values()))

    # ------------------------------------------------------------------ the emulated attention
    def _attend(self, layer_name: str) -> None:
        """Layer `layer_name` of this step, in a real attention op's order: first the whole batch's new
        K/V go into the cache (reshape_and_cache over the slot mapping), then attention reads the earlier
        positions. Reading second matters: vLLM caches a block when it is allocated, so a request can hit
        a prefix block that another request of the same batch writes in this very step."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("EmuWorker: attention outside a step")
        li = self._layer_index[layer_name]
        g = self.group_of_layer[layer_name]
        window = self.window_of_group[g]
        view = self.kv_caches[layer_name]
        if g in self.state_bytes_of_group:
            self._mamba(li, g, view)
            return
        for rid in plan.req_ids:
            lo, hi = plan.write[rid]
            st = self.requests[rid]
            kb, off = self._slots(view, st.tables[g], lo, hi)
            if bool((kb < 0).any()):  # vLLM allocates every position it schedules: only old ones are null
                raise EmuWorkerError(f"EmuWorker: {rid} layer {li} computes positions {lo}..{hi} into the null "
                                     f"block (group {g} table {st.tables[g]})")
            for kv in ((0,) if self.mla else (0, 1)):
                want = self.content.slots(st.hashes[lo:hi], li, kv, self.shard).to(view.dtype)
                view[kb, :, off, self._kv_part(kv)] = want
        for rid, (lo, hi) in plan.check.items():
            # a sliding-window layer's attention at `hi` reads [hi - W + 1, hi): older positions may be null
            first = lo if window is None else max(lo, hi - window + 1)
            if first < hi:
                self._check(rid, view, li, g, first, hi)

    def _mamba(self, li: int, g: int, view: torch.Tensor) -> None:
        """A Mamba mixer of this step in vLLM's "align" mode: a request starting at `start` reads the state
        after `start` tokens from block (start - 1) // block_size of its table (checked when this worker did
        not write it in the request's lifetime: a load, a prefix-cache hit, a resumption), and its chunk's
        final state goes to block (end - 1) // block_size (vLLM copies the running state there first)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("EmuWorker: a Mamba mixer outside a step")
        bs = self.cache_config.block_size
        nbytes = self.state_bytes_of_group[g]
        for rid in plan.req_ids:
            st = self.requests[rid]
            start, end = plan.write[rid]
            table = st.tables[g]
            if rid in plan.check and start > 0:
                self.counts["states_checked"] += 1
                block = table[(start - 1) // bs]
                if block == NULL_BLOCK_ID or not torch.equal(
                        view[block].view(-1)[:nbytes], mamba_state(st.hashes[start - 1], li, self.tp_rank, nbytes)):
                    self._wrong_reads.setdefault(rid, []).append((1, (
                        f"{rid} rank {self.tp_rank} layer {li}: the state after {start} tokens (block {block}, "
                        f"group {g}) is wrong")))
            block = table[(end - 1) // bs]
            if block == NULL_BLOCK_ID:
                raise EmuWorkerError(f"EmuWorker: {rid} layer {li} writes the state after {end} tokens into the "
                                     f"null block (group {g} table {table})")
            view[block].view(-1)[:nbytes] = mamba_state(st.hashes[end - 1], li, self.tp_rank, nbytes)

    def _slots(self, view: torch.Tensor, table: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index tensors (kernel block, token in kernel block) of positions lo..hi in a [B, H, N, C] view
        whose B may count kernel blocks (B = num_blocks * block_size / N). A position in vLLM's null block
        gets kernel block -1."""
        bs = self.cache_config.block_size
        nk = view.shape[2]
        pos = torch.arange(lo, hi)
        blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
        kb = blocks * (bs // nk) + (pos % bs) // nk
        return torch.where(blocks == NULL_BLOCK_ID, -1, kb), pos % nk

    def _check(self, rid: str, view: torch.Tensor, li: int, g: int, lo: int, hi: int) -> None:
        st = self.requests[rid]
        table = st.tables[g]
        kb, off = self._slots(view, table, lo, hi)
        self.counts["tokens_checked"] += hi - lo if li == self._first_attention_layer else 0
        null = kb < 0
        if bool(null.any()):  # attention would read the null block: whatever it holds is wrong KV
            n_null = int(null.sum())
            first = lo + int(null.nonzero()[0, 0])
            self._wrong_reads.setdefault(rid, []).append((n_null, (
                f"{rid} rank {self.tp_rank} layer {li}: {n_null} of positions {lo}..{hi} read are in the null "
                f"block (first {first}, group {g})")))
            return
        for kv in ((0,) if self.mla else (0, 1)):
            want = self.content.slots(st.hashes[lo:hi], li, kv, self.shard).to(view.dtype)
            got = view[kb, :, off, self._kv_part(kv)]  # (n, H, D)
            bad = (got != want).flatten(1).any(1)
            n_bad = int(bad.sum())
            if n_bad:
                first = lo + int(bad.nonzero()[0, 0])
                self._wrong_reads.setdefault(rid, []).append((n_bad, (
                    f"{rid} rank {self.tp_rank} layer {li} {'KV'[kv]}: {n_bad} of positions {lo}..{hi} hold "
                    f"wrong KV (first {first}, block {table[first // self.cache_config.block_size]}, group {g})")))

    def _judge_wrong_reads(self, kvo: KVConnectorOutput | None) -> None:
        """This step's wrong reads: wrong KV, unless the request holds a block this step's output reports as
        a failed load (vLLM then discards the request's step: `Scheduler._update_requests_with_invalid_blocks`)."""
        reads, self._wrong_reads = self._wrong_reads, {}
        failed = set(kvo.invalid_block_ids or ()) if kvo is not None else set()
        for rid, found in reads.items():
            st = self.requests.get(rid)
            if failed and st is not None and any(failed.intersection(t) for t in st.tables):
                self.counts["discarded_wrong_reads"] += sum(n for n, _ in found)
                st.valid_upto = 0  # rolled back: what is kept is checked again
                continue
            for n_bad, msg in found:
                self.counts["wrong_kv"] += n_bad
                if len(self.messages) < MAX_MESSAGES:
                    self.messages.append(msg)

    def _note_connector_output(self, kvo: KVConnectorOutput | None) -> None:
        if kvo is None:
            return
        self.counts["finished_recving"] += len(kvo.finished_recving or ())
        self.counts["invalid_blocks"] += len(kvo.invalid_block_ids or ())


#: environment variable holding FaultyEmuWorker's plan (JSON)
FAULT_PLAN_ENV = "EMU_FAULT_PLAN"


class FaultyEmuWorker(EmuWorker):
    """EmuWorker whose connector reads and writes Mooncake through `testbed.faults.FaultyStore`: a
    FAULT-INJECTION TEST DOUBLE. Every call the plan does not fault goes to the real store.

    Plan (`EMU_FAULT_PLAN`, JSON; the engine's worker processes inherit the environment):

        {"seed": 0, "ranks": [0],            # tp ranks that inject (default: all)
         "rules": [{"op": "get", "action": "code", "code": -800, "calls": [0], "max_fires": 1}, ...]}

    Rule fields are `testbed.faults.FaultRule`'s (`calls` and `keys` as lists)."""

    def _connector_created(self, connector: Any) -> None:
        import json

        from testbed.faults import FaultPlan, FaultRule, FaultyStore
        text = os.environ.get(FAULT_PLAN_ENV)
        if not text:
            raise RuntimeError(f"FaultyEmuWorker: {FAULT_PLAN_ENV} is not set")
        plan = json.loads(text)
        if self.tp_rank not in plan.get("ranks", [self.tp_rank]):
            return
        rules = []
        for r in plan["rules"]:
            r = dict(r)
            for k in ("calls", "keys"):
                if r.get(k) is not None:
                    r[k] = frozenset(r[k])
            rules.append(FaultRule(**r))
        ws = connector.worker_side
        ws.io.store = FaultyStore(ws.io.store, FaultPlan(rules, seed=int(plan.get("seed", 0))))
        logger.warning("FaultyEmuWorker rank %d: fault injection on the connector's store: %s", self.tp_rank, rules)
