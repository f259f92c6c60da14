"""Integrity of stored blocks (kvledger_connector/integrity.py): the tag the connector computes is the one the
module defines, on every layout of vLLM's allocator; another client's same-size overwrite is a load error,
never loaded (vLLM's real Scheduler, the real Mooncake master); a 'mac' tag cannot be made without the
secret, while a 'checksum' one can (what each mode defends); the secret file and the trailer slots are
checked and bounded."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from kvledger.errors import LedgerInputError
from kvledger_connector.config import ConfigError, ConnectorConfig, StoreConfig, integrity_mode
from kvledger_connector.integrity import (LANES, NONCE_BYTES, TRAILER_BYTES, BlockSeal, IntegrityError,
                                          IntegrityKey, reference_digest, trailer)
from kvledger_connector.kvlayout import LAYOUT_HNC_ORDER, plan_block_copies
from kvledger_connector.stats import _CODE_PREFIX
from kvledger_connector.store import StoreCode
from testbed.harness import Harness, shared_prefix_prompts
from testbed.kvcache import allocate, build_kv_cache_config

MAX_TOKENS = 8


def _object(plan, block: int) -> bytes:
    ptrs, sizes = plan.buffers(block)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


@pytest.mark.parametrize("layout", sorted(LAYOUT_HNC_ORDER))
def test_the_tag_is_the_modules_definition_on_every_layout(layout: str, tmp_path: Path, store_config: StoreConfig):
    """`BlockSeal.digests` (torch, where the KV lives) equals `reference_digest` (plain Python) on the bytes
    the store would be sent, for KV caches from vLLM's allocator, random bytes everywhere."""
    with Harness(store_config, workdir=str(tmp_path / "m"), kv_layout=layout, num_blocks=8) as h:
        cfg = build_kv_cache_config(h.vllm_config, h._specs, 6, layout)
        kv = allocate(cfg, layout)
    for t in kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    plan = plan_block_copies(kv, layout=layout, block_size=h.block_size, num_blocks=6)
    for ikey in (IntegrityKey(), IntegrityKey("mac", os.urandom(32))):
        seal = BlockSeal(ikey, plan, kv, slots=1, max_keys=6)
        got = seal.digests([1, 4, 5])
        for row, b in zip(got, (1, 4, 5)):
            assert [int(x) for x in row] == reference_digest(_object(plan, b), ikey)
        with seal.slot(2) as s:
            seal.seal(s, ["k1", "k4"], [1, 4])
            assert seal.verify(s, ["k1", "k4"], [1, 4]) == [True, True]
            assert seal.verify(s, ["k4", "k1"], [1, 4]) == [False, False]  # a tag holds under its key only
            ctypes.c_uint8.from_address(plan.buffers(4)[0][-1]).value ^= 1  # block 4's last segment, in place
            assert seal.verify(s, ["k1", "k4"], [1, 4]) == [True, False]  # one bit of block 4 flipped


def _overwrite(h: Harness, key: str, forge: IntegrityKey | None) -> None:
    """Another client of the store replaces ``key``'s value with same-size bytes: random ones, or a block of
    zeros with a trailer made under ``forge`` (what a client that knows the algorithm can do)."""
    c = h.checker()
    size = h.workers[0].worker_side.steps.key_bytes
    buf = torch.zeros(size, dtype=torch.uint8)
    if forge is None:
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    else:
        body = bytes(size - TRAILER_BYTES)
        buf[-TRAILER_BYTES:] = torch.frombuffer(bytearray(trailer(forge, key, reference_digest(body, forge),
                                                                  os.urandom(NONCE_BYTES))), dtype=torch.uint8)
    c.register_buffer(buf.data_ptr(), size)
    assert c.remove(key, True) == 0
    assert c.batch_put([key], [[buf.data_ptr()]], [[size]]) == [0]
    h._attack_buf = buf  # registered with the store: kept alive with the harness


@pytest.mark.parametrize("mode, forge", [("checksum", None), ("mac", None), ("mac", "checksum")])
def test_a_same_size_overwrite_is_a_load_error_never_loaded(mode: str, forge: str | None, tmp_path: Path,
                                                            store_config: StoreConfig):
    secret = tmp_path / "secret"
    extra = {"integrity": mode}
    if mode == "mac":
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
        extra["integrity_secret_file"] = str(secret)
    prompts = shared_prefix_prompts(4, num_prefixes=1, prefix_len=48, suffix_len=8, seed=21)
    with Harness(store_config, workdir=str(tmp_path / "m"), extra=extra) as h:
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))
        assert h.workers[0].store.batch_is_exist(keys) == [1] * len(keys)
        _overwrite(h, keys[1], IntegrityKey(forge) if forge else None)
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts, MAX_TOKENS, tag="p2")  # outputs right, no KV read wrong (S7), at rest
        steps = h.workers[0].worker_side.steps
        assert steps.stats.totals.data.get("integrity_mismatches", 0) >= 1
        assert steps.stats.totals.data.get(f"{_CODE_PREFIX}{int(StoreCode.INTEGRITY_MISMATCH)}", 0) >= 1
        assert h.stats.load_error_blocks >= 1 and h.garbage == []
        assert h.scheduler_connector.scheduler_side.num_loads > 0  # the other blocks did load
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0  # the forged key was re-saved by the recompute... or is gone


def test_a_checksum_tag_can_be_forged_by_a_client_that_knows_the_algorithm(tmp_path: Path,
                                                                           store_config: StoreConfig):
    """What 'checksum' does not defend (the README says so): a client that recomputes the tag of its own
    bytes gets them loaded; the stand-in model then reads KV that is not the prompt's."""
    prompts = shared_prefix_prompts(2, num_prefixes=1, prefix_len=48, suffix_len=8, seed=22)
    with Harness(store_config, workdir=str(tmp_path / "m")) as h:
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))
        _overwrite(h, keys[1], IntegrityKey("checksum"))
        h.reset_prefix_cache_when_idle()
        with pytest.raises(AssertionError, match="wrong KV"):
            h.run_pass(prompts[:1], MAX_TOKENS, tag="p2")
        assert h.workers[0].worker_side.steps.stats.totals.data.get("integrity_mismatches", 0) == 0


def test_the_embedded_default_refuses_a_recomputed_checksum_tag(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """The embedded default (no master configured, no integrity setting): the connectors start the store and
    run 'mac' under a secret generated for the engine; a local client that plants bytes with a recomputed
    'checksum' tag (what it can do against 'checksum') gets a load error, never its bytes loaded. TP 2 in
    one process: both ranks read the one secret."""
    rdir = tmp_path / "run"
    rdir.mkdir(mode=0o700)
    monkeypatch.setenv("KVLEDGER_RUNTIME_DIR", str(rdir))
    cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
    prompts = shared_prefix_prompts(4, num_prefixes=1, prefix_len=48, suffix_len=8, seed=23)
    with Harness(cfg, workdir=str(tmp_path / "m"), tp_size=2) as h:
        ikeys = [w.integrity for w in h.workers] + [h.scheduler_connector.integrity]
        assert {k.mode for k in ikeys} == {"mac"} and len({k.secret for k in ikeys}) == 1, ikeys
        [secret] = rdir.glob("secret-*.key")
        assert secret.read_bytes() == ikeys[0].secret and secret.stat().st_mode & 0o777 == 0o600
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))
        _overwrite(h, keys[1], IntegrityKey("checksum"))
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts, MAX_TOKENS, tag="p2")  # outputs right: the planted block was not loaded
        steps = h.workers[0].worker_side.steps
        assert steps.stats.totals.data.get("integrity_mismatches", 0) >= 1
        assert h.stats.load_error_blocks >= 1 and h.garbage == []
    assert list(rdir.glob("secret-*.key")) == []  # the owner's shutdown takes the secret with its servers


def test_mac_needs_the_secret_and_engines_with_other_secrets_share_no_key(tmp_path: Path):
    tags = {IntegrityKey("off").key_tag, IntegrityKey().key_tag, IntegrityKey("mac", b"a" * 16).key_tag,
            IntegrityKey("mac", b"b" * 16).key_tag}
    assert len(tags) == 4 and "" in tags and "ck1" in tags
    assert b"a" * 16 not in b"".join(t.encode() for t in tags)
    with pytest.raises(LedgerInputError, match="integrity_secret_file"):
        IntegrityKey.of("mac", None)
    with pytest.raises(LedgerInputError, match="integrity_secret_file"):
        IntegrityKey.of("checksum", str(tmp_path / "s"))
    with pytest.raises(LedgerInputError, match="integrity.*'sha1'"):
        IntegrityKey("sha1")
    with pytest.raises(ConfigError, match="integrity.*'crc'"):
        ConnectorConfig(store=StoreConfig(), block_size=16, integrity="crc")
    master = StoreConfig().with_addresses("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    with pytest.raises(ConfigError, match="integrity_secret_file.*master_server_address"):
        ConnectorConfig(store=master, block_size=16, integrity="mac")  # engines sharing a store need one secret
    with pytest.raises(ConfigError, match="integrity_secret_file.*'checksum'"):
        ConnectorConfig(store=StoreConfig(), block_size=16, integrity="checksum", integrity_secret_file="/s")
    # the default: mac where the connector starts the store (a generated secret), checksum beside a master
    assert integrity_mode(None, None, embedded=True) == "mac" == integrity_mode("mac", None, embedded=True)
    assert integrity_mode(None, None, embedded=False) == "checksum"
    assert integrity_mode(None, "/s", embedded=False) == "mac"
    asked: list[int] = []
    gen = lambda: asked.append(1) or b"g" * 32  # noqa: E731
    assert IntegrityKey.resolve(None, None, embedded=True, generated=gen) == IntegrityKey("mac", b"g" * 32)
    assert IntegrityKey.resolve(None, None, embedded=False, generated=gen) == IntegrityKey("checksum")
    assert IntegrityKey.resolve("off", None, embedded=True, generated=gen) == IntegrityKey("off")
    assert asked == [1]  # generated only for the mac it serves
    # two engines with different secrets: one's tags never verify under the other's key
    body = os.urandom(3 * 512 + 7)
    a, b = IntegrityKey("mac", b"a" * 16), IntegrityKey("mac", b"b" * 16)
    nonce = os.urandom(NONCE_BYTES)
    assert trailer(a, "k", reference_digest(body, a), nonce) != trailer(b, "k", reference_digest(body, b), nonce)
    assert len(reference_digest(body, a)) == LANES


def test_the_secret_file_is_refused_unless_private(tmp_path: Path):
    f = tmp_path / "secret"
    f.write_bytes(os.urandom(32))
    f.chmod(0o644)
    with pytest.raises(LedgerInputError, match="integrity_secret_file.*mode 0644"):
        IntegrityKey.of("mac", str(f))
    f.chmod(0o600)
    assert IntegrityKey.of("mac", str(f)).secret == f.read_bytes()
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(LedgerInputError, match="integrity_secret_file.*links"):
        IntegrityKey.of("mac", str(link))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 15)
    short.chmod(0o600)
    with pytest.raises(LedgerInputError, match="holds 15 bytes"):
        IntegrityKey.of("mac", str(short))
    with pytest.raises(LedgerInputError, match="regular file"):
        IntegrityKey.of("mac", str(tmp_path))


def test_trailer_slots_are_bounded(tmp_path: Path, store_config: StoreConfig):
    """One slot per thread that may store at once: one more is a named error, not a shared buffer."""
    with Harness(store_config, workdir=str(tmp_path / "m"), num_blocks=8) as h:
        cfg = build_kv_cache_config(h.vllm_config, h._specs, 4, h.kv_layout)
    kv = allocate(cfg, h.kv_layout)
    seal = BlockSeal(IntegrityKey(), plan_block_copies(kv, layout=h.kv_layout, block_size=h.block_size), kv,
                     slots=2, max_keys=3)
    with seal.slot(3), seal.slot(1):
        with pytest.raises(IntegrityError, match="2 trailer slots"):
            with seal.slot(1):
                pass
    with seal.slot(1):  # released
        pass
    with pytest.raises(LedgerInputError, match="max_keys=3"):
        with seal.slot(4):
            pass
