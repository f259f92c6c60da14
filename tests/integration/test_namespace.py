"""Tenants sharing one store: engines with different namespaces (upstream's ``cache_prefix``) never share a
key. Three engines of the same model, one after another, on the session's real master: tenant-a saves,
tenant-b then finds none of it (and saves its own), and a second tenant-a engine loads what the first
saved (the control: without it, "no hits" could mean the workload never hits)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvledger_connector.config import StoreConfig
from kvledger_connector.keys import KeyBuilder, KeyLayout
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 8


def test_two_namespaces_never_share_keys_on_one_store(store_config: StoreConfig, tmp_path: Path):
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=8, seed=11)
    work = str(tmp_path / "model")  # one model directory: the engines differ in their namespace only

    # tenant-a's engine stays up throughout: the objects live in its workers' segments of the pool
    with Harness(store_config, workdir=work, extra={"namespace": "tenant-a"}) as a:
        a.run_pass(prompts, MAX_TOKENS)
        assert a.scheduler_connector.scheduler_side.ledger.num_jobs_opened > 0
        a_keys = a.key_builders[0].keys(a.block_hashes_of(prompts[0]))
        assert all(k.startswith("tenant-a/kvl2/") for k in a_keys)
        assert a.workers[0].store.batch_is_exist(a_keys) == [1] * len(a_keys)  # tenant-a's blocks are stored

        with Harness(store_config, workdir=work, extra={"cache_prefix": "tenant-b"}) as b:
            b_keys = b.key_builders[0].keys(b.block_hashes_of(prompts[0]))
            assert [k.split("/", 1)[1] for k in b_keys] == [k.split("/", 1)[1] for k in a_keys]  # same blocks
            assert not set(b_keys) & set(a_keys)  # ...under other keys
            assert b.workers[0].store.batch_is_exist(b_keys) == [0] * len(b_keys)
            b.run_pass(prompts, MAX_TOKENS)
            ss = b.scheduler_connector.scheduler_side
            assert ss.num_loads == 0  # nothing of tenant-a's is visible to tenant-b
            assert b.scheduler_connector.stats.totals.data.get("lookup_hit_tokens", 0) == 0
            assert b.scheduler_connector.stats.totals.data.get("lookups", 0) > 0  # it did look
            assert b.workers[0].store.batch_is_exist(b_keys) == [1] * len(b_keys)  # and saved its own

        with Harness(store_config, workdir=work, extra={"namespace": "tenant-a"}) as a2:
            a2.run_pass(prompts, MAX_TOKENS)
            assert a2.scheduler_connector.scheduler_side.num_loads > 0  # the control: same namespace, hits


@pytest.mark.parametrize("ns1, ns2", [("a", "b"), ("", "kvl2"), ("kvl2", "x"), ("a.b", "a_b")])
def test_namespaced_keys_are_disjoint_by_construction(ns1: str, ns2: str):
    """Also for a namespace that looks like the key version, or a model name that looks like a namespace."""
    lay = KeyLayout(model="kvl2", tp_rank=0, tp_size=1, block_size=16, dtype="torch.float32", kv_layout="LBNHC",
                    num_layers=2, num_kv_heads=2, head_size=8)
    hashes = [bytes([i]) * 32 for i in range(8)]
    k1, k2 = KeyBuilder(lay, namespace=ns1).keys(hashes), KeyBuilder(lay, namespace=ns2).keys(hashes)
    assert not set(k1) & set(k2)
    for ns, keys in ((ns1, k1), (ns2, k2)):
        assert all(k.count("/") == 4 + bool(ns) for k in keys)


@pytest.mark.parametrize("bad", ["a/b", "", "x" * 65, "sp ace"])
def test_key_builder_refuses_a_namespace_that_is_not_one_component(bad: str):
    lay = KeyLayout(model="m", tp_rank=0, tp_size=1, block_size=16, dtype="d", kv_layout="LBNHC",
                    num_layers=1, num_kv_heads=1, head_size=1)
    if bad == "":
        assert KeyBuilder(lay, namespace=bad).prefix.startswith("kvl2/")  # "" is "no namespace"
        return
    with pytest.raises(ValueError, match="namespace="):
        KeyBuilder(lay, namespace=bad)


def test_a_bumped_weights_version_never_loads_the_old_kv(store_config: StoreConfig, tmp_path: Path):
    """An RL-style update under the same model config: the engine at `weights_version` "step-2" finds none of
    what "step-1" saved on the same store (and saves its own); a second "step-1" engine loads it (the
    control)."""
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=8, seed=12)
    work = str(tmp_path / "model")
    with Harness(store_config, workdir=work, extra={"weights_version": "step-1"}) as old:
        old.run_pass(prompts, MAX_TOKENS)
        old_keys = old.key_builders[0].keys(old.block_hashes_of(prompts[0]))
        assert old.workers[0].store.batch_is_exist(old_keys) == [1] * len(old_keys)

        with Harness(store_config, workdir=work, extra={"weights_version": "step-2"}) as new:
            new_keys = new.key_builders[0].keys(new.block_hashes_of(prompts[0]))
            assert not set(new_keys) & set(old_keys)
            new.run_pass(prompts, MAX_TOKENS)
            assert new.scheduler_connector.scheduler_side.num_loads == 0
            assert new.scheduler_connector.stats.totals.data.get("lookups", 0) > 0  # it did look
            assert new.workers[0].store.batch_is_exist(new_keys) == [1] * len(new_keys)

        with Harness(store_config, workdir=work, extra={"weights_version": "step-1"}) as again:
            again.run_pass(prompts, MAX_TOKENS)
            assert again.scheduler_connector.scheduler_side.num_loads > 0


@pytest.mark.parametrize("bad", ["a/b", "x" * 65, 3, "sp ace"])
def test_a_bad_weights_version_is_refused_by_name(store_config: StoreConfig, tmp_path: Path, bad: object):
    from kvledger_connector.config import ConfigError

    with pytest.raises(ConfigError, match="weights_version"):
        Harness(store_config, workdir=str(tmp_path / "model"), extra={"weights_version": bad})
