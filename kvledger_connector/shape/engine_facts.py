"""Everything the connector derives from vLLM's objects, computed once per connector (`EngineFacts.of`).

The KV cache spec and the resolved layout (what a stored block's bytes are), this worker's ranks, the
engine's sizes (world size, nodes, block size, max_model_len, the GPU block pool, max_num_seqs), kv_role
and whether KV events are on. Whatever vLLM hands over that this connector cannot serve is refused here,
before anything is started or connected: sleep mode, KV cache groups of kinds or sizes it does not serve
(Mamba outside "align" mode, cross-attention, unequal blocks), a spec without per-layer pages, an
unresolved layout, a rank it would have to guess.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from kvledger_connector.config import BY_NAME, ConfigError
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.shape.group_kind import GroupKind, GroupKinds
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.shape.kvlayout import (LAYOUT_HNC_ORDER, BlockCopyPlan, KVLayoutError, plan_block_copies,
                                        plan_state_copies)
from kvledger_connector.ownfile import read_own_file

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

_EXTRA = "kv_connector_extra_config"


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group of a hybrid model (vLLM's hybrid KV cache manager): its layers share a block
    table; a block id is owned by one group at a time, and the groups' views share their allocations."""

    index: int  # in kv_cache_config.kv_cache_groups
    spec: Any  # FullAttentionSpec, SlidingWindowSpec or MambaSpec (align mode)
    layer_names: tuple[str, ...]
    # a sliding-window group's span of tokens vLLM keeps behind a position (its window plus any extra
    # retained tokens), in the key's layout; None: full attention or state
    window: int | None
    # a Mamba group in vLLM's "align" mode: block p of its table holds the whole recurrent state after
    # (p + 1) * block_size tokens (one page per layer), not KV of that block's tokens
    state: bool = False

    @property
    def kind(self) -> GroupKind:
        """The group's kind, whose rules the connector reads it by (kvledger_connector/shape/group_kind.py)."""
        if self.state:
            return GroupKind.MAMBA_STATE
        return GroupKind.SLIDING_WINDOW if self.window else GroupKind.FULL_ATTENTION  # as its key layout reads it


def _group_spec(layer_names: Sequence[str], spec: Any) -> Any:
    """The one spec of a group's layers, or the error naming them."""
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    if specs is not None:
        kinds = set(specs.values())
        if len(kinds) != 1:
            raise KVLayoutError(f"layers {sorted(specs)[:4]}...: {len(kinds)} different KV cache specs in "
                                f"one group; the connector serves one spec for all layers")
        spec = kinds.pop()
    if not (hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size") and spec.has_layer_views):
        raise KVLayoutError(f"layers {list(layer_names)[:4]}: {type(spec).__name__} has no per-layer "
                            f"[B, H, N, C] pages; the connector serves attention KV caches only")
    return spec


def _state_spec(what: str, spec: Any) -> Any:
    """A Mamba group's spec, served in vLLM's "align" mode only (a state per block boundary), or the error
    naming the group, the spec and why."""
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode != "align":
        raise KVLayoutError(f"{what}: mamba_cache_mode={mode!r}; a Mamba group is served in 'align' mode only "
                            f"(vLLM keeps a state per block boundary there; in {mode!r} a request's state is "
                            f"one running page a connector cannot key by prefix): enable prefix caching or set "
                            f"mamba_cache_mode='align'")
    if getattr(spec, "num_speculative_blocks", 0):
        raise KVLayoutError(f"{what}: num_speculative_blocks={spec.num_speculative_blocks}; Mamba state under "
                            f"speculative decoding is not served (its running state moves between blocks)")
    return spec


def _attention_window(what: str, spec: Any) -> int | None:
    """The window of an attention group's spec by vLLM's manager for it: None for full attention (every block
    of the table is the request's), the tokens kept behind a position for a sliding window (vLLM puts its
    null block where blocks left the window). One rule whether the group is alone or one of several; any
    other kind is refused, naming the group and the spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return None
    if type(spec) is SlidingWindowSpec:
        return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    raise KVLayoutError(f"{what}: KV cache groups are served when they are full attention (FullAttentionSpec, "
                        f"MLAAttentionSpec), sliding window (SlidingWindowSpec) or Mamba in 'align' mode; "
                        f"{type(spec).__name__} is not (its manager keeps blocks by a rule the store's keys do "
                        f"not follow)")


def kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> list[KVGroup]:
    """The KV cache groups this connector serves, each by the same rule whether it is alone or one of several
    (a hybrid model): full attention, sliding window, and Mamba in "align" mode beside an attention group,
    with equal block sizes and layer counts (vLLM pads every group's page to one size, so a block's bytes are
    then equal too). Anything else is refused at start-up, naming the group, its spec and why."""
    if kv_cache_config is None:
        raise KVLayoutError("kv_cache_config is None: vLLM 0.32 passes the engine's KVCacheConfig to every "
                            "connector; the connector needs its KV cache spec")
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise KVLayoutError("kv_cache_config has no KV cache groups: the connector needs an attention group")
    from vllm.v1.kv_cache_interface import MambaSpec
    out = []
    for i, g in enumerate(groups):
        what = f"KV cache group {i} ({type(g.kv_cache_spec).__name__}: {list(g.layer_names)[:2]}...)"
        if type(g.kv_cache_spec) is MambaSpec:
            out.append(KVGroup(i, _state_spec(what, g.kv_cache_spec), tuple(g.layer_names), None, state=True))
            continue
        try:
            spec = _group_spec(g.layer_names, g.kv_cache_spec)
        except KVLayoutError as e:
            raise KVLayoutError(f"KV cache group {i} of {len(groups)}: {e}") from None
        out.append(KVGroup(i, spec, tuple(g.layer_names), _attention_window(what, spec)))
    sizes = {(k.spec.block_size, len(k.layer_names)) for k in out}
    if len(sizes) != 1:
        raise KVLayoutError("KV cache groups of different block sizes or layer counts ("
                            + ", ".join(f"group {k.index}: block {k.spec.block_size}, {len(k.layer_names)} "
                                        f"layers" for k in out)
                            + "): every group's stored block must have the same size")
    if all(k.state for k in out):
        raise KVLayoutError("KV cache groups: Mamba state only; the connector serves hybrid models with at least "
                            "one attention group (a prefix's keys)")
    return out


def _first_attention(groups: Sequence[KVGroup]) -> int:
    """The index of the first attention group (`kv_cache_groups` refuses a model without one): the group a
    rank's KV heads and TP figures are about."""
    return next(i for i, g in enumerate(groups) if not g.state)


def kv_cache_spec(kv_cache_config: KVCacheConfig | None) -> Any:
    """The spec of the first attention KV cache group (`kv_cache_groups`, which refuses what is not served)."""
    groups = kv_cache_groups(kv_cache_config)
    return groups[_first_attention(groups)].spec


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The `KVCacheLayout` the engine resolved (EngineCore does it before any connector exists)."""
    name = vllm_config.cache_config.kv_cache_layout or getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        raise KVLayoutError("the KV cache layout is not resolved (cache_config.kv_cache_layout is None): "
                            "vLLM's EngineCore resolves it before creating connectors; a driver that builds "
                            "connectors itself must set it (see testbed.kvcache.build_kv_cache_config)")
    if name not in LAYOUT_HNC_ORDER:
        raise KVLayoutError(f"KV cache layout {name!r}: not one of {sorted(LAYOUT_HNC_ORDER)}",
                            "kv_cache_layout", name)
    return str(name)


def model_identity(model_config: ModelConfig, prefix_caching_hash_algo: str, weights_version: str = "") -> str:
    """What makes two engines' KV of one prompt differ besides the layout: vLLM's hash of the model config
    (it covers the weights' path, revision, quantization, dtype and the hf_config after overrides), the block
    hash algorithm, and the operator's `weights_version` (bumped when weights change in place). 32 hex chars;
    the scheduler and every worker compute it from their copy of the same config."""
    return key_identity(model_config.compute_hash(), str(prefix_caching_hash_algo), weights_version)


def key_identity(config_hash: str, hash_algo: str, weights_version: str, reset_epoch: str = "") -> str:
    """A key layout's `model_hash` (`model_identity`'s, under a version and reset epoch: a reset moves the keys
    by either, kvledger_connector/scheduler/reset.py). The epoch joins the hashed fields only when set: until
    the first reset the keys are those of every engine of this model and version."""
    fields = [config_hash, hash_algo, weights_version] + ([reset_epoch] if reset_epoch else [])
    canon = json.dumps(fields, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]


MAX_WEIGHTS_VERSION_FILE_BYTES = 256


def read_weights_version(path: str) -> str:
    """The weights version in `path` (`weights_version_file`): this user's regular file that no one else may
    write (whoever writes it chooses which stored KV this engine reads), holding a `weights_version` value
    (surrounding whitespace ignored). An empty file is refused: it is what a writer that truncates before
    writing leaves for an instant (write a new file and rename it over the old one)."""
    field_ = "weights_version_file"
    blob = read_own_file(field_, path, max_bytes=MAX_WEIGHTS_VERSION_FILE_BYTES, private=False)
    try:
        text = blob.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(field_, path, "holds bytes that are not ASCII", "file") from None
    if not text:
        raise ConfigError(field_, path, "is empty (write the version to a new file, then rename it over this one)",
                          "file")
    return str(BY_NAME["weights_version"].parse(field_, text, f"file {path}"))


def kv_replicas(vllm_config: VllmConfig) -> int:
    """How many consecutive TP ranks hold the same KV byte for byte: all of them for MLA (the latent is
    computed by replicated weights on every rank), ``tp / total KV heads`` when vLLM replicates KV heads
    (QKVParallelLinear gives rank r head ``r // replicas``), else 1. 1 too under decode or prefill context
    parallelism, which split a request's KV across ranks by token."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    if (getattr(pc, "decode_context_parallel_size", 1) or 1) > 1 or \
            (getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1:
        return 1
    if mc.use_mla:
        return tp
    total = mc.get_total_num_kv_heads()
    return tp // total if tp > total and tp % total == 0 else 1


def kv_head_shard(vllm_config: VllmConfig, heads_per_rank: int, tp_rank: int, kv_heads_per_key: int
                  ) -> tuple[int, int]:
    """The TP-shared layout's facts of one rank: (the model's KV heads, this rank's first), checked against
    `kv_heads_per_key` (it must divide the heads each rank holds, so every key is whole on one rank). MLA's
    latent counts as one head on every rank; with more TP ranks than KV heads vLLM gives rank r head
    ``r // (tp / heads)``. Refused under context parallelism, whose ranks split a block by token."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    tp, k = pc.tensor_parallel_size, kv_heads_per_key
    if (getattr(pc, "decode_context_parallel_size", 1) or 1) > 1 or \
            (getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1:
        raise ConfigError("kv_heads_per_key", k, "context parallelism splits a block's tokens across ranks: the "
                          "TP-shared layout is not served with it; set 0", _EXTRA)
    if mc.use_mla:
        total, first = 1, 0
    else:
        total = mc.get_total_num_kv_heads()
        first = tp_rank * heads_per_rank if tp <= total else tp_rank * total // tp
        if (tp <= total and heads_per_rank * tp != total) or (tp > total and heads_per_rank != 1):
            raise ConfigError("kv_heads_per_key", k, f"the KV cache spec's {heads_per_rank} heads per rank do not "
                              f"match the model's {total} KV heads at TP {tp}; set 0", _EXTRA)
    if heads_per_rank % k:
        raise ConfigError("kv_heads_per_key", k, f"must divide the {heads_per_rank} KV heads each rank holds "
                          f"(the model's {total} at TP {tp}): a key's heads must lie on one rank; 1 serves every "
                          f"TP size", _EXTRA)
    return total, first


def head_shard_views(kv_caches: Mapping[str, Any], kv_heads_per_key: int, part: int) -> dict[str, Any]:
    """The views of one key of the TP-shared layout: heads ``part * k .. (part + 1) * k`` of a rank's
    [B, H, N, C] views (k = `kv_heads_per_key`; 0: the views whole)."""
    k = kv_heads_per_key
    if not k:
        return dict(kv_caches)
    return {n: t[:, part * k:(part + 1) * k] for n, t in kv_caches.items()}


def _layout_of(vllm_config: VllmConfig, spec: Any, kv_layout: str, tp_rank: int, pp_rank: int,
               weights_version: str = "", replicated_once: bool = True, integrity_tag: str = "") -> KeyLayout:
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(spec.dtype)
    extra = (("spec", type(spec).__name__), ("content_bytes", str(spec.state_content_size_bytes)),
             ("head_size_v", str(spec.head_size_v)), ("kv_quant", str(getattr(spec, "kv_quant_mode", ""))),
             ("spec_dtype", str(spec.dtype)))
    return KeyLayout(model=str(mc.model), tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                     pp_rank=pp_rank, pp_size=pc.pipeline_parallel_size, block_size=cc.block_size, dtype=dtype,
                     kv_layout=kv_layout, num_layers=mc.get_total_num_hidden_layers(), num_kv_heads=spec.num_heads,
                     head_size=spec.head_size, extra=extra,
                     model_hash=model_identity(mc, cc.prefix_caching_hash_algo, weights_version),
                     kv_replicas=kv_replicas(vllm_config) if replicated_once else 1, integrity=integrity_tag)


def _state_layout_of(vllm_config: VllmConfig, spec: Any, kv_layout: str, tp_rank: int, pp_rank: int,
                     weights_version: str = "", replicated_once: bool = False, integrity_tag: str = ""
                     ) -> KeyLayout:
    """A Mamba group's key layout: what a state page's bytes depend on (its shapes, dtypes, mixer, page)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    extra = (("spec", type(spec).__name__), ("shapes", json.dumps([list(x) for x in spec.shapes])),
             ("dtypes", ",".join(str(d) for d in spec.dtypes)), ("mamba_type", str(spec.mamba_type)),
             ("content_bytes", str(spec.state_content_size_bytes)))
    return KeyLayout(model=str(mc.model), tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                     pp_rank=pp_rank, pp_size=pc.pipeline_parallel_size, block_size=cc.block_size,
                     dtype=",".join(str(d) for d in spec.dtypes), kv_layout=kv_layout,
                     num_layers=mc.get_total_num_hidden_layers(), num_kv_heads=1, head_size=spec.page_size_bytes,
                     extra=extra, model_hash=model_identity(mc, cc.prefix_caching_hash_algo, weights_version),
                     kv_replicas=1, integrity=integrity_tag)


def _group_layouts(vllm_config: VllmConfig, groups: Sequence[KVGroup], kv_layout: str, tp_rank: int,
                   pp_rank: int, weights_version: str = "", replicated_once: bool = True, integrity_tag: str = ""
                   ) -> list[KeyLayout]:
    """This rank's key layout per KV cache group, in the groups' order: each keyed by its layers, its window
    or state, unless its kinds' keys name no group (`GroupKinds.keys_name_groups`: one full-attention group)."""
    has_state = any(g.state for g in groups)
    # a Mamba state is a rank's shard of the mixer: keys per rank for every group (ranks sharing an
    # attention group's keys would need a put stripe per group)
    layouts = [(_state_layout_of if g.state else _layout_of)(
        vllm_config, g.spec, kv_layout, tp_rank, pp_rank, weights_version, replicated_once and not has_state,
        integrity_tag) for g in groups]
    named = [dataclasses.replace(lay, num_layers=len(g.layer_names), extra=lay.extra + (
        ("group", str(g.index)), ("window", str(g.window or 0)),
        ("layers", hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:16]))
        + ((("state", "align"),) if g.state else ()))
        for g, lay in zip(groups, layouts)]
    # a lone full-attention group's keys predate KV cache groups and name none: stored keys keep their bytes
    return named if GroupKinds(tuple(g.kind for g in groups)).keys_name_groups else layouts


def key_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, tp_rank: int,
               pp_rank: int = 0, weights_version: str = "", replicated_once: bool = True,
               integrity_tag: str = "") -> KeyLayout:
    """What a block's bytes depend on besides its tokens, for the first attention KV cache group
    (`EngineFacts.layout`): the resolved layout and the KV cache spec, from the configs alone (the scheduler
    has no tensors; the worker checks its tensors against it)."""
    groups = kv_cache_groups(kv_cache_config)
    layouts = _group_layouts(vllm_config, groups, resolved_layout(vllm_config, kv_cache_config), tp_rank, pp_rank,
                             weights_version, replicated_once, integrity_tag)
    return layouts[_first_attention(groups)]


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


def _rank(key: str, given: int | None, size: int, from_vllm: Callable[[], int | None]) -> int:
    """This worker's rank in a parallel group: vLLM's, or `given` (the extra config's, already an int in
    the key's bounds) for in-process drivers that build several ranks' connectors without a process group.
    With size > 1 and neither, refuse: falling back to 0 would make this worker write rank 0's keys."""
    rank = from_vllm()
    if given is not None:
        if not 0 <= given < size:
            raise ConfigError(key, given, f"must be an int in 0..{size - 1}", _EXTRA)
        if rank is not None and rank != given:
            raise ConfigError(key, given, f"differs from vLLM's rank {rank} in that group", _EXTRA)
        rank = given
    if rank is None:
        if size > 1:
            raise ConfigError(key, None, f"this worker cannot learn its rank from vLLM (no process group set up) "
                              f"and the group has {size} ranks; refusing to guess rank 0, whose keys it would "
                              f"share", _EXTRA)
        rank = 0
    return rank


@dataclass(frozen=True)
class EngineFacts:
    """What this connector knows of its engine; satisfies `config.EngineFigures`."""

    engine_id: str
    scheduler: bool  # the scheduler role (ranks 0); else a worker
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    world_size: int
    nnodes: int
    block_size: int
    max_model_len: int
    num_gpu_blocks: int | None  # the GPU block pool (None: not known yet)
    max_num_seqs: int
    save_enabled: bool  # kv_role kv_producer | kv_both
    load_enabled: bool  # kv_role kv_consumer | kv_both
    kv_load_failure_policy: str  # "fail" | "recompute": whether loads may be sync (scheduler_steps)
    kv_events: bool  # vLLM publishes KV cache events (--kv-events-config)
    layout: KeyLayout  # this rank's, of the first attention group
    spec: Any  # the first attention group's KV cache spec
    groups: tuple[KVGroup, ...]  # the KV cache groups (`kv_cache_groups`): one for most models
    group_layouts: tuple[KeyLayout, ...]  # this rank's key layout per group (`_group_layouts`), in order
    num_blocks: int  # blocks of the KV cache config
    model_config_hash: str = ""  # vLLM's ModelConfig.compute_hash(), for `layouts_for` a new weights version
    hash_algo: str = ""  # vLLM's prefix_caching_hash_algo
    weights_version: str = ""  # the one `layout` is keyed under (a worker's: until the first step's metadata)
    # the TP-shared layout: KV heads per key (0: a key per TP shard), the model's KV heads, this rank's first
    kv_heads_per_key: int = 0
    total_kv_heads: int = 0
    first_kv_head: int = 0
    device_type: str = ""  # vLLM's device_config.device_type ("cpu": the KV cache is host memory)

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, *, scheduler: bool,
           tp_rank: int | None = None, pp_rank: int | None = None, weights_version: str = "",
           replicated_once: bool = True, integrity_tag: str = "", kv_heads_per_key: int = 0) -> EngineFacts:
        """The facts, or the error naming what cannot be served. `tp_rank`/`pp_rank`: the extra config's
        (`config.Settings`), for drivers without a process group; the scheduler role is rank 0 of both.
        `kv_heads_per_key` > 0: the TP-shared layout (`kv_head_shard`)."""
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):  # 0.33 refuses it earlier, 0.32 never
            raise ConfigError("enable_sleep_mode", True, "KVLedgerConnector does not support sleep mode (the "
                              "store's buffer registrations would not follow the KV cache across sleep/wake); "
                              "turn sleep mode off", "model_config")
        pc, cc, kt = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.kv_transfer_config
        if kt is None:
            raise ConfigError("kv_transfer_config", None, "the connector needs vLLM's kv_transfer_config", "vllm")
        if scheduler:
            tp = pp = 0
        else:
            tp = _rank("tp_rank", tp_rank, pc.tensor_parallel_size, _vllm_tp_rank)
            pp = _rank("pp_rank", pp_rank, pc.pipeline_parallel_size, _vllm_pp_rank)
        groups = kv_cache_groups(kv_cache_config)  # refuses a missing kv_cache_config too
        kv_cfg = cast("KVCacheConfig", kv_cache_config)
        kv_layout = resolved_layout(vllm_config, kv_cfg)
        layouts = _group_layouts(vllm_config, groups, kv_layout, tp, pp, weights_version, replicated_once,
                                 integrity_tag)
        first = _first_attention(groups)
        spec, layout = groups[first].spec, layouts[first]
        total_heads = first_head = 0
        if kv_heads_per_key and any(g.state for g in groups):
            raise ConfigError("kv_heads_per_key", kv_heads_per_key, "a Mamba state group has no KV heads to key "
                              "by: the TP-shared layout is not served for a model with Mamba layers; set 0", _EXTRA)
        if kv_heads_per_key:
            if not replicated_once:
                raise ConfigError("store_replicated_kv_once", False, "with kv_heads_per_key a key names KV heads, "
                                  "never a rank: ranks holding the same heads share it; leave it true", _EXTRA)
            total_heads, first_head = kv_head_shard(vllm_config, spec.num_heads, tp, kv_heads_per_key)
            layouts = [dataclasses.replace(lay, heads=(first_head, total_heads)) for lay in layouts]
            layout = layouts[first]
        kvev = vllm_config.kv_events_config
        return cls(engine_id=str(kt.engine_id), scheduler=scheduler, tp_rank=tp, pp_rank=pp,
                   tp_size=pc.tensor_parallel_size, pp_size=pc.pipeline_parallel_size, world_size=pc.world_size,
                   nnodes=pc.nnodes, block_size=cc.block_size, max_model_len=vllm_config.model_config.max_model_len,
                   num_gpu_blocks=kv_cfg.num_blocks or cc.num_gpu_blocks,
                   max_num_seqs=vllm_config.scheduler_config.max_num_seqs, save_enabled=bool(kt.is_kv_producer),
                   load_enabled=bool(kt.is_kv_consumer), kv_load_failure_policy=str(kt.kv_load_failure_policy),
                   kv_events=kvev is not None and bool(kvev.enable_kv_cache_events), layout=layout, spec=spec,
                   groups=tuple(groups), group_layouts=tuple(layouts), num_blocks=kv_cfg.num_blocks,
                   model_config_hash=vllm_config.model_config.compute_hash(),
                   hash_algo=str(cc.prefix_caching_hash_algo), weights_version=weights_version,
                   kv_heads_per_key=kv_heads_per_key, total_kv_heads=total_heads, first_kv_head=first_head,
                   device_type=str(vllm_config.device_config.device_type))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_state_groups(self) -> int:
        """Mamba groups in vLLM's "align" mode among the KV cache groups."""
        return sum(g.state for g in self.groups)

    @property
    def key_parts(self) -> int:
        """Keys per block and KV cache group on this rank: its heads / `kv_heads_per_key` in the TP-shared
        layout, else 1."""
        return self.layout.num_kv_heads // self.kv_heads_per_key if self.kv_heads_per_key else 1

    def _parts(self, rank_layout: KeyLayout) -> list[KeyLayout]:
        """A rank layout's key layouts: itself, or in the TP-shared layout one per shard of its heads."""
        k = self.kv_heads_per_key
        if not k:
            return [rank_layout]
        first, total = rank_layout.heads
        return [dataclasses.replace(rank_layout, num_kv_heads=k, heads=(first + j * k, total))
                for j in range(rank_layout.num_kv_heads // k)]

    def _rank_layouts(self, weights_version: str | None, reset_epoch: str = "") -> list[KeyLayout]:
        if weights_version is None and not reset_epoch:
            return list(self.group_layouts)
        version = self.weights_version if weights_version is None else weights_version
        h = key_identity(self.model_config_hash, self.hash_algo, version, reset_epoch)
        return [dataclasses.replace(lay, model_hash=h) for lay in self.group_layouts]

    def layouts_for(self, weights_version: str | None = None, reset_epoch: str = "") -> list[KeyLayout]:
        """This rank's key layouts, a block's parts in order: per KV cache group (one for most models) its
        head shards (`key_parts`; one but in the TP-shared layout), under `weights_version` (default: the
        one the facts were built under) and `reset_epoch` (none before the first reset)."""
        return [part for lay in self._rank_layouts(weights_version, reset_epoch) for part in self._parts(lay)]

    def block_shape(self, weights_version: str | None = None, reset_epoch: str = "", *, max_key_bytes: int = 512,
                    namespace: str = "") -> BlockShape:
        """This rank's block (kvledger_connector/shape/block_shape.py): the parts of `layouts_for`, in order, each
        with its KV cache group, the group's kind and its key builder, under `weights_version` (default: the
        one the facts were built under) and `reset_epoch`."""
        return BlockShape.of_keys([KeyBuilder(lay, max_key_bytes, namespace)
                                   for lay in self.layouts_for(weights_version, reset_epoch)])

    def shard_layouts(self, weights_version: str | None = None, reset_epoch: str = "") -> list[KeyLayout]:
        """The key layout of every shard of every stage (the scheduler: a hit needs all of them); ranks
        sharing keys (`KeyLayout.kv_replicas`) are one shard; a hybrid model's groups each have theirs; in
        the TP-shared layout a shard is `kv_heads_per_key` of the model's KV heads, whatever the TP size.
        `weights_version`, `reset_epoch`: under that version and epoch instead."""
        bases = self._rank_layouts(weights_version, reset_epoch)
        if self.kv_heads_per_key:
            k, total = self.kv_heads_per_key, self.total_kv_heads
            return [dataclasses.replace(base, tp_rank=0, pp_rank=p, num_kv_heads=k, heads=(h, total))
                    for base in bases for p in range(self.pp_size) for h in range(0, total, k)]
        return [dataclasses.replace(base, tp_rank=t, pp_rank=p) for base in bases
                for p in range(self.pp_size) for t in range(0, self.tp_size, self.layout.kv_replicas)]

    def copy_plans(self, kv_caches: Mapping[str, torch.Tensor]) -> list[BlockCopyPlan]:
        """One copy plan per part of a block (`layouts_for`'s order), each over its own layers' views (a
        hybrid model's groups' views alias each other's allocations: a block id belongs to one group at a
        time) and, in the TP-shared layout, over its own heads of them."""
        plans = []
        for g, lay in zip(self.groups, self._rank_layouts(None)):
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise KVLayoutError(f"KV cache group {g.index}: no view for layers {missing[:4]}")
            views = {n: kv_caches[n] for n in g.layer_names}
            num_layers = len(g.layer_names)
            if g.state:
                plans.append(plan_state_copies(views, page_bytes=g.spec.page_size_bytes, num_blocks=self.num_blocks))
                continue
            if not self.kv_heads_per_key:
                plans.append(self._plan_of(views, lay, g.spec, num_layers))
                continue
            self._check_views(views, lay, g.spec)
            for j in range(self.key_parts):
                plans.append(self._plan_of(head_shard_views(views, self.kv_heads_per_key, j), lay, g.spec,
                                           num_layers, heads=self.kv_heads_per_key))
        return plans

    @staticmethod
    def _check_views(kv_caches: Mapping[str, torch.Tensor], lay: KeyLayout, spec: Any) -> None:
        for name, t in kv_caches.items():
            if isinstance(t, torch.Tensor) and t.dim() == 4 and (
                    t.shape[1] != spec.num_heads or t.shape[3] * t.element_size() != spec.state_content_size_bytes):
                raise KVLayoutError(
                    f"layer {name!r}: shape {tuple(t.shape)} of {t.dtype} (layout {lay.kv_layout}), the KV cache "
                    f"spec promises {spec.num_heads} head slots of {spec.state_content_size_bytes} content bytes")

    def _plan_of(self, kv_caches: Mapping[str, torch.Tensor], lay: KeyLayout, spec: Any,
                 num_layers: int, heads: int | None = None) -> BlockCopyPlan:
        if heads is None:  # (a head shard's views were checked whole, before they were sliced)
            self._check_views(kv_caches, lay, spec)
        plan = plan_block_copies(kv_caches, layout=lay.kv_layout, block_size=lay.block_size,
                                 num_blocks=self.num_blocks)
        if len(plan.layers) != num_layers:
            raise KVLayoutError(f"{len(plan.layers)} distinct KV cache views ({list(plan.layers)[:4]}...), the KV "
                                f"cache config has {num_layers} layers (layout {lay.kv_layout})")
        return plan
