"""Store keys: what a KV block is stored under.

A key must name the bytes exactly, or two writers that disagree on what a block holds would share a key
and one would load the other's KV (S1 NoPollution across deployments). So a key carries everything that
changes the bytes of a block on this rank, plus the block's content hash:

    [<namespace>/]kvl2/<model, readable>/<layout digest>/tp<r>of<n>-pp<p>of<m>/<block hash hex>
          |                 |                 |                    `-- vLLM's chained block hash
          |                 |                 `-- tensor-parallel shard (each rank stores its own heads;
          |                 |                     `tp<first>+<k>of<n>`: the k ranks from <first> hold
          |                 |                     identical KV and share the key; `kvh<first>+<k>of<h>` in
          |                 |                     the TP-shared layout: k of the model's h KV heads, the same
          |                 |                     key at every TP size) and pipeline stage (each stage its
          |                 |                     own layers)
          |                 `-- sha256 over (model, model_hash, block_size, dtype, kv_layout,
          |                     num_layers, num_kv_heads, head_size, extra: the KV cache spec,
          |                     integrity: the object's trailer and secret's fingerprint):
          |                     different models, weights, layouts or integrity modes never collide
          `-- for humans reading `batch_is_exist` logs; never relied on for uniqueness

`model_hash` is the model's identity beyond its name (`engine_facts.model_identity`): vLLM's own hash of
the model config (revision, quantization, dtype, overrides, the weights' path, max_model_len, ...), the block
hash algorithm and the operator's `weights_version`. Two engines serving one path with different weights,
quantization or overrides never share a key; engines differing in any field vLLM hashes are kept apart too,
even where the KV would match (e.g. only `max_model_len`): a missed share, never a wrong load.

The object's byte order is the resolved `KVCacheLayout`'s own (kvledger_connector/shape/kvlayout.py), so the layout
name is in the digest: engines with different physical layouts never share a key (they would read each
other's bytes in the wrong order); engines that differ only in the attention backend's kernel block size
share keys (a split block is stored in token order). `kvl1` keys (the pre-0.32 object format) are never
read: a new version string, not a silent reinterpretation.

Identical KV is stored once: with MLA every TP rank holds the same latent, and with more TP ranks than
the model's KV heads vLLM replicates each head on consecutive ranks. Those `kv_replicas` ranks share one
key per block, and each key is put by exactly one of them (`kvledger.put_positions`); every one of them
loads every key, and the scheduler's lookup asks each shared key once.

The TP-shared layout (`kv_heads_per_key` = k, opt-in) keys a block by KV-head shard instead: a key holds k
of the model's KV heads (the block's elements of those heads, in the layout's physical order), and names
them, so engines at any TP size whose ranks hold whole shards (k divides the heads per rank) put and load
the same keys; a rank holding h heads has h/k keys per block. The digest names k, not the rank's heads.

A namespace (`StoreConfig.namespace`, upstream's ``cache_prefix``) lets tenants share one store: it is the
first component, made of ``[A-Za-z0-9._-]`` (no ``/``), so a namespaced key has one more ``/`` than a key
without one and two different namespaces differ in the first component: no two namespaces (or none) ever
share a key, and one namespace's keys are the ones matching ``^<namespace>/``.

Mooncake accepts long keys, but a deployment may cap them (`max_key_bytes`): `KeyTooLongError` is raised by
`check_key`, and `split_by_length` lets the load path report oversized keys' blocks instead of crashing.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

KEY_VERSION = "kvl2"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")


class KeyTooLongError(ValueError):
    """A store key is longer than `max_key_bytes`; names the key's length, the cap and the key's head."""

    def __init__(self, key: str, max_key_bytes: int) -> None:
        self.key, self.max_key_bytes = key, max_key_bytes
        n = len(key.encode())
        super().__init__(f"store key of {n} bytes exceeds max_key_bytes={max_key_bytes}: {key[:80]!r}...")


@dataclass(frozen=True)
class KeyLayout:
    """Everything that changes a stored block's bytes on one rank, besides its tokens."""

    model: str
    tp_rank: int
    tp_size: int
    block_size: int
    dtype: str  # e.g. "torch.bfloat16", "fp8_e4m3"
    kv_layout: str  # the resolved KVCacheLayout name, e.g. "LBNHC"
    num_layers: int  # the model's layers (all stages)
    num_kv_heads: int  # head slots on this shard
    head_size: int
    extra: tuple[tuple[str, str], ...] = field(default=())  # the rest of the spec (kind, content bytes, quant)
    pp_rank: int = 0
    pp_size: int = 1
    model_hash: str = ""  # the model's identity beyond its name (engine_facts.model_identity)
    kv_replicas: int = 1  # consecutive TP ranks holding this rank's KV byte for byte (engine_facts.kv_replicas)
    integrity: str = ""  # the object's trailer (`IntegrityKey.key_tag`); "": none, the older object format
    # the TP-shared layout (`kv_heads_per_key`): (the model's first KV head in this key, the model's KV heads);
    # the key then names those heads, not a TP shard, and holds `num_kv_heads` of them. (): a key per TP shard
    heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"KeyLayout.model={self.model!r}: must be a non-empty string")
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise ValueError(f"KeyLayout.tp_size={self.tp_size!r}: must be an int >= 1")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"KeyLayout.tp_rank={self.tp_rank!r}: must be in 0..tp_size-1 ({self.tp_size - 1})")
        if not (isinstance(self.pp_size, int) and self.pp_size >= 1):
            raise ValueError(f"KeyLayout.pp_size={self.pp_size!r}: must be an int >= 1")
        if not (isinstance(self.pp_rank, int) and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"KeyLayout.pp_rank={self.pp_rank!r}: must be in 0..pp_size-1 ({self.pp_size - 1})")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KeyLayout.{name}={v!r}: must be an int >= 1")
        kr = self.kv_replicas
        if isinstance(kr, bool) or not isinstance(kr, int) or kr < 1 or self.tp_size % kr:
            raise ValueError(f"KeyLayout.kv_replicas={kr!r}: must be an int >= 1 dividing tp_size={self.tp_size}")
        if self.heads != ():
            h = self.heads
            if (not isinstance(h, tuple) or len(h) != 2 or any(x.__class__ is not int for x in h)
                    or not 0 <= h[0] < h[1] or h[0] % self.num_kv_heads or h[0] + self.num_kv_heads > h[1]):
                raise ValueError(f"KeyLayout.heads={h!r}: must be (first head, total heads) with first a multiple "
                                 f"of num_kv_heads={self.num_kv_heads} and first + num_kv_heads <= total")
        if not isinstance(self.integrity, str):
            raise ValueError(f"KeyLayout.integrity={self.integrity!r}: must be a string")
        if not isinstance(self.model_hash, str):
            raise ValueError(f"KeyLayout.model_hash={self.model_hash!r}: must be a string")
        for name in ("dtype", "kv_layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"KeyLayout.{name}={getattr(self, name)!r}: must be a non-empty string")

    @cached_property
    def _extras(self) -> dict[str, str]:
        """`extra` as a mapping, built once: the lookup reads a builder's window and kind every time."""
        return dict(self.extra)

    @property
    def window(self) -> int | None:
        """A hybrid model's sliding-window group: the tokens vLLM keeps behind a position
        (engine_facts.KVGroup.window, in `extra`); None for full attention."""
        return int(self._extras.get("window", "0")) or None

    @property
    def is_state(self) -> bool:
        """A Mamba group in vLLM's "align" mode (`extra`): its key at block p holds the state after
        (p + 1) * block_size tokens, not KV of that block's tokens."""
        return self._extras.get("state") == "align"

    @property
    def group(self) -> int:
        """A hybrid model's KV cache group this key layout stores (`extra`); 0 for one group."""
        return int(self._extras.get("group", "0"))

    @property
    def replica(self) -> int:
        """This rank's index among the ranks sharing its keys (which of their keys it puts)."""
        return self.tp_rank % self.kv_replicas

    @property
    def shard(self) -> str:
        """The key's tensor-parallel component: this rank's, or its replica group's; in the TP-shared
        layout the KV heads it holds (``kvh<first>+<count>of<total>``), whatever the TP size."""
        if self.heads:
            return f"kvh{self.heads[0]}+{self.num_kv_heads}of{self.heads[1]}"
        if self.kv_replicas == 1:
            return f"tp{self.tp_rank}of{self.tp_size}"
        return f"tp{self.tp_rank - self.replica}+{self.kv_replicas}of{self.tp_size}"

    def digest(self) -> str:
        """16 hex chars of sha256 over a canonical encoding of every field except the shard and stage."""
        fields: list[object] = [self.model, self.model_hash, self.block_size, self.dtype, self.kv_layout,
                                self.num_layers, self.num_kv_heads, self.head_size, sorted(self.extra)]
        if self.integrity:  # objects with a trailer are other bytes: never under a key of the older format
            fields.append(["integrity", self.integrity])
        canon = json.dumps(fields, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


#: a reset epoch's length in hex characters (128 random bits: no two resets anywhere draw the same one)
RESET_EPOCH_HEX = 32
_RESET_EPOCH = re.compile(rf"[0-9a-f]{{{RESET_EPOCH_HEX}}}")


def new_reset_epoch() -> str:
    """A fresh reset epoch: a reset that keeps the weights version moves the keys to it, so an object stored
    before the reset (or read then and put back after it by another client: first writer wins) is under a
    key the engine never builds again (kvledger_connector/scheduler/reset.py)."""
    return secrets.token_hex(RESET_EPOCH_HEX // 2)


def is_reset_epoch(epoch: object) -> bool:
    """Whether `epoch` is "" (no reset yet) or one `new_reset_epoch` could return."""
    return epoch == "" or (isinstance(epoch, str) and _RESET_EPOCH.fullmatch(epoch) is not None)


def _hash_hex(block_hash: bytes | int | str) -> str:
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        if len(block_hash) == 0:
            raise ValueError("block hash is empty")
        return bytes(block_hash).hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        if block_hash < 0:  # Python's hash() may be negative; keep the sign unambiguous
            return "n" + format(-block_hash, "x")
        return format(block_hash, "x")
    if isinstance(block_hash, str) and re.fullmatch(r"[0-9a-f]+", block_hash):
        return block_hash
    raise ValueError(f"block hash {block_hash!r}: must be bytes, int or lowercase hex str")


def partial_tail_hash(parent_hash: bytes | int | str, tokens: Sequence[int]) -> bytes:
    """The hash a prompt's partial last block is stored under: sha256 over a domain tag, the hash of the
    full block before it (vLLM's chained hash: the whole prefix, its cache salt and LoRA) and the tail's
    token ids. 32 bytes like vLLM's sha256 block hashes; the tag keeps it apart from every full block's
    hash, and the token count is in the encoding, so tails of different lengths never share a key."""
    ids = [int(t) for t in tokens]
    if not ids:
        raise ValueError("partial tail is empty")
    if any(t < 0 or t >= 1 << 32 for t in ids):
        raise ValueError(f"partial tail token ids must be in 0..2**32-1, got {[t for t in ids if t < 0 or t >= 1 << 32][:4]}")
    h = hashlib.sha256(b"kvledger-partial-tail\0")
    h.update(_hash_hex(parent_hash).encode())
    h.update(len(ids).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in ids))
    return h.digest()


class KeyBuilder:
    """Builds the keys of one rank's blocks. Cheap: the prefix is computed once."""

    def __init__(self, layout: KeyLayout, max_key_bytes: int = 512, namespace: str = "") -> None:
        if not isinstance(namespace, str) or not (namespace == "" or _NAMESPACE.fullmatch(namespace)):
            raise ValueError(f"namespace={namespace!r}: must be '' or 1-64 characters of A-Z a-z 0-9 . _ -")
        self.layout = layout
        self.max_key_bytes = max_key_bytes
        self.namespace = namespace
        readable = _UNSAFE.sub("_", layout.model)[:48]
        self.prefix = (f"{namespace + '/' if namespace else ''}"
                       f"{KEY_VERSION}/{readable}/{layout.digest()}/{layout.shard}"
                       f"-pp{layout.pp_rank}of{layout.pp_size}/")

    def key(self, block_hash: bytes | int | str) -> str:
        """The key of one block. Not length-checked: call `check_key` or `split_by_length`."""
        return self.prefix + _hash_hex(block_hash)

    def keys(self, block_hashes: Sequence[bytes | int | str]) -> list[str]:
        return [self.prefix + _hash_hex(h) for h in block_hashes]

    def fits(self, key: str) -> bool:
        return len(key.encode()) <= self.max_key_bytes

    def check_key(self, key: str) -> str:
        """`key` itself, or `KeyTooLongError`."""
        if not self.fits(key):
            raise KeyTooLongError(key, self.max_key_bytes)
        return key

    def split_by_length(self, keys: Sequence[str]) -> tuple[list[int], list[int]]:
        """(indices of keys that fit, indices of oversized keys) — the caller reports the latter's blocks."""
        ok: list[int] = []
        bad: list[int] = []
        for i, k in enumerate(keys):
            (ok if self.fits(k) else bad).append(i)
        return ok, bad
