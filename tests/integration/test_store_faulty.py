"""FaultyStore (the fault-injection test double) over the real store: injected codes store/load nothing,
evictions are real removals, raises happen before anything is sent, and a plan is deterministic."""
from __future__ import annotations

import pytest
import torch

from testbed.faults import FaultPlan, FaultRule, FaultyStore, InjectedFault
from kvledger_connector.store.contract import KVStore, StoreCode
from kvledger_connector.store.client import MooncakeStore


def blocks(n: int) -> torch.Tensor:
    return torch.stack([torch.full((512,), float(i + 1)) for i in range(n)])


def ptrs(t: torch.Tensor) -> list[list[int]]:
    return [[t[i].data_ptr()] for i in range(t.shape[0])]


def sizes(t: torch.Tensor) -> list[list[int]]:
    return [[t[i].nbytes] for i in range(t.shape[0])]


def test_faulty_store_is_a_kvstore(shared_store: MooncakeStore) -> None:
    assert isinstance(shared_store, KVStore) and isinstance(FaultyStore(shared_store), KVStore)


def test_injected_put_code_stores_nothing_for_that_key(shared_store: MooncakeStore, key_prefix: str) -> None:
    keys = [f"{key_prefix}{i}" for i in range(3)]
    fs = FaultyStore(shared_store, FaultPlan([FaultRule("put", "code", code=StoreCode.NO_AVAILABLE_HANDLE,
                                                        keys=frozenset({keys[1]}))]))
    src = blocks(3)
    assert fs.batch_put(keys, ptrs(src), sizes(src)) == [0, StoreCode.NO_AVAILABLE_HANDLE, 0]
    assert shared_store.batch_is_exist(keys) == [1, 0, 1]  # the real store never got key 1
    assert [(e.op, e.action, e.key) for e in fs.injected] == [("put", "code", keys[1])]


def test_evict_between_lookup_and_load_is_a_real_removal(shared_store: MooncakeStore, key_prefix: str) -> None:
    keys = [f"{key_prefix}{i}" for i in range(4)]
    src = blocks(4)
    assert shared_store.batch_put(keys, ptrs(src), sizes(src)) == [0] * 4
    fs = FaultyStore(shared_store, FaultPlan([FaultRule("get", "evict", key_contains=keys[2])]))
    assert fs.batch_is_exist(keys) == [1] * 4  # the lookup still sees it
    dst = torch.zeros_like(src)
    res = fs.batch_get(keys, ptrs(dst), sizes(dst))
    assert res == [src[0].nbytes, src[0].nbytes, StoreCode.OBJECT_NOT_FOUND, src[0].nbytes]
    assert torch.count_nonzero(dst[2]) == 0 and torch.equal(dst[[0, 1, 3]], src[[0, 1, 3]])
    assert shared_store.batch_is_exist([keys[2]]) == [0]  # gone for everybody, not just for this wrapper


def test_raise_happens_before_anything_is_sent(shared_store: MooncakeStore, key_prefix: str) -> None:
    fs = FaultyStore(shared_store, FaultPlan([FaultRule("put", "raise", calls=frozenset({1}))]))
    src = blocks(1)
    assert fs.batch_put([f"{key_prefix}a"], ptrs(src), sizes(src)) == [0]  # call 0 passes
    with pytest.raises(InjectedFault, match="put call 1"):
        fs.batch_put([f"{key_prefix}b"], ptrs(src), sizes(src))
    assert shared_store.batch_is_exist([f"{key_prefix}a", f"{key_prefix}b"]) == [1, 0]
    assert fs.batch_put([f"{key_prefix}c"], ptrs(src), sizes(src)) == [0]  # call 2 passes again


def test_same_seed_same_faults_and_max_fires_bounds_them(shared_store: MooncakeStore, key_prefix: str) -> None:
    src = blocks(16)
    keys = [f"{key_prefix}{i}" for i in range(16)]

    def run(seed: int) -> tuple[list[int], list[str | None]]:
        fs = FaultyStore(shared_store, FaultPlan([FaultRule("exist", "code", code=-800, probability=0.5,
                                                            max_fires=5)], seed=seed))
        return fs.batch_is_exist(keys), [e.key for e in fs.injected]

    assert shared_store.batch_put(keys, ptrs(src), sizes(src)) == [0] * 16
    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c
    assert len(a[1]) == 5 and a[0].count(-800) == 5 and a[0].count(1) == 11


@pytest.mark.parametrize("kwargs, fragment", [
    ({"op": "delete", "action": "code"}, "FaultRule.op='delete'"),
    ({"op": "get", "action": "explode"}, "FaultRule.action='explode'"),
    ({"op": "get", "action": "code", "code": 5}, "FaultRule.code=5"),
    ({"op": "put", "action": "evict"}, "not 'put'"),
    ({"op": "get", "action": "code", "probability": 2.0}, "FaultRule.probability=2.0"),
])
def test_bad_rules_name_the_field(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        FaultRule(**kwargs)  # type: ignore[arg-type]


def test_length_mismatch_is_rejected_before_any_fault(shared_store: MooncakeStore) -> None:
    fs = FaultyStore(shared_store, FaultPlan([FaultRule("get", "raise")]))
    with pytest.raises(ValueError, match="keys=2 vs 1"):
        fs.batch_get(["a", "b"], [[1]], [[1], [1]])
    assert list(fs.injected) == [] and fs.injected_total == 0


def test_injection_log_is_bounded(shared_store: MooncakeStore) -> None:
    fs = FaultyStore(shared_store, FaultPlan([FaultRule("exist", "code", code=-800)], log_limit=4))
    keys = [f"k{i}" for i in range(10)]
    assert fs.batch_is_exist(keys) == [-800] * 10  # injected codes: nothing reaches the store
    assert len(fs.injected) == 4 and fs.injected_total == 10
    assert [e.key for e in fs.injected] == keys[-4:]  # the newest are kept
    with pytest.raises(ValueError, match="FaultPlan.log_limit=0"):
        FaultPlan(log_limit=0)
