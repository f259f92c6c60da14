"""Tenants sharing one store: engines with different namespaces (upstream's ``cache_prefix``) never share a
key. Three engines of the same model, one after another, on the session's real master: tenant-a saves,
tenant-b then finds none of it (and saves its own), and a second tenant-a engine loads what the first
saved (the control: without it, "no hits" could mean the workload never hits)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.config import StoreConfig
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from testbed.harness import Harness, shared_prefix_prompts

MAX_TOKENS = 8


def test_two_namespaces_never_share_keys_on_one_store(store_config: StoreConfig, tmp_path: Path):
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=8, seed=11)
    work = str(tmp_path / "model")  # one model directory: the engines differ in their namespace only

    # tenant-a's engine stays up throughout: the objects live in its workers' segments of the pool
    with Harness(store_config, workdir=work, extra={"namespace": "tenant-a"}) as a:
        a.run_pass(prompts, MAX_TOKENS)
        assert a.scheduler_connector.scheduler_side.steps.ledger.num_jobs_opened > 0
        a_keys = a.key_builders[0].keys(a.block_hashes_of(prompts[0]))
        assert all(k.startswith("tenant-a/kvl2/") for k in a_keys)
        assert a.workers[0].store.batch_is_exist(a_keys) == [1] * len(a_keys)  # tenant-a's blocks are stored

        with Harness(store_config, workdir=work, extra={"cache_prefix": "tenant-b"}) as b:
            b_keys = b.key_builders[0].keys(b.block_hashes_of(prompts[0]))
            assert [k.split("/", 1)[1] for k in b_keys] == [k.split("/", 1)[1] for k in a_keys]  # same blocks
            assert not set(b_keys) & set(a_keys)  # ...under other keys
            assert b.workers[0].store.batch_is_exist(b_keys) == [0] * len(b_keys)
            b.run_pass(prompts, MAX_TOKENS)
            ss = b.scheduler_connector.scheduler_side.steps
            assert ss.stats.total("loads_emitted") == 0  # nothing of tenant-a's is visible to tenant-b
            assert b.scheduler_connector.stats.totals.data.get("lookup_hit_tokens", 0) == 0
            assert b.scheduler_connector.stats.totals.data.get("lookups", 0) > 0  # it did look
            assert b.workers[0].store.batch_is_exist(b_keys) == [1] * len(b_keys)  # and saved its own

        with Harness(store_config, workdir=work, extra={"namespace": "tenant-a"}) as a2:
            a2.run_pass(prompts, MAX_TOKENS)
            assert a2.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0  # the control: same namespace, hits


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
            assert new.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") == 0
            assert new.scheduler_connector.stats.totals.data.get("lookups", 0) > 0  # it did look
            assert new.workers[0].store.batch_is_exist(new_keys) == [1] * len(new_keys)

        with Harness(store_config, workdir=work, extra={"weights_version": "step-1"}) as again:
            again.run_pass(prompts, MAX_TOKENS)
            assert again.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0


@pytest.mark.parametrize("bad", ["a/b", "x" * 65, 3, "sp ace"])
def test_a_bad_weights_version_is_refused_by_name(store_config: StoreConfig, tmp_path: Path, bad: object):
    from kvledger_connector.config import ConfigError

    with pytest.raises(ConfigError, match="weights_version"):
        Harness(store_config, workdir=str(tmp_path / "model"), extra={"weights_version": bad})


def _write_version(path: Path, version: str, mode: int = 0o644) -> None:
    """As an RL loop should: a new file renamed over the old one (a reader never sees it half-written)."""
    new = path.with_name(path.name + ".new")
    new.write_text(version + "\n")
    new.chmod(mode)
    os.replace(new, path)


def test_a_weights_version_bumped_at_reset_never_reads_the_old_kv(store_config: StoreConfig, tmp_path: Path):
    """An RL loop on engine A: its weights version comes from `weights_version_file`; after a weight update the
    loop writes the new version and calls vLLM's reset_prefix_cache(reset_connector=True). Engine B is not
    updated and keeps writing the old weights' KV under the old keys: A never loads it and saves its own under
    the new keys, every rank following the scheduler's switch. B loads the old KV (the control)."""
    prompts = shared_prefix_prompts(4, num_prefixes=2, prefix_len=48, suffix_len=8, seed=13)
    work = str(tmp_path / "model")
    version = tmp_path / "weights_version"
    _write_version(version, "step-1")
    with Harness(store_config, workdir=work, tp_size=2, extra={"weights_version_file": str(version)}) as a:
        hashes = a.block_hashes_of(prompts[0])
        a.run_pass(prompts, MAX_TOKENS, tag="a1")
        ss = a.scheduler_connector.scheduler_side.steps
        old_keys = ss.key_builders[0].keys(hashes)
        assert a.key_builders[0].keys(hashes) == old_keys  # the workers followed the file's first version
        assert a.workers[0].store.batch_is_exist(old_keys) == [1] * len(old_keys)

        _write_version(version, "step-2")
        a.reset_prefix_cache_when_idle()  # vLLM's own prefix cache only: the connector does not look
        assert ss.weights_version == "step-1"
        a.reset_prefix_cache_when_idle(reset_connector=True)
        assert ss.weights_version == "step-2"
        new_keys = ss.key_builders[0].keys(hashes)
        assert not set(new_keys) & set(old_keys)

        with Harness(store_config, workdir=work, tp_size=2, extra={"weights_version": "step-1"}) as b:
            b.run_pass(prompts, MAX_TOKENS, tag="b")  # the old weights' KV, under the old keys again
            assert b.key_builders[0].keys(hashes) == old_keys
            assert b.workers[0].store.batch_is_exist(old_keys) == [1] * len(old_keys)

            loads, lookups = ss.stats.total("loads_emitted"), a.scheduler_connector.stats.totals.data.get("lookups", 0)
            a.run_pass(prompts, MAX_TOKENS, tag="a2")
            assert ss.stats.total("loads_emitted") == loads  # none of B's old-weights KV
            assert a.scheduler_connector.stats.totals.data.get("lookups", 0) > lookups  # it did look
            # every rank switched: its keys are the scheduler's for its shard
            assert [kb.keys(hashes) for kb in a.key_builders] == [kb.keys(hashes) for kb in ss.key_builders]
            assert a.workers[1].store.batch_is_exist(new_keys) == [1] * len(new_keys)
            assert [w.worker_side.weights_version for w in a.workers] == ["step-2"] * 2
            assert a.scheduler_connector.stats.total("weights_version_switches") == 1

            b.scheduler.reset_prefix_cache()
            loads_b = b.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted")
            b.run_pass(prompts, MAX_TOKENS, tag="b2")
            assert b.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > loads_b  # the control: the old keys hit


@pytest.mark.parametrize("case", ["missing", "link", "others-write", "empty", "bad-chars", "not-ascii", "huge"])
def test_a_bad_weights_version_file_is_refused_by_name(tmp_path: Path, case: str):
    from kvledger_connector.config import ConfigError
    from kvledger_connector.shape.engine_facts import read_weights_version

    path = tmp_path / "weights_version"
    _write_version(path, "step-1")
    if case == "missing":
        path.unlink()
    elif case == "link":
        target = tmp_path / "elsewhere"
        _write_version(target, "step-1")
        path.unlink()
        path.symlink_to(target)
    elif case == "others-write":
        path.chmod(0o664)
    else:
        path.write_bytes({"empty": b" \n", "bad-chars": b"step 1/x", "not-ascii": "stép".encode(),
                          "huge": b"x" * 300}[case])
    with pytest.raises((ConfigError, LedgerInputError), match="weights_version_file") as err:
        read_weights_version(str(path))
    assert str(path) in str(err.value)


def test_a_weights_version_file_is_checked_at_start_and_at_every_reset(store_config: StoreConfig, tmp_path: Path):
    """At start-up a bad file (or one set with `weights_version`) refuses the engine; at a reset a file that
    went bad refuses the reset (going on under the old version after an update would read old KV) and keeps
    the keys where they were."""
    from kvledger_connector.config import ConfigError

    version = tmp_path / "weights_version"
    _write_version(version, "step-1", mode=0o666)
    work = str(tmp_path / "model")
    with pytest.raises(LedgerInputError, match="weights_version_file.*0666"):
        Harness(store_config, workdir=work, extra={"weights_version_file": str(version)})
    version.chmod(0o644)
    with pytest.raises(ConfigError, match="weights_version_file.*choose one"):
        Harness(store_config, workdir=work, extra={"weights_version_file": str(version), "weights_version": "x"})
    with Harness(store_config, workdir=work, extra={"weights_version_file": str(version)}) as h:
        ss = h.scheduler_connector.scheduler_side.steps
        _write_version(version, "step-2", mode=0o646)
        assert h.scheduler_connector.reset_cache() is False
        assert ss.weights_version == "step-1"
        assert h.scheduler_connector.stats.total("resets_refused") == 1
        version.chmod(0o644)
        assert h.scheduler_connector.reset_cache() is True
        assert ss.weights_version == "step-2"
