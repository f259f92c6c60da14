"""Keys: different models, shards, stages or layouts never collide; oversized keys are caught, not sent."""
from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

from kvledger_connector.connector import key_layout
from kvledger_connector.shape.engine_facts import model_identity
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout, KeyTooLongError
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.client import MooncakeStore
from testbed.kvcache import LAYOUTS, attention_specs, build_kv_cache_config
from testbed.harness import write_model_dir

ROOT = Path(__file__).resolve().parents[2]
BASE = KeyLayout(model="meta-llama/Llama-3.1-8B", tp_rank=0, tp_size=2, block_size=16, dtype="torch.bfloat16",
                 kv_layout="LBNHC", num_layers=32, num_kv_heads=4, head_size=128)
HASH = bytes.fromhex("00ff" * 16)


def variants() -> list[KeyLayout]:
    changes: list[dict[str, object]] = [
        {}, {"model": "meta-llama/Llama-3.1-8B-Instruct"}, {"model": "meta_llama/Llama-3.1-8B"},
        {"tp_rank": 1}, {"tp_size": 4}, {"tp_size": 4, "tp_rank": 1}, {"pp_size": 2}, {"pp_size": 2, "pp_rank": 1},
        {"block_size": 32}, {"dtype": "torch.float16"}, {"kv_layout": "LHBNC"}, {"num_layers": 31}, {"num_kv_heads": 8},
        {"head_size": 64}, {"extra": (("kv_cache_dtype", "fp8"),)},
    ]
    return [dataclasses.replace(BASE, **c) for c in changes]  # type: ignore[arg-type]


def test_every_difference_in_model_shard_or_layout_changes_the_key() -> None:
    keys = [KeyBuilder(layout).key(HASH) for layout in variants()]
    assert len(set(keys)) == len(keys)
    # "meta-llama" and "meta_llama" read the same after sanitising; the digest still separates them
    assert keys[1] != keys[2]


def test_same_layout_same_key_and_different_hashes_differ() -> None:
    kb = KeyBuilder(BASE)
    assert kb.key(HASH) == KeyBuilder(dataclasses.replace(BASE)).key(HASH)
    hashes: list[bytes | int | str] = [HASH, HASH[:-1] + b"\x00", 5, -5, "ab12"]
    assert len(set(kb.keys(hashes))) == len(hashes)
    assert kb.key(5) != kb.key(-5)
    assert kb.key(HASH).startswith(f"kvl2/meta-llama_Llama-3.1-8B/{BASE.digest()}/tp0of2-pp0of1/")


def _spec_extra(workdir: str, **spec: object) -> tuple[tuple[str, str], ...]:
    """`key_layout`'s spec extras for a tiny engine whose layers report `attention_specs(**spec)`."""
    model = write_model_dir(workdir, num_layers=2, num_kv_heads=2, head_size=8)
    vc = VllmConfig(model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True, dtype="float32",
                                             seed=0, max_model_len=256),
                    cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"))
    cfg = build_kv_cache_config(vc, attention_specs(2, block_size=16, num_kv_heads=2, head_size=8, **spec), 4,
                                "LBNHC")
    return key_layout(vc, cfg, 0).extra


def test_digest_changes_with_kv_layout_and_spec_extras(tmp_path: Path) -> None:
    """Engines that differ only in the physical layout, or only in the KV cache spec beyond the named
    fields (kind, content bytes, quantization, spec dtype), must not share keys."""
    assert len({dataclasses.replace(BASE, kv_layout=lay).digest() for lay in LAYOUTS}) == len(LAYOUTS)
    extras = [_spec_extra(str(tmp_path), **kw) for kw in ({}, {"mla": True}, {"dtype": torch.float16})]
    assert len({dataclasses.replace(BASE, extra=e).digest() for e in extras}) == len(extras)
    base = dataclasses.replace(BASE, extra=extras[0])
    assert {k for k, _ in base.extra} >= {"spec", "content_bytes", "kv_quant", "spec_dtype"}
    for i, (k, v) in enumerate(base.extra):
        changed = base.extra[:i] + ((k, v + "x"),) + base.extra[i + 1:]
        assert dataclasses.replace(base, extra=changed).digest() != base.digest(), k
    assert dataclasses.replace(base, extra=tuple(reversed(base.extra))).digest() == base.digest()  # a set
    # the shard and the stage are in the prefix, not the digest: every rank of one engine agrees on it
    assert dataclasses.replace(base, tp_rank=1, pp_size=2, pp_rank=1).digest() == base.digest()


def test_key_is_stable_across_processes() -> None:
    # keys must not depend on PYTHONHASHSEED: another process (another rank, a restart) must agree
    code = ("from kvledger_connector.shape.keys import KeyBuilder, KeyLayout;"
            "print(KeyBuilder(KeyLayout('m', 0, 1, 16, 'torch.float16', 'LBNHC', 2, 2, 8)).key(b'ab'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip().endswith("/tp0of1-pp0of1/6162")


@pytest.mark.parametrize("field, value", [
    ("model", ""), ("tp_rank", 2), ("tp_rank", -1), ("tp_size", 0), ("pp_rank", 1), ("pp_rank", -1),
    ("pp_size", 0), ("block_size", 0), ("num_layers", True), ("dtype", ""), ("kv_layout", 3),
])
def test_bad_layout_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"KeyLayout.{field}="):
        dataclasses.replace(BASE, **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [b"", "XYZ", 1.5, True])
def test_bad_block_hash(bad: object) -> None:
    with pytest.raises(ValueError, match="block hash"):
        KeyBuilder(BASE).key(bad)  # type: ignore[arg-type]


def test_oversized_keys_are_split_out_not_crashing() -> None:
    kb = KeyBuilder(dataclasses.replace(BASE, model="m" * 40), max_key_bytes=100)
    keys = kb.keys([b"\x01" * 4, b"\x02" * 40])  # the second hash makes a key over 100 bytes
    assert kb.split_by_length(keys) == ([0], [1])
    assert kb.check_key(keys[0]) == keys[0]
    with pytest.raises(KeyTooLongError, match="exceeds max_key_bytes=100"):
        kb.check_key(keys[1])


def test_layouts_never_collide_in_the_real_store(shared_store: MooncakeStore, key_prefix: str) -> None:
    """Two models, two shards, two stages and two KV cache layouts store the same block hash; each reads
    back its own bytes."""
    layouts = [dataclasses.replace(BASE, model=key_prefix + m, tp_rank=r, pp_size=2, pp_rank=p, kv_layout=lay)
               for m, r, p, lay in itertools.product(("model-a", "model-b"), (0, 1), (0, 1), ("LBNHC", "BHLNC"))]
    keys = [KeyBuilder(lo).key(HASH) for lo in layouts]
    src = torch.stack([torch.full((1024,), float(i)) for i in range(len(keys))])
    assert shared_store.batch_put(keys, [[src[i].data_ptr()] for i in range(len(keys))],
                                  [[src[i].nbytes] for i in range(len(keys))]) == [0] * len(keys)
    dst = torch.zeros_like(src)
    assert shared_store.batch_get(keys, [[dst[i].data_ptr()] for i in range(len(keys))],
                                  [[dst[i].nbytes] for i in range(len(keys))]) == [src[0].nbytes] * len(keys)
    assert torch.equal(dst, src)
    long_key = KeyBuilder(layouts[0]).key(b"\x07" * shared_store.max_key_bytes)
    assert shared_store.batch_get([long_key], [[dst[0].data_ptr()]], [[dst[0].nbytes]]) == [StoreCode.KEY_TOO_LONG]


def test_partial_tail_hash_names_parent_and_tokens_exactly():
    from kvledger_connector.shape.keys import partial_tail_hash

    parent = bytes(range(32))
    h = partial_tail_hash(parent, [5, 6, 7])
    assert len(h) == 32 and h != parent
    assert partial_tail_hash(parent, [5, 6, 7]) == h  # deterministic: another engine finds the same key
    others = {partial_tail_hash(parent, [5, 6]), partial_tail_hash(parent, [5, 6, 7, 0]),
              partial_tail_hash(parent, [5, 6, 8]), partial_tail_hash(bytes(32), [5, 6, 7])}
    assert h not in others and len(others) == 4  # length, content and prefix all change the key
    for bad in ([], [-1], [1 << 32]):
        with pytest.raises(ValueError, match="partial tail"):
            partial_tail_hash(parent, bad)



def _identity(model: str, weights_version: str = "", *, hash_algo: str = "sha256", **model_kw: object) -> KeyLayout:
    """BASE with the model identity of vLLM's ModelConfig built from `model_kw` (a ModelConfig alone: a
    VllmConfig would load the quantization method's kernels, which this CPU install lacks)."""
    mc = ModelConfig(**{"model": model, "tokenizer": model, "skip_tokenizer_init": True, "dtype": "float32",
                        "seed": 0, "max_model_len": 256, **model_kw})  # type: ignore[arg-type]
    return dataclasses.replace(BASE, model_hash=model_identity(mc, hash_algo, weights_version))


def test_model_identity_is_in_the_key(tmp_path: Path) -> None:
    """Same model path, different weights: another revision, quantization, dtype, hf_config override, block
    hash algorithm or weights version never shares a key; the same config (and a field vLLM does not hash,
    like the seed or the served name) does. And `key_layout` puts the identity in every rank's layout."""
    model = write_model_dir(str(tmp_path), num_layers=2, num_kv_heads=2, head_size=8)
    base = KeyBuilder(_identity(model)).key(HASH)
    same = [_identity(model), _identity(model, seed=7), _identity(model, served_model_name="x")]
    assert {KeyBuilder(lay).key(HASH) for lay in same} == {base}
    others = [_identity(model, revision="v2"), _identity(model, quantization="fp8"), _identity(model, dtype="bfloat16"),
              _identity(model, hf_overrides={"rms_norm_eps": 1e-3}), _identity(model, hash_algo="sha256_cbor"),
              _identity(model, "step-2"), _identity(model, "step-3"), BASE]
    keys = [KeyBuilder(lay).key(HASH) for lay in others]
    assert len(set(keys)) == len(keys) and base not in keys
    assert {k.split("/")[1] for k in keys} == {base.split("/")[1]}  # the readable part is the name alone

    vc = VllmConfig(model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True, dtype="float32",
                                             seed=0, max_model_len=256),
                    cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"))
    cfg = build_kv_cache_config(vc, attention_specs(2, block_size=16, num_kv_heads=2, head_size=8), 4, "LBNHC")
    layouts = [key_layout(vc, cfg, 0), key_layout(vc, cfg, 0, weights_version="step-2")]
    assert layouts[0].model_hash == model_identity(vc.model_config, vc.cache_config.prefix_caching_hash_algo)
    assert layouts[0].digest() != layouts[1].digest()
