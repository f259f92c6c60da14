"""vLLM 0.32's KV caches, every `KVCacheLayout`: the stored object of a block is byte-exact, refusals name
what they refuse, and every layout round-trips through a real Mooncake master at TP 1 and TP 2.

Every KV cache here comes from vLLM's own allocator (testbed.kvcache); values are written through vLLM's
per-layer views only. The expected object of a block is computed from logical indices alone (layer,
head, token, content byte) and vLLM's `KVCacheLayout.layer_view_order`, never from the copy plan.
"""
from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, MambaSpec,
                                        SlidingWindowMLASpec, SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.connector import KVLedgerConnector, key_layout, kv_cache_spec, resolved_layout
from kvledger_connector.shape.engine_facts import kv_cache_groups
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.shape.kvlayout import BlockCopyPlan, KVLayoutError, plan_block_copies
from testbed.kvcache import (
    LAYOUTS,
    SPLITTABLE_LAYOUTS,
    allocate,
    attention_specs,
    build_kv_cache_config,
    layer_names,
)
from testbed.harness import Harness, _store_extra, shared_prefix_prompts, write_model_dir

_BLOCK_BITS = 5  # a byte's top 3 bits name its block (num_blocks <= 8), the low 5 bits its position


def _cpu_config(block_size: int) -> VllmConfig:
    """A fresh engine config per cache: build_kv_cache_config records the layout on its cache_config."""
    return VllmConfig(cache_config=CacheConfig(block_size=block_size), device_config=DeviceConfig("cpu"))


def _cache_config(*, layout: str, num_layers: int = 2, block_size: int = 16, heads: int = 2, head_size: int = 8,
                  dtype: torch.dtype = torch.float32, mla: bool = False, num_blocks: int = 4) -> KVCacheConfig:
    specs = attention_specs(num_layers, block_size=block_size, num_kv_heads=heads, head_size=head_size,
                            dtype=dtype, mla=mla)
    return build_kv_cache_config(_cpu_config(block_size), specs, num_blocks, layout)


def _mix(layer: torch.Tensor, h: torch.Tensor, tok: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The low 5 bits of a byte: a hash of its logical position (a misplaced run changes the bytes)."""
    x = layer * 1_000_003 + h * 10_007 + tok * 101 + c
    return ((x * 2_654_435_761) % (1 << 32) >> 7) & ((1 << _BLOCK_BITS) - 1)


def _write(caches: dict[str, torch.Tensor], names: list[str], block_size: int) -> None:
    """Byte (layer, kernel block kb, h, n, c) := block << 5 | mix(layer, h, token, c), through vLLM's views
    (as uint8): block = kb // ratio, token = (kb % ratio) * N + n."""
    for li, name in enumerate(names):
        u = caches[name].view(torch.uint8)
        B, H, N, C = u.shape
        ratio = block_size // N
        kb = torch.arange(B)[:, None, None, None]
        h = torch.arange(H)[None, :, None, None]
        n = torch.arange(N)[None, None, :, None]
        c = torch.arange(C)[None, None, None, :]
        vals = (kb // ratio) << _BLOCK_BITS | _mix(torch.tensor(li), h, (kb % ratio) * N + n, c)
        u[...] = vals.to(torch.uint8)


def _expected(block: int, *, layout: str, num_layers: int, heads: int, block_size: int, content_bytes: int) -> bytes:
    """The object of `block`, from logical indices: layers in natural order, then (H, N, C) in the
    physical order vLLM's KVCacheLayout gives a per-layer [B, H, N, C] view (B dropped)."""
    hnc = [d for d in KVCacheLayout[layout].layer_view_order if d != 0]  # 1=H, 2=N, 3=C
    sizes = {1: heads, 2: block_size, 3: content_bytes}
    out = []
    for li in range(num_layers):
        grids = torch.meshgrid(*(torch.arange(sizes[d]) for d in hnc), indexing="ij")
        by = dict(zip(hnc, grids))
        vals = block << _BLOCK_BITS | _mix(torch.tensor(li), by[1], by[2], by[3])
        out.append(bytes(vals.to(torch.uint8).flatten().tolist()))
    return b"".join(out)


def _read(plan: BlockCopyPlan, block: int) -> bytes:
    ptrs, sizes = plan.buffers(block)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


@st.composite
def _cache_cases(draw: st.DrawFn) -> dict:
    layout = draw(st.sampled_from(LAYOUTS))
    block_size = draw(st.sampled_from([4, 8, 16]))
    kernel = block_size
    if layout in SPLITTABLE_LAYOUTS:
        kernel = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if block_size % k == 0]))
    return dict(layout=layout, block_size=block_size, kernel=kernel,
                num_layers=draw(st.integers(1, 4)), heads=draw(st.integers(1, 4)),
                head_size=draw(st.sampled_from([4, 8, 16])),
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])),
                mla=draw(st.booleans()), num_blocks=draw(st.integers(2, 6)))


@settings(max_examples=40)
@given(case=_cache_cases())
def test_every_block_serializes_to_its_canonical_bytes(case: dict) -> None:
    lay, bs, kernel, L = case["layout"], case["block_size"], case["kernel"], case["num_layers"]
    cfg = _cache_config(layout=lay, num_layers=L, block_size=bs, heads=case["heads"], head_size=case["head_size"],
                        dtype=case["dtype"], mla=case["mla"], num_blocks=case["num_blocks"])
    caches = allocate(cfg, lay, kernel_block_sizes=[kernel] if kernel != bs else None)
    names = layer_names(L)
    _write(caches, names, bs)
    plan = plan_block_copies(caches, layout=lay, block_size=bs, num_blocks=case["num_blocks"])
    heads = 1 if case["mla"] else case["heads"]  # MLA: one latent per token
    content = case["head_size"] * (1 if case["mla"] else 2) * case["dtype"].itemsize  # full attention: K then V
    assert plan.layers == tuple(names) and plan.kernel_ratio == bs // kernel
    assert plan.block_bytes == L * heads * bs * content
    for m in range(case["num_blocks"]):
        got = _read(plan, m)
        assert len(got) == plan.block_bytes
        assert {b >> _BLOCK_BITS for b in got} == {m}, f"block {m} holds another block's bytes"
        assert got == _expected(m, layout=lay, num_layers=L, heads=heads, block_size=bs, content_bytes=content)


def test_layers_are_stored_in_natural_name_order() -> None:
    """layers.10 after layers.2 (a plain string sort would put it second), with the dict in reverse."""
    cfg = _cache_config(layout="LBNHC", num_layers=11, block_size=4, heads=1, head_size=4)
    caches = allocate(cfg, "LBNHC")
    names = layer_names(11)
    _write(caches, names, 4)
    plan = plan_block_copies(dict(reversed(list(caches.items()))), layout="LBNHC", block_size=4, num_blocks=4)
    assert plan.layers == tuple(names)
    assert _read(plan, 2) == _expected(2, layout="LBNHC", num_layers=11, heads=1, block_size=4, content_bytes=32)


@pytest.mark.parametrize("layout", SPLITTABLE_LAYOUTS)
@pytest.mark.parametrize("kernel", [1, 4, 8])
def test_kernel_split_serializes_like_unsplit(layout: str, kernel: int) -> None:
    cfg = _cache_config(layout=layout, heads=3, dtype=torch.bfloat16)
    split = allocate(cfg, layout, kernel_block_sizes=[kernel])
    whole = allocate(cfg, layout)
    assert split[layer_names(1)[0]].shape[2] == kernel  # the split really happened
    plans = []
    for caches in (split, whole):
        _write(caches, layer_names(2), 16)
        plans.append(plan_block_copies(caches, layout=layout, block_size=16, num_blocks=4))
    assert plans[0].kernel_ratio == 16 // kernel and plans[1].kernel_ratio == 1
    for m in range(4):
        assert _read(plans[0], m) == _read(plans[1], m)


# ------------------------------------------------------------------------------------------ refusals
def _two_layer_caches(layout: str = "LBNHC", **kw) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    cfg = _cache_config(layout=layout, **kw)
    return cfg, allocate(cfg, layout)


def test_state_list_value_is_refused_naming_the_layer() -> None:
    _, caches = _two_layer_caches()
    name = layer_names(2)[1]
    caches[name] = [caches[name], caches[name]]  # older vLLM's Mamba state: a list per layer
    with pytest.raises(KVLayoutError, match=rf"layer '{name}': a list, not a tensor \(layout LBNHC\)"):
        plan_block_copies(caches, layout="LBNHC", block_size=16)


def test_raw_buffer_value_is_refused_naming_the_layer() -> None:
    _, caches = _two_layer_caches()
    name = layer_names(2)[0]
    caches[name] = torch.zeros(1024, dtype=torch.int8)  # what allocate_kv_cache gives a spec without views
    with pytest.raises(KVLayoutError, match=rf"layer '{name}': a 1-D tensor .*\(layout LBNHC\)"):
        plan_block_copies(caches, layout="LBNHC", block_size=16)


def test_mamba_spec_from_vllm_is_refused() -> None:
    specs = {"model.layers.0.mixer": MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))}
    cfg = build_kv_cache_config(_cpu_config(16), specs, 4, "LBNHC")
    with pytest.raises(KVLayoutError, match=r"KV cache group 0 \(MambaSpec: \['model.layers.0.mixer'\].*"
                                            r"mamba_cache_mode='none'.*'align' mode only"):
        kv_cache_spec(cfg)
    with pytest.raises(KVLayoutError, match=r"layer 'model.layers.0.mixer'.*layout LBNHC"):
        plan_block_copies(allocate(cfg, "LBNHC"), layout="LBNHC", block_size=16)


def test_two_views_over_the_same_bytes_are_refused() -> None:
    _, caches = _two_layer_caches()
    a, b = layer_names(2)
    t = caches[a]
    # FAULT INJECTION: a second view of layer a's bytes, one token later (no allocator produces this)
    caches[b] = torch.as_strided(t, t.shape, t.stride(), t.storage_offset() + t.stride(2))
    with pytest.raises(KVLayoutError, match=r"layers .* alias the same bytes .*layout LBNHC"):
        plan_block_copies(caches, layout="LBNHC", block_size=16)


def test_block_count_mismatch_is_refused() -> None:
    cfg, caches = _two_layer_caches(num_blocks=4)
    with pytest.raises(KVLayoutError, match=r"the views hold 4 blocks, the KV cache config 5 \(layout LBNHC\)"):
        plan_block_copies(caches, layout="LBNHC", block_size=16, num_blocks=5)
    _, other = _two_layer_caches(num_blocks=6)
    a, b = layer_names(2)
    with pytest.raises(KVLayoutError, match=rf"layer '{b}': 6 blocks, layer '{a}' has 4 \(layout LBNHC\)"):
        plan_block_copies({a: caches[a], b: other[b]}, layout="LBNHC", block_size=16)


def test_segment_cap_is_enforced_exactly() -> None:
    """LHBNC puts heads outside blocks: one layer of 2 heads is 2 segments per block."""
    _, caches = _two_layer_caches("LHBNC", num_layers=1, heads=2)
    assert len(plan_block_copies(caches, layout="LHBNC", block_size=16, max_segments=2).segments) == 2
    with pytest.raises(KVLayoutError, match=r"2 segments over 1 layers \(layout LHBNC\); more than max_segments=1"):
        plan_block_copies(caches, layout="LHBNC", block_size=16, max_segments=1)


def test_unknown_layout_name_is_refused() -> None:
    cfg, caches = _two_layer_caches()
    with pytest.raises(KVLayoutError, match=r"KV cache layout 'NHD': not one of"):
        plan_block_copies(caches, layout="NHD", block_size=16)
    vc = _cpu_config(16)
    cfg.kv_cache_layout = "HND"  # the pre-0.32 name, as a stale config would carry it
    with pytest.raises(KVLayoutError, match=r"KV cache layout 'HND': not one of"):
        resolved_layout(vc, cfg)
    cfg.kv_cache_layout = None
    with pytest.raises(KVLayoutError, match=r"not resolved"):
        resolved_layout(vc, cfg)


def test_a_hybrid_models_groups_are_served_per_group_and_other_kinds_refused() -> None:
    vc = _cpu_config(16)
    # vLLM disables the hybrid manager on CPU; a GPU engine with a connector that supports it keeps it
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    specs = {"model.layers.0.attn": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32),
             "model.layers.1.attn": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                                                      dtype=torch.float32, sliding_window=32)}
    cfg = build_kv_cache_config(vc, specs, 4, "LBNHC")
    assert len(cfg.kv_cache_groups) == 2  # vLLM's own grouping, not a hand-built config
    assert type(kv_cache_spec(cfg)) is FullAttentionSpec  # the first attention group's
    groups = kv_cache_groups(cfg)
    assert {(g.layer_names, g.window) for g in groups} == {(("model.layers.0.attn",), None),
                                                           (("model.layers.1.attn",), 32)}
    # Mamba is served in vLLM's "align" mode only (tests/integration/test_mamba_hybrid.py); "none" is refused
    specs["model.layers.2.mixer"] = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(KVLayoutError, match=r"KV cache group \d \(MambaSpec: \['model.layers.2.mixer'\].*"
                                            r"mamba_cache_mode='none'.*'align' mode only"):
        kv_cache_groups(build_kv_cache_config(vc, specs, 4, "LBNHC"))


def _one_group(spec: object) -> KVCacheConfig:
    vc = _cpu_config(16)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # vLLM keeps a group's own kind then
    cfg = build_kv_cache_config(vc, {n: spec for n in layer_names(2)}, 4, "LBNHC")  # type: ignore[misc]
    assert len(cfg.kv_cache_groups) == 1 and type(cfg.kv_cache_groups[0].kv_cache_spec) is type(spec)
    return cfg


def test_one_group_is_served_by_the_rule_of_its_kind_and_other_kinds_are_refused_by_name() -> None:
    """A single KV cache group follows the same rule as a hybrid model's group: a sliding-window group alone
    (Mistral-like: every layer the same window) keeps its window; a kind whose manager keeps blocks by
    another rule is refused at start-up, naming the spec, whether alone or not."""
    kw = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    (g,) = kv_cache_groups(_one_group(SlidingWindowSpec(**kw, sliding_window=64)))  # type: ignore[arg-type]
    assert g.window == 64 and not g.state
    (g,) = kv_cache_groups(_one_group(FullAttentionSpec(**kw)))  # type: ignore[arg-type]
    assert g.window is None
    for spec in (ChunkedLocalAttentionSpec(**kw, attention_chunk_size=64),  # type: ignore[arg-type]
                 SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                      sliding_window=64)):
        name = type(spec).__name__
        with pytest.raises(KVLayoutError, match=rf"KV cache group 0 \({name}: .*{name} is not"):
            kv_cache_groups(_one_group(spec))


def test_aliased_views_are_stored_once() -> None:
    """vLLM hands KV-sharing layers their target's view under their own name: one object part, not two."""
    _, caches = _two_layer_caches()
    a, b = layer_names(2)
    shared = "model.layers.2.self_attn.attn"
    plan2 = plan_block_copies(caches, layout="LBNHC", block_size=16)
    plan3 = plan_block_copies({**caches, shared: caches[a]}, layout="LBNHC", block_size=16)
    assert plan3.layers == (a, b) and plan3.segments == plan2.segments
    assert len(plan3.storages) == 1  # one backing allocation, registered once


# ------------------------------------------------------------------------------- connector set-up
def _engine(workdir: str, *, layout: str = "LBNHC", tp: int = 1, pp: int = 1,
            extra: dict | None = None) -> tuple[VllmConfig, KVCacheConfig]:
    """An engine config as the harness builds it (tiny Llama config, no weights) and its KV cache config."""
    model = write_model_dir(workdir, num_layers=2, num_kv_heads=2 * tp, head_size=8)
    mc = ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True, dtype="float32", seed=0,
                     max_model_len=256)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                    scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False),
                    parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                    kv_transfer_config=KVTransferConfig(kv_connector="KVLedgerConnector",
                                                        kv_connector_module_path="kvledger_connector.connector",
                                                        kv_role="kv_both", kv_connector_extra_config=extra or {}),
                    device_config=DeviceConfig("cpu"))
    specs = attention_specs(2, block_size=16, num_kv_heads=2, head_size=8)
    return vc, build_kv_cache_config(vc, specs, 8, layout)


def test_worker_registers_aliased_views_and_refuses_a_spec_mismatch(store_config: StoreConfig, tmp_path) -> None:
    vc, cfg = _engine(str(tmp_path), extra=_store_extra(store_config))
    w = KVLedgerConnector(vc, KVConnectorRole.WORKER, cfg)
    try:
        a, b = layer_names(2)
        wrong = allocate(_cache_config(layout="LBNHC", heads=3, num_blocks=8), "LBNHC")
        with pytest.raises(KVLayoutError, match=rf"layer '{a}': shape \(8, 3, 16, 16\).*promises 2 head slots"):
            w.register_kv_caches(wrong)
        caches = allocate(cfg, "LBNHC")
        w.register_kv_caches({**caches, "model.layers.2.self_attn.attn": caches[b]})
        assert w.worker_side._plans[0].layers == (a, b)
    finally:
        w.shutdown()


def test_pipeline_stage_is_in_the_key(tmp_path) -> None:
    vc, cfg = _engine(str(tmp_path), pp=2)
    stages = [key_layout(vc, cfg, tp_rank=0, pp_rank=p) for p in (0, 1)]
    assert [s.pp_size for s in stages] == [2, 2] and stages[0].digest() == stages[1].digest()
    prefixes = [KeyBuilder(s).prefix for s in stages]
    assert prefixes[0] != prefixes[1] and prefixes[0].endswith("/tp0of1-pp0of2/")
    assert prefixes[1].endswith("/tp0of1-pp1of2/")


@pytest.mark.parametrize("tp, pp, key", [(2, 1, "tp_rank"), (1, 2, "pp_rank")])
def test_worker_without_a_rank_refuses_to_guess(tmp_path, tp: int, pp: int, key: str) -> None:
    """No vLLM process group and no extra key: rank 0 would be a guess that shares rank 0's keys."""
    vc, cfg = _engine(str(tmp_path), tp=tp, pp=pp)
    with pytest.raises(ConfigError, match=rf"{key}=None: this worker cannot learn its rank") as e:
        KVLedgerConnector(vc, KVConnectorRole.WORKER, cfg)
    assert e.value.field == key


# --------------------------------------------------------------------------- through the real store
def _pass(h: Harness, prompts: list[list[int]], max_tokens: int = 4) -> None:
    for i, p in enumerate(prompts):
        h.add_request(f"req-{i}", p, max_tokens)
    h.run()
    for i, p in enumerate(prompts):
        assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, max_tokens), f"req-{i}"


def _check_clean(h: Harness) -> None:
    assert h.garbage == []
    assert h.check_at_rest() == []
    checked, polluted = h.check_store()
    assert checked > 0 and polluted == 0
    for w in h.workers:
        assert w.worker_side.steps.stats.total("load_errors_reported") == 0 and w.worker_side.steps.errors == []  # type: ignore


def _loads_from_store(h: Harness, prompts: list[list[int]]) -> None:
    """Pass 1 saves; with vLLM's prefix cache emptied, pass 2's hits can only be store loads."""
    ss = h.scheduler_connector.scheduler_side.steps
    _pass(h, prompts)
    assert ss.ledger.num_jobs_opened > 0  # type: ignore[union-attr]
    assert h.check_at_rest() == []
    assert h.scheduler.reset_prefix_cache()
    loads = ss.stats.total("loads_emitted")  # type: ignore[union-attr]
    _pass(h, prompts)
    assert ss.stats.total("loads_emitted") > loads  # type: ignore[union-attr]
    assert all(w.worker_side.steps.stats.total("loads") > 0 for w in h.workers)  # type: ignore[union-attr]
    _check_clean(h)


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_through_the_store(store_config: StoreConfig, layout: str, tp_size: int) -> None:
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=40, suffix_len=8, seed=tp_size)
    with Harness(store_config, tp_size=tp_size, num_blocks=12, kv_layout=layout) as h:
        assert h.key_builders[0].layout.kv_layout == layout
        _loads_from_store(h, prompts)


def test_kernel_split_engine_round_trips_through_the_store(store_config: StoreConfig) -> None:
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=40, suffix_len=8, seed=3)
    with Harness(store_config, num_blocks=12, kv_layout="LBHNC", kernel_block_size=8) as h:
        assert h.kv_caches[0][h.layer_names[0]].shape[2] == 8  # the attention views really are split
        _loads_from_store(h, prompts)


def test_kernel_block_size_shares_keys_and_layouts_never_collide(store_config: StoreConfig, tmp_path) -> None:
    """Three engines of one model on one store: a (LBHNC, kernel block 16) saves; b (LBHNC, kernel block 8)
    shares a's keys and loads a's objects byte-exact; c (LBNHC) has its own keys and loads nothing."""
    prompts = shared_prefix_prompts(2, num_prefixes=2, prefix_len=40, suffix_len=8, seed=11)
    wd = str(tmp_path)  # one model path: the keys differ only by what the layouts make them differ by
    with Harness(store_config, num_blocks=12, kv_layout="LBHNC", workdir=wd) as a, \
            Harness(store_config, num_blocks=12, kv_layout="LBHNC", kernel_block_size=8, workdir=wd) as b, \
            Harness(store_config, num_blocks=12, kv_layout="LBNHC", workdir=wd) as c:
        ka, kb, kc = (h.key_builders[0] for h in (a, b, c))
        assert ka.prefix == kb.prefix and kc.prefix != ka.prefix
        _pass(a, prompts)
        _check_clean(a)
        _pass(b, prompts)
        assert b.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0  # type: ignore[union-attr]
        _check_clean(b)  # b's views read a's objects: S7 before every compute, check_store per token
        _pass(c, prompts)
        assert c.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") == 0  # type: ignore[union-attr]
        _check_clean(c)
