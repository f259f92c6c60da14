"""Probes of the connector's parts that no model action reaches: the copy plans of vLLM's KV cache layouts
(kvledger_connector/shape/kvlayout.py), the store keys (shape/keys.py), reset_cache's key pattern (scheduler/reset.py) and the
embedded master's runtime directory (store/rendezvous.py). Each calls the shipped function on real inputs (KV
caches from vLLM's own allocator, testbed/kvcache.py) and raises :class:`ProbeFailed` naming what it saw;
the mutant table runs them after the step-function probes (conformance/kvprobes.py), and
tests/unit/test_probes_parts.py runs them unmutated.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from conformance.kvprobes import Probe, ProbeFailed, ProbeStore, check, drain, io_of
# keys.partial_tail_hash, reset.engine_key_regex, saves.put_positions and engine_facts.kv_replicas are called
# through their modules, as the connector calls them: a patched function (a mutant) is the one probed
from kvledger_connector.shape import engine_facts
from kvledger_connector.worker import saves
from kvledger_connector.shape import keys
from kvledger_connector.store import rendezvous
from kvledger_connector.scheduler import reset
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.shape.kvlayout import BlockCopyPlan, KVLayoutError, plan_block_copies
from testbed.kvcache import LAYOUTS, SPLITTABLE_LAYOUTS, allocate, attention_specs, build_kv_cache_config, layer_names

NUM_BLOCKS = 3
BLOCK_SIZE = 4
HEADS = 2  # two head slots: a head-major layout (LHBNC) is two runs per block and layer
LAYERS = 2


# ---------------------------------------------------------------- KV cache copy plans
def kv_cache(layout: str, kernel: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM's own per-layer views of a fresh KV cache (``kernel``: split blocks into kernel blocks of that
    many tokens), every byte set from a fixed seed through the views."""
    vc = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE), device_config=DeviceConfig("cpu"))
    specs = attention_specs(LAYERS, block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=4)
    kv = allocate(build_kv_cache_config(vc, specs, NUM_BLOCKS, layout), layout,
                  kernel_block_sizes=[kernel] if kernel is not None else None)
    g = torch.Generator().manual_seed(7)
    for t in kv.values():
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, tuple(u.shape), dtype=torch.uint8, generator=g))
    return kv


def expected_block(kv: dict[str, torch.Tensor], layout: str, m: int) -> bytes:
    """Block ``m``'s object from vLLM's side alone: per layer in natural order, the block's (H, N, C) in the
    physical order vLLM's `KVCacheLayout.layer_view_order` gives, kernel blocks in token order."""
    hnc = [d - 1 for d in KVCacheLayout[layout].layer_view_order if d != 0]  # dims of one block [H, N, C]
    out = []
    for name in layer_names(LAYERS):
        u = kv[name].view(torch.uint8)
        ratio = u.shape[0] // NUM_BLOCKS
        blk = torch.cat([u[m * ratio + k] for k in range(ratio)], dim=1)
        out.append(bytes(blk.permute(*hnc).contiguous().flatten().tolist()))
    return b"".join(out)


def read_block(plan: BlockCopyPlan, m: int) -> bytes:
    ptrs, sizes = plan.buffers(m)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


def check_layout(layout: str, kernel: int | None = None) -> None:
    """The copy plan of vLLM's cache in ``layout`` reads every block's object byte-exact."""
    kv = kv_cache(layout, kernel)
    case = f"{layout}{f' (kernel blocks of {kernel})' if kernel else ''}"
    try:
        plan = plan_block_copies(kv, layout=layout, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    except KVLayoutError as e:
        raise ProbeFailed(f"{case}: the copy plan refused vLLM's own KV cache: {e}") from e
    for m in range(NUM_BLOCKS):
        got, want = read_block(plan, m), expected_block(kv, layout, m)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise ProbeFailed(f"{case}: block {m} read as {len(got)} bytes, differing from vLLM's "
                              f"{len(want)} at byte {at}")


def probe_every_layout_reads_each_block_exactly() -> None:
    """Every KVCacheLayout, and each splittable one split into kernel blocks: the plan's segments read each
    block's object exactly (no run dropped, no other block's bytes, the layout's own order)."""
    for layout in LAYOUTS:
        check_layout(layout)
    for layout in SPLITTABLE_LAYOUTS:
        check_layout(layout, kernel=BLOCK_SIZE // 2)


# ---------------------------------------------------------------- keys
BASE = KeyLayout(model="org/probe-1", tp_rank=0, tp_size=2, block_size=16, dtype="torch.bfloat16",
                 kv_layout="LBNHC", num_layers=4, num_kv_heads=2, head_size=8, pp_rank=0, pp_size=2)
HASH = bytes(range(32))


def shard_and_layout_variants() -> dict[str, KeyLayout]:
    """BASE changed in one thing that changes a block's bytes: the tp rank, the pipeline stage, the layout."""
    out = {"base": BASE, "tp rank 1": dataclasses.replace(BASE, tp_rank=1),
           "pp stage 1": dataclasses.replace(BASE, pp_rank=1)}
    return out | {f"layout {lay}": dataclasses.replace(BASE, kv_layout=lay) for lay in LAYOUTS if lay != BASE.kv_layout}


def probe_keys_separate_shards_stages_and_layouts() -> None:
    """Two blocks with the same hash but other bytes (another tp rank, pipeline stage or KV layout) never
    share a key: they would load each other's KV (S1 across engines)."""
    seen: dict[str, str] = {}
    for what, lay in shard_and_layout_variants().items():
        k = KeyBuilder(lay).key(HASH)
        check(k not in seen, f"{what} and {seen.get(k)} share the key {k!r}")
        seen[k] = what


def replica_split(replicas: int, start: int = 3, end: int = 14) -> list[list[int]]:
    """The block positions each replica of a group puts for one job, through the connector's binding."""
    return [saves.put_positions(start, end, i, replicas) for i in range(replicas)]


def probe_replicas_put_each_key_once() -> None:
    """Ranks that share keys (identical KV) put every key of a job, each exactly once, and split by block
    position, so that two jobs of one request agree on who puts a block."""
    for k in (1, 2, 3, 4):
        split = replica_split(k)
        flat = sorted(p for s in split for p in s)
        check(flat == list(range(3, 14)), f"{k} replicas put {flat}, not each of positions 3..13 once")
        later = replica_split(k, 5, 14)
        check(all(set(b) <= set(a) for a, b in zip(split, later)),
              f"{k} replicas: a job from position 5 gives a block to another replica ({split} vs {later})")


def replicas_of(kind: str, tp: int) -> int:
    """`engine_facts.kv_replicas` of a tiny model served at ``tp`` (per_rank: one KV head per rank; one_head:
    a single KV head vLLM replicates; mla: a DeepSeek-V2 latent), from vLLM's own config classes."""
    from vllm.config import ModelConfig, ParallelConfig

    from testbed.emu_model import write_model_dir
    with tempfile.TemporaryDirectory() as d:
        path = write_model_dir(d, num_layers=1, num_kv_heads=tp if kind == "per_rank" else 1, head_size=8,
                               num_attention_heads=2 * tp, mla=kind == "mla")
        mc = ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, dtype="float32", seed=0,
                         max_model_len=256)
        vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                        device_config=DeviceConfig("cpu"))
        return engine_facts.kv_replicas(vc)


def probe_only_identical_kv_shares_a_key() -> None:
    """Ranks share keys only where vLLM gives them the same KV: every rank for MLA, ``tp / heads`` ranks
    when vLLM replicates KV heads, none when each rank holds heads of its own (S1 within an engine)."""
    for kind, tp, want in (("per_rank", 2, 1), ("one_head", 2, 2), ("mla", 2, 2)):
        got = replicas_of(kind, tp)
        check(got == want, f"{kind} at TP {tp}: {got} ranks share keys, vLLM gives {want} the same KV")


def probe_partial_tail_keys_name_the_tail_tokens() -> None:
    """A prompt's partial tail is keyed by its parent and its tokens: another tail (other tokens, another
    length) or another parent gets another hash."""
    h = keys.partial_tail_hash(HASH, [5, 6, 7])
    for parent, tokens in ((HASH, [5, 6, 8]), (HASH, [5, 6]), (HASH, [5, 6, 7, 0]), (bytes(32), [5, 6, 7])):
        check(keys.partial_tail_hash(parent, tokens) != h, f"the tail {tokens} (parent {parent[:2].hex()}..) hashes "
                                                       f"like the tail [5, 6, 7]")


# ---------------------------------------------------------------- reset_cache's pattern
def reset_case() -> tuple[re.Pattern[str], list[str], list[str]]:
    """The reset pattern of a 2-shard engine, its keys, and keys it must keep (another namespace, none,
    another model, another parallel shape, this engine's key inside or before another path)."""
    kbs = [KeyBuilder(dataclasses.replace(BASE, tp_rank=r, pp_size=1), namespace="t.1") for r in range(2)]
    rx = re.compile(reset.engine_key_regex(kbs))  # Python's re agrees with ECMAScript on this subset
    mine = [kb.key(h) for kb in kbs for h in (HASH, -5)]
    lay = kbs[0].layout
    others = [KeyBuilder(lay, namespace="tx1").key(HASH), KeyBuilder(lay).key(HASH),
              KeyBuilder(dataclasses.replace(lay, model="org/probe-2"), namespace="t.1").key(HASH),
              KeyBuilder(dataclasses.replace(lay, tp_size=4, tp_rank=3), namespace="t.1").key(HASH),
              "other/" + mine[0], mine[0] + "/x"]
    return rx, mine, others


def probe_reset_pattern_matches_exactly_the_engines_keys() -> None:
    """reset_cache removes every key of every shard of this engine, and no other key (the master searches
    each key with the pattern)."""
    rx, mine, others = reset_case()
    missed = [k for k in mine if not rx.search(k)]
    check(not missed, f"the reset pattern misses this engine's keys {missed} (pattern {rx.pattern!r})")
    hit = [k for k in others if rx.search(k)]
    check(not hit, f"the reset pattern also removes {hit} (pattern {rx.pattern!r})")


# ---------------------------------------------------------------- the runtime directory
@contextlib.contextmanager
def runtime_dir_env(path: str) -> Iterator[None]:
    old = os.environ.get(rendezvous.RUNTIME_DIR_ENV)
    os.environ[rendezvous.RUNTIME_DIR_ENV] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ[rendezvous.RUNTIME_DIR_ENV]
        else:
            os.environ[rendezvous.RUNTIME_DIR_ENV] = old


def foreign_dir(tmp: str) -> str:
    """A directory another user owns: as root, a fresh one given to nobody; otherwise /."""
    if os.getuid() != 0:
        return "/"
    d = os.path.join(tmp, "foreign")
    os.mkdir(d, 0o700)
    os.chown(d, 65534, 65534)
    return d


def probe_runtime_dir_refuses_what_is_not_private() -> None:
    """The rendezvous files live only in a directory of this user that others cannot write: another user's
    directory, one of ours with mode 0777, a regular file and a symlink (even to a directory of ours) are
    refused, naming the variable."""
    with tempfile.TemporaryDirectory() as tmp:
        shared = os.path.join(tmp, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        plain = os.path.join(tmp, "file")
        Path(plain).write_text("")
        link = os.path.join(tmp, "link")
        os.mkdir(os.path.join(tmp, "mine"), 0o700)
        os.symlink(os.path.join(tmp, "mine"), link)
        for what, path in (("another user's directory", foreign_dir(tmp)), ("a directory others can write", shared),
                           ("a regular file", plain),
                           ("a symlink", link)):
            with runtime_dir_env(path):
                try:
                    got = rendezvous.runtime_dir()
                except rendezvous.RendezvousError as e:
                    check(rendezvous.RUNTIME_DIR_ENV in str(e), f"the refusal of {what} names no variable: {e}")
                    continue
            raise ProbeFailed(f"{what} ({path}) accepted as the runtime dir {got!r}")


@dataclasses.dataclass(frozen=True)
class _Servers:
    """What `rendezvous.acquire` publishes of the servers it starts (none are started here)."""
    master_address: str = "127.0.0.1:1"
    metadata_server: str = "http://127.0.0.1:1/metadata"
    master_inode: int = 1


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def probe_sweep_keeps_live_owners() -> None:
    """acquire() sweeps the rendezvous files of dead owners only: a live engine's file stays (removing it
    would let a second master start for that engine), a dead one's goes, and so does one whose pid runs
    but as another process (a reused pid: its start time differs)."""
    with tempfile.TemporaryDirectory() as tmp, runtime_dir_env(tmp):
        paths = {w: os.path.join(tmp, f"embedded-{w}.json") for w in ("live", "dead", "reused")}
        fields = {"live": rendezvous.owner_fields(os.getpid()), "dead": rendezvous.owner_fields(dead_pid())}
        fields["reused"] = {**fields["live"], "start_time": fields["live"]["start_time"] + 1}
        for w, path in paths.items():
            Path(path).write_text(json.dumps({**fields[w], "master_address": "127.0.0.1:1", "master_inode": 1,
                                              "metadata_server": "http://127.0.0.1:1/metadata"}))
        rendezvous.acquire("probe-sweep", _Servers)  # type: ignore[arg-type]
        rendezvous.release("probe-sweep")
        check(os.path.exists(paths["live"]), "the sweep removed the rendezvous file of a live owner")
        check(not os.path.exists(paths["dead"]), "the sweep kept the rendezvous file of a dead owner")
        check(not os.path.exists(paths["reused"]), "the sweep kept a file whose pid now runs another process")


# ---------------------------------------------------------------- integrity tags
def integrity_case(mode: str = "mac") -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(a rank's WorkerSteps with a seal over vLLM's LBNHC cache, its seal, the cache): trailers of blocks 1
    and 2 under keys "k1" and "k2" sealed in slot 0, then one byte of block 2 flipped."""
    from conformance.kvprobes import ProbeStore, probe_cache, rank
    from kvledger_connector.shape.integrity import BlockSeal, IntegrityKey

    kv = kv_cache("LBNHC")
    plan = plan_block_copies(kv, layout="LBNHC", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    seal = BlockSeal(IntegrityKey(mode, b"probe-secret-16b" if mode == "mac" else b""), plan, kv, slots=1,
                     max_keys=2)
    w = rank(ProbeStore(), cache=dataclasses.replace(probe_cache(), seal=seal,
                                                    key_bytes=plan.block_bytes + seal.trailer_bytes))
    seal.seal(0, ["k1", "k2"], [1, 2])
    first = ctypes.c_uint8.from_address(plan.buffers(2)[0][0])  # block 2's first byte, in the cache
    first.value ^= 1
    return w, seal, kv


def probe_a_block_loads_only_under_its_own_tag() -> None:
    """A get that read a whole object is loaded only if its trailer's tag matches the bytes now in the
    block and the key it was read under: a changed byte, or a trailer of another key, is a load error."""
    from kvledger_connector.store.contract import StoreCode

    w, seal, _kv = integrity_case()
    whole = [w.key_bytes, w.key_bytes]
    got = drain(w, w._verified(0, ["k1", "k2"], [1, 2], whole))
    check(got == [w.key_bytes, int(StoreCode.INTEGRITY_MISMATCH)],
          f"block 2 changed after its tag: the get's codes became {got}, not [{w.key_bytes}, INTEGRITY_MISMATCH]")
    seal.seal(0, ["k1", "k2"], [1, 1])  # block 1's bytes sealed under two keys
    got = drain(w, w._verified(0, ["k2", "k1"], [1, 1], whole))
    check(got == [int(StoreCode.INTEGRITY_MISMATCH)] * 2, f"trailers read under each other's key gave {got}")
    missed = int(StoreCode.OBJECT_NOT_FOUND)
    got = drain(w, w._verified(0, ["k1", "k2"], [1, 1], [missed, w.key_bytes]))  # the get's first key missed
    check(got == [missed, w.key_bytes], f"the second key of a get whose first missed gave {got}, not "
                                        f"[{missed}, {w.key_bytes}]: checked against another key's trailer row")


def probe_a_mismatched_object_is_removed_and_only_it() -> None:
    """Integrity on: a get that read a whole object whose tag does not match (block 2's bytes changed after
    it was tagged) is a load error of that block, and that key, only that one, is removed from the store,
    by force (a reader's lease must not keep it: while it exists no save replaces it), by the store's own
    thread (`take_removals`, removed through the edge), never inline by the load (a sync load runs on the model runner's thread).
    The good block loads, its key and the others stay."""
    w, _seal, _kv = integrity_case()
    st: ProbeStore = io_of(w).store
    st.data.update({"k1": 1, "k2": 2, "k3": 3})  # k3: a key of no load here
    st.get_codes.update({"k1": w.key_bytes, "k2": w.key_bytes})  # both read whole
    st.leased.add("k2")
    lid = w.begin_load("r", [1, 2])
    drain(w, w.load_batch(lid, ["k1", "k2"], [1, 2]))
    res = w.finish_load(lid, "done")
    check(res.loaded == {1} and res.failed == {2},
          f"block 2 failed its tag: loaded {sorted(res.loaded)}, failed {sorted(res.failed)}")
    errs = w.take_load_errors()
    check(errs == {2}, f"load errors reported {sorted(errs)}, expected [2]")
    inline = [keys[0] for fn, keys in st.calls if fn == "remove"]
    check(inline == [], f"the load itself removed {inline} (on the loading thread: the model runner's for a "
                        f"sync load), not the store thread")
    io_of(w).remove(w.take_removals())  # what the store thread runs
    removed = [keys[0] for fn, keys in st.calls if fn == "remove"]
    check(removed == ["k2"], f"after k2's integrity mismatch the worker removed {removed}, expected ['k2']")
    check("k2" not in st.data, "the mismatched object is still in the store (a reader's lease kept it)")
    check("k1" in st.data and "k3" in st.data, f"a good object was removed: the store holds {sorted(st.data)}")
    n = w.stats.total("integrity_mismatches")
    check(n == 1, f"integrity_mismatches={n}, expected 1")


PROBES: list[Probe] = [
    probe_every_layout_reads_each_block_exactly, probe_keys_separate_shards_stages_and_layouts,
    probe_replicas_put_each_key_once, probe_only_identical_kv_shares_a_key,
    probe_partial_tail_keys_name_the_tail_tokens, probe_reset_pattern_matches_exactly_the_engines_keys,
    probe_runtime_dir_refuses_what_is_not_private, probe_sweep_keeps_live_owners,
    probe_a_block_loads_only_under_its_own_tag, probe_a_mismatched_object_is_removed_and_only_it,
]
