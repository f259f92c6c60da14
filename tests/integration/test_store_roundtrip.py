"""MooncakeStore against a real mooncake_master on loopback: byte-exact zero-copy round trips of plain
byte buffers (the store sees bytes; KV caches and their copy plans are tested in test_kv_layouts.py), Mooncake's semantics the connector relies on (first writer wins, per-key codes), and the
wrapper's input checks (nothing bad reaches C++, every key gets a code)."""
from __future__ import annotations

import threading

import pytest
import torch

from kvledger_connector.config import StoreConfig
from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.store.listeners import free_port
from kvledger_connector.store.contract import StoreCode, StoreError
from kvledger_connector.store.client import MooncakeStore, StoreUnavailableError

BLOCK_ELEMS = 4096  # 16 KiB of float32 per segment


def two_buffers(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two payload buffers of n rows each (a key's object = two segments from two allocations, as a copy
    plan over two layers gives), deterministic content. Plain bytes, not a KV cache."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, BLOCK_ELEMS, generator=g), torch.randn(n, BLOCK_ELEMS, generator=g))


def chunks(k: torch.Tensor, v: torch.Tensor, i: int) -> tuple[list[int], list[int]]:
    """Key i's object = k[i] ++ v[i]: two segments from two buffers."""
    nb = k[i].nbytes
    return [k[i].data_ptr(), v[i].data_ptr()], [nb, nb]


def put_blocks(store: MooncakeStore, keys: list[str], k: torch.Tensor, v: torch.Tensor) -> list[int]:
    ptrs, sizes = zip(*(chunks(k, v, i) for i in range(len(keys))))
    return store.batch_put(keys, list(ptrs), list(sizes))


def get_blocks(store: MooncakeStore, keys: list[str], k: torch.Tensor, v: torch.Tensor) -> list[int]:
    ptrs, sizes = zip(*(chunks(k, v, i) for i in range(len(keys))))
    return store.batch_get(keys, list(ptrs), list(sizes))


def test_put_get_round_trip_is_byte_exact_with_torch_tensors(store: MooncakeStore, key_prefix: str) -> None:
    n = 32
    k, v = two_buffers(n, seed=1)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for t in (k, v, dk, dv):
        store.register_buffer(t.data_ptr(), t.nbytes)
    keys = [f"{key_prefix}b{i}" for i in range(n)]
    assert put_blocks(store, keys, k, v) == [0] * n
    assert store.batch_is_exist(keys) == [1] * n
    assert get_blocks(store, keys, dk, dv) == [2 * k[0].nbytes] * n
    assert torch.equal(dk, k) and torch.equal(dv, v)


def test_get_with_a_different_chunk_split_of_the_same_total(shared_store: MooncakeStore, key_prefix: str) -> None:
    k, v = two_buffers(1, seed=2)
    key = f"{key_prefix}split"
    assert put_blocks(shared_store, [key], k, v) == [0]
    dst = torch.zeros(2 * BLOCK_ELEMS)
    first = 100 * 4
    got = shared_store.batch_get([key], [[dst.data_ptr(), dst.data_ptr() + first]], [[first, dst.nbytes - first]])
    assert got == [dst.nbytes]
    assert torch.equal(dst, torch.cat([k[0], v[0]]))


def test_put_is_first_writer_wins(shared_store: MooncakeStore, key_prefix: str) -> None:
    a, _ = two_buffers(1, seed=3)
    b = a + 1.0
    key = f"{key_prefix}fww"
    ptr = lambda t: [[t.data_ptr()]]  # noqa: E731
    assert shared_store.batch_put([key], ptr(a), [[a.nbytes]]) == [0]
    assert shared_store.batch_put([key], ptr(b), [[b.nbytes]]) == [0]  # 0, but the old value stays
    dst = torch.zeros_like(a)
    assert shared_store.batch_get([key], ptr(dst), [[dst.nbytes]]) == [dst.nbytes]
    assert torch.equal(dst, a) and not torch.equal(dst, b)


def test_per_key_codes_missing_too_small_too_large(shared_store: MooncakeStore, key_prefix: str) -> None:
    k, v = two_buffers(3, seed=4)
    keys = [f"{key_prefix}ok", f"{key_prefix}small", f"{key_prefix}large"]
    assert put_blocks(shared_store, keys, k, v) == [0, 0, 0]
    size = 2 * k[0].nbytes
    dst = torch.zeros(8 * BLOCK_ELEMS)
    p = dst.data_ptr()
    res = shared_store.batch_get(keys[:1] + [f"{key_prefix}missing"] + keys[1:],
                                 [[p], [p + size], [p + 2 * size], [p + 3 * size]],
                                 [[size], [size], [size - 4], [size + 4]])
    assert res == [size, StoreCode.OBJECT_NOT_FOUND, StoreCode.INVALID_PARAMS, StoreCode.TRANSFER_FAIL]
    assert torch.equal(dst[: 2 * BLOCK_ELEMS], torch.cat([k[0], v[0]]))  # the good key still loaded
    assert shared_store.batch_is_exist([f"{key_prefix}missing"]) == [0]
    assert StoreCode.label(-704) == "OBJECT_NOT_FOUND(-704)" and StoreCode.label(-12345) == "UNKNOWN(-12345)"


def test_a_key_repeated_in_one_batch_does_not_fail_its_good_occurrence(
        shared_store: MooncakeStore, key_prefix: str) -> None:
    # Raw Mooncake answers -800 for *every* occurrence when one occurrence of a key fails; we split rounds.
    a, _ = two_buffers(1, seed=5)
    key = f"{key_prefix}dup"
    assert shared_store.batch_put([key], [[a.data_ptr()]], [[a.nbytes]]) == [0]
    d1, d2 = torch.zeros_like(a), torch.zeros_like(a)
    res = shared_store.batch_get([key, key], [[d1.data_ptr()], [d2.data_ptr()]], [[a.nbytes], [a.nbytes - 4]])
    assert res == [a.nbytes, StoreCode.INVALID_PARAMS]
    assert torch.equal(d1, a)


def test_bad_inputs_never_reach_mooncake(shared_store: MooncakeStore, key_prefix: str) -> None:
    a, _ = two_buffers(1, seed=6)
    good = f"{key_prefix}good"
    long_key = key_prefix + "x" * shared_store.max_key_bytes
    res = shared_store.batch_put([good, long_key, "", f"{key_prefix}null", f"{key_prefix}zero"],
                                 [[a.data_ptr()], [a.data_ptr()], [a.data_ptr()], [0], [a.data_ptr()]],
                                 [[a.nbytes], [a.nbytes], [a.nbytes], [a.nbytes], [0]])
    assert res == [0, StoreCode.KEY_TOO_LONG, StoreCode.INVALID_PARAMS, StoreCode.BAD_BUFFER, StoreCode.BAD_BUFFER]
    assert shared_store.batch_is_exist([good, f"{key_prefix}null", long_key]) == [1, 0, StoreCode.KEY_TOO_LONG]
    assert shared_store.batch_put([], [], []) == [] and shared_store.batch_get([], [], []) == []
    with pytest.raises(ValueError, match="keys=2 ptrs=1 sizes=2"):
        shared_store.batch_get([good, good], [[a.data_ptr()]], [[1], [1]])
    with pytest.raises(ValueError, match="2 buffer pointers but 1 sizes"):
        shared_store.batch_get([good], [[a.data_ptr(), a.data_ptr()]], [[a.nbytes]])
    with pytest.raises(StoreError, match="ptr=0"):
        shared_store.register_buffer(0, 10)
    with pytest.raises(StoreError, match="size=-1"):
        shared_store.register_buffer(a.data_ptr(), -1)


def test_remove_respects_the_lease_unless_forced(shared_store: MooncakeStore, key_prefix: str) -> None:
    a, _ = two_buffers(1, seed=7)
    key = f"{key_prefix}leased"
    assert shared_store.batch_put([key], [[a.data_ptr()]], [[a.nbytes]]) == [0]
    assert shared_store.batch_is_exist([key]) == [1]  # a lookup grants a lease (the load is coming)
    assert shared_store.remove(key) == StoreCode.OBJECT_HAS_LEASE
    assert shared_store.remove(key, force=True) == 0
    assert shared_store.batch_is_exist([key]) == [0]
    assert shared_store.remove(key, force=True) == StoreCode.OBJECT_NOT_FOUND


def test_two_threads_share_one_client(shared_store: MooncakeStore, key_prefix: str) -> None:
    """The connector's store and load threads use one client at once; both must see exact data."""
    n, rounds = 8, 10
    k, v = two_buffers(n, seed=8)
    errors: list[str] = []

    def worker(tag: str) -> None:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for r in range(rounds):
            keys = [f"{key_prefix}{tag}/{r}/{i}" for i in range(n)]
            if put_blocks(shared_store, keys, k, v) != [0] * n:
                errors.append(f"{tag} put round {r}")
            if get_blocks(shared_store, keys, dk, dv) != [2 * k[0].nbytes] * n or not torch.equal(dk, k):
                errors.append(f"{tag} get round {r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_connect_to_a_dead_master_fails_fast_naming_the_address(mooncake: EmbeddedMooncake) -> None:
    port = free_port()  # nothing listens there
    cfg = StoreConfig(global_segment_size=16 << 20).with_addresses(f"127.0.0.1:{port}", mooncake.metadata_server)
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}.*RPC_FAIL"):
        MooncakeStore.connect(cfg)
    with pytest.raises(StoreUnavailableError, match="embedded mode"):
        MooncakeStore.connect(StoreConfig())


def test_closed_store_answers_every_key_and_close_is_idempotent(store_config: StoreConfig) -> None:
    s = MooncakeStore.connect(store_config.replace(global_segment_size=0))
    assert s.healthy()
    s.close()
    s.close()
    assert not s.healthy()
    assert s.batch_is_exist(["a", "b"]) == [StoreCode.INVALID_PARAMS] * 2


def test_a_client_exception_becomes_a_code_per_key(shared_store: MooncakeStore, key_prefix: str) -> None:
    # a float pointer passes our range check but pybind11 rejects the call with TypeError
    res = shared_store.batch_get([f"{key_prefix}a", f"{key_prefix}b"], [[1.5], [2.5]], [[4], [4]])  # type: ignore[list-item]
    assert res == [StoreCode.CLIENT_EXCEPTION] * 2
    assert isinstance(shared_store.last_exception, TypeError)
    assert shared_store.healthy()  # a bad call does not mark the store unhealthy
