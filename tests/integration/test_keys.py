"""Keys: different models, shards or layouts never collide; oversized keys are caught, not sent."""
from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from connector.keys import KeyBuilder, KeyLayout, KeyTooLongError
from connector.store import MooncakeStore, StoreCode

ROOT = Path(__file__).resolve().parents[2]
BASE = KeyLayout(model="meta-llama/Llama-3.1-8B", tp_rank=0, tp_size=2, block_size=16, dtype="torch.bfloat16",
                 kv_layout="NHD", num_layers=32, num_kv_heads=4, head_size=128)
HASH = bytes.fromhex("00ff" * 16)


def variants() -> list[KeyLayout]:
    changes: list[dict[str, object]] = [
        {}, {"model": "meta-llama/Llama-3.1-8B-Instruct"}, {"model": "meta_llama/Llama-3.1-8B"},
        {"tp_rank": 1}, {"tp_size": 4}, {"tp_size": 4, "tp_rank": 1}, {"block_size": 32},
        {"dtype": "torch.float16"}, {"kv_layout": "HND"}, {"num_layers": 31}, {"num_kv_heads": 8},
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
    assert kb.key(HASH).startswith("kvl1/meta-llama_Llama-3.1-8B/") and "/tp0of2/" in kb.key(HASH)


def test_key_is_stable_across_processes() -> None:
    # keys must not depend on PYTHONHASHSEED: another process (another rank, a restart) must agree
    code = ("from connector.keys import KeyBuilder, KeyLayout;"
            "print(KeyBuilder(KeyLayout('m', 0, 1, 16, 'torch.float16', 'NHD', 2, 2, 8)).key(b'ab'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip().endswith("/tp0of1/6162")


@pytest.mark.parametrize("field, value", [
    ("model", ""), ("tp_rank", 2), ("tp_rank", -1), ("tp_size", 0), ("block_size", 0), ("num_layers", True),
    ("dtype", ""), ("kv_layout", 3),
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
    """Two models and two shards store the same block hash; each reads back its own bytes."""
    layouts = [dataclasses.replace(BASE, model=key_prefix + m, tp_rank=r) for m, r in
               itertools.product(("model-a", "model-b"), (0, 1))]
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
