"""Integrity of stored blocks (kvledger_connector/shape/integrity.py): the tag the connector computes is the one the
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
from kvledger_connector.shape import integrity
from kvledger_connector.shape.engine_facts import head_shard_views
from kvledger_connector.shape.integrity import (FEW_BLOCKS, NONCE_BYTES, TAG_BYTES, TRAILER_BYTES, BlockSeal,
                                          IntegrityError, IntegrityKey, construction_for, reference_digest,
                                          reference_tag, reference_trailer)
from kvledger_connector.shape.kvlayout import LAYOUT_HNC_ORDER, plan_block_copies
from kvledger_connector.telemetry.stats import _CODE_PREFIX
from kvledger_connector.store.contract import StoreCode
from testbed.faults import FaultPlan, FaultRule, FaultyStore
from testbed.harness import Harness, shared_prefix_prompts
from testbed.kvcache import allocate, build_kv_cache_config

MAX_TOKENS = 8


def _object(plan, block: int) -> bytes:
    ptrs, sizes = plan.buffers(block)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


#: every construction in the modes that tag: host KV gets x3 under checksum and b3 under mac
#: (`construction_for("cpu", mode)`), mm8 is the CUDA kernel, run here on host memory
KEYS = [IntegrityKey(construction=c) for c in ("x3", "b3", "mm8")] + [IntegrityKey("mac", os.urandom(32), c)
                                                                       for c in ("b3", "mm8")]


def _random_kv(store_config: StoreConfig, tmp_path: Path, layout: str, num_blocks: int) -> tuple[Harness, dict]:
    with Harness(store_config, workdir=str(tmp_path / "m"), kv_layout=layout, num_blocks=8) as h:
        cfg = build_kv_cache_config(h.vllm_config, h._specs, num_blocks, layout)
        kv = allocate(cfg, layout)
    for t in kv.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    return h, kv


@pytest.mark.parametrize("layout", sorted(LAYOUT_HNC_ORDER))
def test_the_tag_is_the_modules_definition_on_every_layout(layout: str, tmp_path: Path, store_config: StoreConfig,
                                                           monkeypatch: pytest.MonkeyPatch):
    """`BlockSeal.tags` (b3 and x3 hash each block where it lies, run by run in pieces of at most PIECE_BYTES;
    mm8 in torch) equals `reference_tag` (the definition on the whole object) on the bytes the store would be
    sent, for KV caches from vLLM's allocator, random bytes everywhere: a few blocks and more than FEW_BLOCKS,
    runs cut into pieces, and a partial tail tagged from its staging copy."""
    n = FEW_BLOCKS + 3
    h, kv = _random_kv(store_config, tmp_path, layout, n + 1)
    plan = plan_block_copies(kv, layout=layout, block_size=h.block_size, num_blocks=n + 1)
    monkeypatch.setattr(integrity, "PIECE_BYTES", {"x3": 100, "b3": 100})  # runs cut into pieces, none on an edge
    for ikey in KEYS:
        seal = BlockSeal(ikey, plan, kv, slots=1, max_keys=n)
        for ids in ([1, 4, 5], list(range(1, n + 1))):
            keys = [f"k{b}" for b in ids]
            nonces = [os.urandom(NONCE_BYTES) for _ in ids]
            with seal.slot(len(ids)) as s:
                got = seal.tags(s, keys, nonces, ids)
            assert got == [reference_tag(_object(plan, b), ikey, k, nc) for b, k, nc in zip(ids, keys, nonces)], ikey
            assert {len(t) for t in got} == {TAG_BYTES}
        if ikey.construction == "mm8":
            assert [int(x) for x in seal.digests([4])[0]] == reference_digest(_object(plan, 4), ikey)
        with seal.slot(3) as s:
            trailers, staged = seal.seal(s, ["k1", "k4", "k5"], [1, 4, 5], stages=[2])
            assert ctypes.string_at(staged[0], plan.block_bytes) == _object(plan, 5)  # what is sent for the tail
            row = ctypes.string_at(trailers[2], TRAILER_BYTES)
            assert row == reference_trailer(_object(plan, 5), ikey, "k5", row[8:8 + NONCE_BYTES])
            assert seal.verify(s, ["k1", "k4", "k5"], [1, 4, 5]) == [True, True, True]
            assert seal.verify(s, ["k4", "k1", "k5"], [1, 4, 5]) == [False, False, True]  # a tag holds under its key
            ctypes.c_uint8.from_address(plan.buffers(4)[0][-1]).value ^= 1  # block 4's last segment, in place
            assert seal.verify(s, ["k1", "k4", "k5"], [1, 4, 5]) == [True, False, True]  # one bit of block 4
            ctypes.c_uint8.from_address(plan.buffers(4)[0][-1]).value ^= 1
    # the parts of a block (head shards of the TP-shared layout; a hybrid model's groups alike): each key's tag
    # over its own part's views
    parts = [plan_block_copies(head_shard_views(kv, 1, j), layout=layout, block_size=h.block_size, num_blocks=n + 1)
             for j in range(2)]  # the harness's 2 KV heads
    for ikey in KEYS:
        seal = BlockSeal(ikey, parts, kv, slots=1, max_keys=4)
        ids, groups, keys = [2, 2, 3, 6], [0, 1, 1, 0], ["a", "b", "c", "d"]
        nonces = [os.urandom(NONCE_BYTES) for _ in ids]
        with seal.slot(4) as s:
            got = seal.tags(s, keys, nonces, ids, groups)
        assert got == [reference_tag(_object(parts[g], b), ikey, k, nc)
                       for b, g, k, nc in zip(ids, groups, keys, nonces)], ikey


def test_the_x3_tag_is_xxh3_128():
    """x3's tag is XXH3-128 (seed 0) of the bound key and nonce then the bytes, in 16 bytes then zeros: the
    `xxhash` package the module hashes with gives the specification's digests of the empty input (XXH3-128
    and XXH3-64), and the module's definition is that digest of the whole object."""
    import xxhash
    assert xxhash.xxh3_128_hexdigest(b"") == "99aa06d3014798d86001c324468d497f"
    assert xxhash.xxh3_64_hexdigest(b"") == "2d06800538d394c2"
    ck = IntegrityKey("checksum")
    body, nonce = bytes(i % 251 for i in range(70_000)), bytes(range(NONCE_BYTES))  # past xxhash's GIL threshold
    want = xxhash.xxh3_128(ck.bind("k", nonce) + body).digest()
    assert reference_tag(body, ck, "k", nonce) == want + bytes(TAG_BYTES - len(want))


def test_the_b3_tag_is_blake3_keyed_hash():
    """b3's tag is BLAKE3 in keyed mode as specified: the official test vectors (BLAKE3-team/BLAKE3
    test_vectors/test_vectors.json: input byte i is i % 251) hold for the `blake3` package the module hashes
    with, in one call and split as the seal splits it (the bound key and nonce, then the bytes)."""
    from blake3 import blake3
    key = b"whats the Elvish word for friend"
    vectors = {  # input length: the first 64 bytes of keyed_hash's extended output
        1025: "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69"
              "362396b77fdc0d2634a552970843722066c3c15902ae5097e00ff53f1e116f1c",
        3073: "68dede9bef00ba89e43f31a6825f4cf433389fedae75c04ee9f0cf16a427c95a"
              "96d6da3fe985054d3478865be9a092250839a697bbda74e279e8a9e69f0025e4",
    }
    for n, want in vectors.items():
        data = bytes(i % 251 for i in range(n))
        assert blake3(data, key=key).digest(TAG_BYTES).hex() == want
        h = blake3(data[:11], key=key)
        h.update(memoryview(data)[11:])
        assert h.digest(TAG_BYTES).hex() == want


def _overwrite(h: Harness, key: str, forge: str | None) -> None:
    """Another client of the store replaces ``key``'s value with same-size bytes: random ones, or a block of
    zeros with a trailer made under mode ``forge`` without a secret, in the engine's construction (what a
    client that knows the algorithm can do)."""
    c = h.checker()
    size = h.workers[0].worker_side.steps.key_bytes
    buf = torch.zeros(size, dtype=torch.uint8)
    if forge is None:
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    else:
        ikey = IntegrityKey(forge, construction=h.workers[0].integrity.construction)
        body = bytes(size - TRAILER_BYTES)
        forged = reference_trailer(body, ikey, key, os.urandom(NONCE_BYTES))
        buf[-TRAILER_BYTES:] = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
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
        _overwrite(h, keys[1], forge)
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts, MAX_TOKENS, tag="p2")  # outputs right, no KV read wrong (S7), at rest
        steps = h.workers[0].worker_side.steps
        assert steps.stats.totals.data.get("integrity_mismatches", 0) >= 1
        assert steps.stats.totals.data.get(f"{_CODE_PREFIX}{int(StoreCode.INTEGRITY_MISMATCH)}", 0) >= 1
        assert h.stats.load_error_blocks >= 1 and h.garbage == []
        assert h.scheduler_connector.scheduler_side.steps.stats.total("loads_emitted") > 0  # the other blocks did load
        checked, polluted = h.check_store()
        assert checked > 0 and polluted == 0  # the forged key was re-saved by the recompute... or is gone


def test_a_key_a_get_misses_leaves_every_other_key_of_its_batch_checked_against_its_own_tag(
        tmp_path: Path, store_config: StoreConfig):
    """The first key of a load's get comes back missing (a test double evicts it between the lookup and
    the get: the store's real -704), the others whole. Each whole key is checked against its own trailer
    row of the get, not the row of its place among the whole ones: none fails its tag, none is removed.
    Checked against rows 0..n-1 they failed, were reported as load errors and their good objects removed."""
    prompts = shared_prefix_prompts(4, num_prefixes=1, prefix_len=48, suffix_len=8, seed=23)
    with Harness(store_config, workdir=str(tmp_path / "m"), policy="recompute") as h:
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))
        assert len(keys) >= 3 and h.workers[0].store.batch_is_exist(keys) == [1] * len(keys)
        steps = h.workers[0].worker_side.steps
        io = h.workers[0].worker_side.io
        faulty = FaultyStore(io.store, FaultPlan([FaultRule("get", "evict", keys=frozenset({keys[0]}),
                                                            max_fires=1)]))
        io.store = faulty
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts, MAX_TOKENS, tag="p2")  # outputs right, no KV read wrong (S7), at rest
        assert len(faulty.injected) == 1  # the get of the prefix ran, with its first key gone
        assert steps.stats.totals.data.get("integrity_mismatches", 0) == 0
        assert steps.removals == {}


def test_a_checksum_tag_can_be_forged_by_a_client_that_knows_the_algorithm(tmp_path: Path,
                                                                           store_config: StoreConfig):
    """What 'checksum' does not defend (the README says so): a client that recomputes the tag of its own
    bytes gets them loaded; the stand-in model then reads KV that is not the prompt's."""
    prompts = shared_prefix_prompts(2, num_prefixes=1, prefix_len=48, suffix_len=8, seed=22)
    with Harness(store_config, workdir=str(tmp_path / "m")) as h:
        h.run_pass(prompts, MAX_TOKENS, tag="p1")
        keys = h.key_builders[0].keys(h.block_hashes_of(prompts[0]))
        _overwrite(h, keys[1], "checksum")
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
        _overwrite(h, keys[1], "checksum")
        h.reset_prefix_cache_when_idle()
        h.run_pass(prompts, MAX_TOKENS, tag="p2")  # outputs right: the planted block was not loaded
        steps = h.workers[0].worker_side.steps
        assert steps.stats.totals.data.get("integrity_mismatches", 0) >= 1
        assert h.stats.load_error_blocks >= 1 and h.garbage == []
    assert list(rdir.glob("secret-*.key")) == []  # the owner's shutdown takes the secret with its servers


def test_mac_needs_the_secret_and_engines_with_other_secrets_share_no_key(tmp_path: Path):
    tags = {IntegrityKey("off").key_tag, IntegrityKey().key_tag, IntegrityKey("mac", b"a" * 16).key_tag,
            IntegrityKey("mac", b"b" * 16).key_tag, IntegrityKey(construction="mm8").key_tag,
            IntegrityKey("mac", b"a" * 16, "mm8").key_tag, IntegrityKey(construction="b3").key_tag}
    assert len(tags) == 7 and {"", "ckx3", "ckb3", "ck1"} <= tags  # mode, construction, secret: no two share a key
    assert b"a" * 16 not in b"".join(t.encode() for t in tags)
    with pytest.raises(LedgerInputError, match="construction='sha1'"):
        IntegrityKey(construction="sha1")
    with pytest.raises(LedgerInputError, match="construction='x3'.*takes no key"):
        IntegrityKey("mac", b"a" * 16, "x3")
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
    host = dict(generated=gen, device="cpu")
    assert IntegrityKey.resolve(None, None, embedded=True, **host) == IntegrityKey("mac", b"g" * 32)
    assert IntegrityKey.resolve(None, None, embedded=False, **host) == IntegrityKey("checksum")
    assert IntegrityKey.resolve("off", None, embedded=True, **host) == IntegrityKey("off")
    assert asked == [1]  # generated only for the mac it serves
    # the construction follows the KV cache's device and the mode: on host memory XXH3 for checksum and keyed
    # BLAKE3 for mac, the int8 kernel on a GPU
    assert construction_for("cpu", "checksum") == "x3" and construction_for("cpu", "mac") == "b3"
    assert construction_for("cuda", "checksum") == construction_for("cuda", "mac") == "mm8"
    assert IntegrityKey("checksum").construction == "x3" and IntegrityKey("mac", b"a" * 16).construction == "b3"
    assert IntegrityKey.resolve(None, None, embedded=False, generated=gen, device="cuda") == IntegrityKey(
        "checksum", construction="mm8")
    # two engines with different secrets: one's tags never verify under the other's key
    body = os.urandom(3 * 512 + 7)
    nonce = os.urandom(NONCE_BYTES)
    for how in ("b3", "mm8"):
        a, b = IntegrityKey("mac", b"a" * 16, how), IntegrityKey("mac", b"b" * 16, how)
        assert reference_tag(body, a, "k", nonce) != reference_tag(body, b, "k", nonce)
        assert reference_tag(body, a, "k", nonce) != reference_tag(body, a, "k2", nonce)  # nor under another key
        assert reference_tag(body, a, "k", nonce) != reference_tag(body, a, "k", bytes(NONCE_BYTES))  # nor nonce
    ck = IntegrityKey("checksum")  # x3: no secret, still bound to its key and nonce
    assert reference_tag(body, ck, "k", nonce) != reference_tag(body, ck, "k2", nonce)
    assert reference_tag(body, ck, "k", nonce) != reference_tag(body, ck, "k", bytes(NONCE_BYTES))


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
