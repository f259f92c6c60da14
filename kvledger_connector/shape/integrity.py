"""Integrity of stored blocks: every object carries a tag over its bytes, checked before a load reports
the block loaded. A mismatch is a load error (vLLM's ``kv_load_failure_policy`` acts), never wrong KV.

The object under a key is the block's bytes (kvledger_connector/shape/kvlayout.py) followed by a trailer::

    | block bytes (P0) | "KVLTAG01" | nonce (8 bytes) | tag (64 bytes) |
                         `------------ TRAILER_BYTES = 80 -----------'

Every tag covers ``bind(key, nonce) = utf8(key) || 0x00 || nonce`` besides the bytes: a tag holds only under
its own key, and the nonce, random per put, makes each put's tag input its own (equal keys written twice, with
bit-different KV since GPU kernels need not be bitwise deterministic, share nothing a forger could combine).
A whole object replayed under its own key still loads: it is what an engine holding the key stored there.

Three constructions; `construction_for` picks one by where the KV cache lives and the mode, and `key_tag` puts
it in every key's layout digest, so engines using different ones never share a key (neither fails every load
on the other's objects):

* ``b3``, KV in host memory: ``tag = BLAKE3-keyed_hash(K, bind(key, nonce) || block bytes)``, 64 bytes of
  its extended output, ``K = BLAKE3-derive_key(B3_CONTEXT, mode || 0x00 || secret)``. Keyed BLAKE3 is a PRF,
  so a MAC under K. `BlockSeal` computes it where the block lies, run by run from numpy views of the KV
  cache, on the calling thread: no torch call (it would share the engine's OpenMP threads) and no copy, in
  updates of at most PIECE_BYTES (a run of a block, usually), where `blake3` hashes at 4-5 GB/s.
* ``x3``, KV in host memory under ``checksum`` (which has no secret, so needs no MAC): ``tag =
  XXH3-128(bind(key, nonce) || block bytes)`` (PyPI `xxhash`), its 16 bytes then 48 zero bytes (the trailer
  keeps one size). A fast non-cryptographic hash, enough for what ``checksum`` promises (bytes changed by
  accident, a block under another key) and no more; computed as ``b3`` is, at several times BLAKE3's rate.
* ``mm8``, KV on a GPU (written for tensor cores; the bytes never cross to the host), the definition
  `reference_digest` gives in numpy and `BlockSeal` computes with torch on the KV cache's device:

      b     the block's bytes as int8, zero-padded to P = ceil(P0 / CHUNK) * CHUNK
      h     h[c, l] = sum_j b[c*CHUNK + j] * A[j, l]          exact in int32 (|h| < 2**23)
      T     T[l]   = sum_c U[c, l] * h[c, l]   mod 2**64
      tag   tag[l] = T[l] + pad[l]             mod 2**64,  8 lanes x uint64, little-endian

  ``A`` (int8, CHUNK x LANES) and ``U`` (int64 per chunk and lane) are drawn by SHAKE-256 from the mode and
  the secret; ``pad = HMAC-SHA512(secret, bind(key, nonce))``, a one-time pad per put (the nonce is random),
  so no pad is used twice. Cost: one gather, one int8 matmul (``torch._int_mm``; a float32 matmul, exact for
  these ranges, where it is not available), one int64 multiply-sum over 1/64 of the bytes: each a pass over
  HBM (TB/s) while the block crosses a NIC or PCIe (tens of GB/s). On a CPU it runs at ~2 GB/s, which is
  why host KV uses ``b3`` (scripts/gpu-check.sh checks and times it on CUDA).

Modes (the same for both constructions):

* ``checksum`` (the default only with a configured master and no secret file, said once at start-up):
  the secret is empty, so anyone can compute a tag (under ``x3`` no key at all, under ``b3`` K is a fixed
  public constant). It catches
  bytes changed in the store, a torn transfer, a block stored under another block's key, and a client that
  overwrites a value with bytes of its own, unless it recomputes the tag on purpose.
* ``mac`` (the default where the connector starts the store; `IntegrityKey.resolve`): a secret from
  ``integrity_secret_file``, or one generated per engine in its private runtime directory
  (kvledger_connector/store/rendezvous.py `engine_secret`). A client without it cannot make a value that loads:
  under ``b3`` it must forge keyed BLAKE3 under a 256-bit key it cannot derive (BLAKE3 targets 128-bit
  security; a guessed 64-byte tag is right with probability 2**-512); under
  ``mm8``, for a changed value under an existing nonce, guess per lane a first-level hash that is zero with
  probability at most 2**-8 or the second-level sum mod 2**64, for a new nonce the pad: about 2**-64 per
  attempt. Bytes are not encrypted: the store still shows them to whoever can read it.
* ``off``: no trailer (the object format of earlier versions, under the same keys); each process says so
  once, as a warning naming the setting.

An operator's secret file must be 32..4096 bytes with at least 8 distinct byte values and no repeating
pattern (`weak_secret`): the key tag's fingerprint of the secret is public (it is in every key), so a short
or patterned secret is found offline by trying candidates against it. The check cannot tell a chosen phrase
from random bytes: make the file with ``head -c 32 /dev/urandom``.

The mode, the construction and a fingerprint of the secret are in every key's layout digest (`key_tag`).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from blake3 import blake3

from kvledger.errors import LedgerError, LedgerInputError
from kvledger_connector.config import integrity_mode
from kvledger_connector.shape.kvlayout import BlockCopyPlan, KVLayoutError
from kvledger_connector.ownfile import read_own_file
from kvledger_connector.shape.tagkernel import CHUNK, LANES, gather_rows, mm8_digests, mm8_digests_few

logger = logging.getLogger(__name__)

MODES = ("checksum", "mac", "off")
#: the tag constructions, by the version they write into the key tag (`IntegrityKey.key_tag`)
CONSTRUCTIONS = {"b3": "b3", "mm8": "1", "x3": "x3"}
#: the constructions computed by the host's cores, block by block (the others: `BlockSeal.digests`, in torch)
HOST_HASHED = ("b3", "x3")
MAGIC = b"KVLTAG01"
NONCE_BYTES = 8
TAG_BYTES = 64
X3_DIGEST_BYTES = 16  # x3: XXH3-128's digest, then zero bytes to TAG_BYTES
TRAILER_BYTES = len(MAGIC) + NONCE_BYTES + TAG_BYTES
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 32, 4096
MIN_SECRET_DISTINCT = 8  # distinct byte values a secret file holds at least (`weak_secret`)
FEW_BLOCKS = 16  # mm8: up to this many blocks per call, one TorchScript call computes the tags (`BlockSeal.digests`)
#: b3: a BLAKE3 derive_key context (hard-coded, globally unique, this use only)
B3_CONTEXT = "kvledger 2025-06 integrity tag key v1"
_MASK = (1 << 64) - 1
#: said once at start-up when an engine runs 'checksum' (`IntegrityKey.resolve` chose it or the operator did)
CHECKSUM_ONLY = ("integrity 'checksum': a stored block's tag detects corruption and a block under another key, "
                 "but not a forger: any client of this Mooncake master can recompute it. Set integrity_secret_file "
                 "(32-4096 random bytes, mode 0600, the same file on every engine sharing the store) to run 'mac'")


#: b3, x3: the most bytes one hash update is given. `blake3` releases the GIL from 2 KiB on, `xxhash` past
#: 64 KiB; a release waits for the GIL back only while another thread runs Python without letting go, which
#: vLLM's engine thread did when it spun through empty steps while every request waited for its load (a
#: load's 394 blocks waited 1.1 s for the GIL in 16 KiB updates). Such a step now sleeps until a result comes
#: (kvledger_connector/worker/side.py `IDLE_WAIT_S`), so updates are as large as a run: `blake3` hashes at
#: about 1 GB/s in 2047-byte updates, 4-5 GB/s in 16-64 KiB ones, which is what `mac` costs on host KV
PIECE_BYTES = {"x3": 64 << 10, "b3": 64 << 10}


class IntegrityError(LedgerError):
    """A trailer slot was asked for with none free (more concurrent store calls than the seal was sized for)."""


def construction_for(device_type: str, mode: str = "mac") -> str:
    """The tag construction for a KV cache on ``device_type`` (vLLM's ``device_config.device_type``) under
    ``mode``: in host memory, where the cores compute it, ``x3`` for 'checksum' (no secret to key a hash
    with) and ``b3`` for 'mac'; ``mm8`` on an accelerator, where it runs on the device."""
    if device_type != "cpu":
        return "mm8"
    return "x3" if mode == "checksum" else "b3"


def weak_secret(blob: bytes) -> str | None:
    """Why `blob` is too easy to guess from the public fingerprint of it in every key, or None: fewer than
    MIN_SECRET_DISTINCT distinct byte values (one byte repeated, a digit string), or a shorter pattern
    repeated. Random bytes pass with certainty; a chosen phrase may pass too (this is no entropy meter)."""
    distinct = len(set(blob))
    if distinct < MIN_SECRET_DISTINCT:
        return f"uses {distinct} distinct byte values (at least {MIN_SECRET_DISTINCT})"
    for period in range(1, len(blob) // 2 + 1):
        if blob[period:] == blob[:-period]:
            return f"repeats a {period}-byte pattern"
    return None


def read_secret(path: str) -> bytes:
    """The deployment secret: a regular file owned by this user, readable by no one else, of
    MIN_SECRET_BYTES..MAX_SECRET_BYTES bytes that are not `weak_secret`; opened without following a link."""
    blob = read_own_file("integrity_secret_file", path, max_bytes=MAX_SECRET_BYTES, private=True)
    make = "(e.g. `head -c 32 /dev/urandom`)"
    if not MIN_SECRET_BYTES <= len(blob) <= MAX_SECRET_BYTES:
        raise LedgerInputError("integrity_secret_file", path, f"holds {len(blob)} bytes; a secret is "
                               f"{MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes {make}")
    weak = weak_secret(blob)
    if weak is not None:
        raise LedgerInputError("integrity_secret_file", path, f"{weak}: too weak against an offline guess from "
                               f"the secret's fingerprint in every key; use random bytes {make}")
    return blob


_off_warned = threading.Event()


def _warn_off() -> None:
    """Once per process: with no tags, a changed or misplaced object is loaded as it is."""
    if not _off_warned.is_set():
        _off_warned.set()
        logger.warning("integrity 'off': stored blocks carry no tag, so bytes changed in the store, torn "
                       "transfers and blocks under another block's key are loaded unchecked into the KV cache; "
                       "unset integrity (or set 'mac') to check them")


@dataclass(frozen=True)
class IntegrityKey:
    """The mode, the secret and the construction: what a tag is computed with (the same on every rank and
    engine that shares keys). ``construction`` defaults to host memory's for the mode (`construction_for`);
    the connector takes it from the engine's device (`resolve`)."""

    mode: str = "checksum"
    secret: bytes = field(default=b"", repr=False)
    construction: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LedgerInputError("integrity", self.mode, f"must be one of {MODES}")
        if not self.construction:
            object.__setattr__(self, "construction", construction_for("cpu", self.mode))
        if (self.mode == "mac") != bool(self.secret):
            raise LedgerInputError("integrity_secret_file", "<set>" if self.secret else None,
                                   f"a secret is needed by integrity 'mac' and only by it (integrity={self.mode!r})")
        if self.construction not in CONSTRUCTIONS:
            raise LedgerInputError("construction", self.construction, f"must be one of {sorted(CONSTRUCTIONS)}")
        if self.construction == "x3" and self.mode == "mac":
            raise LedgerInputError("construction", self.construction, "takes no key: integrity 'mac' needs b3 or mm8")

    @classmethod
    def of(cls, mode: str | None, secret_file: str | None) -> IntegrityKey:
        mode = mode or "checksum"
        if mode == "mac" and not secret_file:
            raise LedgerInputError("integrity_secret_file", secret_file, "required by integrity 'mac'")
        if mode != "mac" and secret_file:
            raise LedgerInputError("integrity_secret_file", secret_file,
                                   f"set with integrity={mode!r}; a secret is used only by 'mac'")
        return cls(mode, read_secret(secret_file) if secret_file else b"")

    @classmethod
    def resolve(cls, mode: str | None, secret_file: str | None, *, embedded: bool,
                generated: Callable[[], bytes], device: str) -> IntegrityKey:
        """The engine's key by `config.integrity_mode`: the operator's secret file, else under 'mac' the
        engine's generated secret (``generated()``, asked only then), else no secret; the construction for
        a KV cache on ``device`` (`construction_for`)."""
        mode = integrity_mode(mode, secret_file, embedded=embedded)
        how = construction_for(device, mode)
        if mode == "off":
            _warn_off()
        if mode != "mac":
            return cls(mode, construction=how)
        return cls(mode, read_secret(secret_file) if secret_file is not None else generated(), how)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def key_tag(self) -> str:
        """What goes into every key's layout digest: '' (off: the old object format), 'ck' or 'mac' with the
        construction's version ('ck1', 'ckb3', 'ckx3'), and under 'mac' '-' and 16 hex chars of an HMAC of the secret
        (not the secret: the digest is public)."""
        if self.mode == "off":
            return ""
        version = CONSTRUCTIONS[self.construction]
        if self.mode == "checksum":
            return f"ck{version}"
        fp = hmac.new(self.secret, b"kvledger key tag v1", hashlib.sha256).hexdigest()[:16]
        return f"mac{version}-{fp}"

    def bind(self, key: str, nonce: bytes) -> bytes:
        """What every tag covers besides the bytes: the key it holds under and its put's nonce (fixed length,
        last, so the split is unambiguous)."""
        return key.encode() + b"\0" + nonce

    @property
    def b3_key(self) -> bytes:
        """b3's K: BLAKE3 derive_key of the mode and the secret (under 'checksum' a public constant)."""
        return blake3(self.mode.encode() + b"\0" + self.secret, derive_key_context=B3_CONTEXT).digest()

    def material(self, num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """mm8's (A: int8 [CHUNK, LANES], U: uint64 [num_chunks, LANES]); U's rows do not depend on num_chunks."""
        shake = hashlib.shake_256(b"kvledger-integrity-v1\0" + self.mode.encode() + b"\0" + self.secret)
        na = CHUNK * LANES
        blob = shake.digest(na + num_chunks * LANES * 8)
        a = np.frombuffer(blob[:na], dtype=np.int8).reshape(CHUNK, LANES)
        u = np.frombuffer(blob[na:], dtype="<u8").reshape(num_chunks, LANES)
        return a, u

    def pad(self, key: str, nonce: bytes) -> np.ndarray:
        """mm8's one-time pad of a (key, nonce): uint64 [LANES]. Under 'checksum' the secret is empty: anyone
        can compute it, and it still binds the tag to its key (a block stored under another key fails)."""
        mac = hmac.new(self.secret, self.bind(key, nonce), hashlib.sha512).digest()
        return np.frombuffer(mac, dtype="<u8").astype(np.uint64)


# ---------------------------------------------------------------------- the definitions (no torch)
def reference_digest(obj: bytes, ikey: IntegrityKey) -> list[int]:
    """mm8's T in numpy and Python integers, no torch (slow; what `BlockSeal.digests` is tested against)."""
    n = -(-len(obj) // CHUNK)
    b = np.frombuffer(obj + bytes(n * CHUNK - len(obj)), dtype=np.int8).astype(np.int64).reshape(n, CHUNK)
    a, u = ikey.material(n)
    h = b @ a.astype(np.int64)  # exact: |h| < 2**23
    return [sum(int(u[c, l]) * int(h[c, l]) for c in range(n)) & _MASK for l in range(LANES)]


def _mm8_tag(ikey: IntegrityKey, key: str, digest: Sequence[int], nonce: bytes) -> bytes:
    return (np.asarray([int(d) for d in digest], dtype=np.uint64) + ikey.pad(key, nonce)).astype("<u8").tobytes()


def reference_tag(obj: bytes, ikey: IntegrityKey, key: str, nonce: bytes) -> bytes:
    """The TAG_BYTES of object bytes ``obj`` under ``key`` and ``nonce``: the module's definition, on the
    whole object at once (what `BlockSeal.tags` is tested against on every layout)."""
    if ikey.construction == "b3":
        return blake3(ikey.bind(key, nonce) + obj, key=ikey.b3_key).digest(TAG_BYTES)
    if ikey.construction == "x3":
        return xxhash.xxh3_128_digest(ikey.bind(key, nonce) + obj).ljust(TAG_BYTES, b"\0")
    return _mm8_tag(ikey, key, reference_digest(obj, ikey), nonce)


def reference_trailer(obj: bytes, ikey: IntegrityKey, key: str, nonce: bytes) -> bytes:
    """The TRAILER_BYTES that follow ``obj`` under ``key`` (what a client that knows the key could write)."""
    return MAGIC + nonce + reference_tag(obj, ikey, key, nonce)


# ---------------------------------------------------------------------- torch: where the KV cache lives
def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


@dataclass(frozen=True)
class _Group:
    """Segments of one storage with one size and stride, at an even spacing: one [blocks, count, nbytes] view."""

    view: torch.Tensor
    offset: int  # in the object
    nbytes: int  # count * segment bytes


class BlockSeal:
    """Tags of a rank's blocks, computed where its KV cache lives, and the trailer slots the store calls use.

    ``slots`` trailer slots of ``max_keys`` rows each, one per thread that may be inside a put or a get at
    once (the store thread, the load threads, the step's sync load): `slot` takes one for a call, and with
    it that slot's staging rows.

    One copy plan per part of a block (`BlockShape`: a hybrid model's KV cache groups, the TP-shared layout's
    head shards; equal block bytes), and the calls name each block's part (``parts``, default part 0), whose
    views its tag is computed from."""

    def __init__(self, ikey: IntegrityKey, plan: BlockCopyPlan | Sequence[BlockCopyPlan],
                 kv_caches: Mapping[str, Any], *, slots: int, max_keys: int) -> None:
        if not ikey.enabled:
            raise LedgerInputError("integrity", ikey.mode, "a BlockSeal needs 'checksum' or 'mac'")
        for name, v in (("slots", slots), ("max_keys", max_keys)):
            if v.__class__ is not int or v < 1:
                raise LedgerInputError(name, v, "must be an int >= 1")
        self.ikey = ikey
        plans = [plan] if isinstance(plan, BlockCopyPlan) else list(plan)
        if not plans or len({p.block_bytes for p in plans}) != 1:
            raise KVLayoutError(f"integrity: {len(plans)} copy plans of block bytes "
                                f"{sorted({p.block_bytes for p in plans})}: one size for every group")
        self.block_bytes = plans[0].block_bytes
        self.num_blocks = plans[0].num_blocks
        self.max_keys = max_keys
        flats: dict[int, torch.Tensor] = {}
        device = None
        for t in kv_caches.values():
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                flats.setdefault(st.data_ptr(), torch.empty(0, dtype=torch.int8, device=t.device).set_(st))
                device = t.device
        if device is None:
            raise KVLayoutError("integrity: no KV cache tensors to read blocks from")
        self.device = device
        self._segs = [self._group(p, flats) for p in plans]  # per part of a block
        self._views = [[g.view for g in segs] for segs in self._segs]
        self._offsets = [[g.offset for g in segs] for segs in self._segs]
        self.num_chunks = -(-self.block_bytes // CHUNK)
        self._arena = torch.zeros((slots, max_keys, TRAILER_BYTES), dtype=torch.uint8, device=device)
        # a partial tail's copies: one per part of a block (a job puts one tail block); mm8 reads the zero padding
        self._staging = torch.zeros((slots, len(plans), self.num_chunks * CHUNK), dtype=torch.int8, device=device)
        self._arena_np = self._arena.numpy() if device.type == "cpu" else None  # the same memory
        self._free: queue.Queue[int] = queue.Queue(maxsize=slots)
        for i in range(slots):
            self._free.put_nowait(i)
        self.trailer_bytes = TRAILER_BYTES
        if ikey.construction in HOST_HASHED:
            if device.type != "cpu":
                raise KVLayoutError(f"integrity: construction {ikey.construction!r} hashes host memory; the KV "
                                    f"cache is on {device.type}")
            self._b3_key = ikey.b3_key if ikey.construction == "b3" else b""
            self._piece_bytes = PIECE_BYTES[ikey.construction]
            # each part's runs as numpy views [blocks, count, bytes] of the KV cache: hashed where they lie
            self._np_views = [[g.view.numpy() for g in segs] for segs in self._segs]
        else:
            a, u = ikey.material(self.num_chunks)
            self._a = torch.from_numpy(a.copy()).to(device)
            self._u = torch.from_numpy(u.view(np.int64).copy()).to(device)
            # the first calls compile and profile the TorchScript graph and set up the int8 kernel (tens of
            # ms): paid here, at start-up, on vLLM's null block 0, not by the first loads while the engine serves
            for n in (1, 2, FEW_BLOCKS + 1):
                self.digests([0] * n)

    @staticmethod
    def _group(plan: BlockCopyPlan, flats: Mapping[int, torch.Tensor]) -> list[_Group]:
        spans = sorted(flats.items())
        out: list[_Group] = []
        run: list[Any] = []  # [storage ptr, first base, stride, nbytes, count, spacing, object offset]
        obj = 0

        def close() -> None:
            if run:
                ptr, base, stride, nb, count, spacing, off = run
                flat = flats[ptr]
                view = flat.as_strided((plan.num_blocks, count, nb), (stride, spacing or nb, 1), base - ptr)
                out.append(_Group(view, off, count * nb))

        for seg in plan.segments:
            ptr = next((p for p, t in spans if p <= seg.base and seg.base + seg.nbytes <= p + t.numel()), None)
            if ptr is None:
                raise KVLayoutError(f"integrity: segment at {seg.base:#x} lies in no KV cache storage")
            if run and run[0] == ptr and run[2] == seg.block_stride and run[3] == seg.nbytes and (
                    (run[4] == 1 and seg.base > run[1]) or seg.base == run[1] + run[4] * run[5]):
                if run[4] == 1:
                    run[5] = seg.base - run[1]
                run[4] += 1
            else:
                close()
                run = [ptr, seg.base, seg.block_stride, seg.nbytes, 1, 0, obj]
            obj += seg.nbytes
        close()
        return out

    def _check_part(self, part: int) -> None:
        if part.__class__ is not int or not 0 <= part < len(self._views):
            raise LedgerInputError("part", part, f"not one of this seal's {len(self._views)} parts of a block")

    def _by_part(self, n: int, parts: Sequence[int] | None) -> dict[int, list[int]]:
        """Indices 0..n-1 by part of a block (``parts``: each block's; None: all part 0)."""
        parts = [0] * n if parts is None else parts
        if len(parts) != n:
            raise LedgerInputError("parts", len(parts), f"one per block ({n})")
        out: dict[int, list[int]] = {}
        for i, p in enumerate(parts):
            out.setdefault(p, []).append(i)
        for p in out:
            self._check_part(p)
        return out

    # ------------------------------------------------------------------ tags
    def _gather(self, block_ids: Sequence[int], part: int = 0) -> torch.Tensor:
        """mm8: the blocks' objects, zero-padded to whole chunks: int8 [n, num_chunks * CHUNK] (one call; an
        index_select of these views runs at a fraction of memcpy speed on a CPU)."""
        buf = torch.empty((len(block_ids), self.num_chunks * CHUNK), dtype=torch.int8, device=self.device)
        buf[:, self.block_bytes:].zero_()
        gather_rows(self._views[part], self._offsets[part], [int(b) for b in block_ids], buf)
        return buf

    def _digests(self, buf: torch.Tensor) -> np.ndarray:
        return _host(mm8_digests(buf, self._a, self._u)).view(np.uint64)

    def digests(self, block_ids: Sequence[int], parts: Sequence[int] | None = None) -> np.ndarray:
        """mm8's T of each block (uint64 [n, LANES]), from the KV cache as it is now.

        Every torch call releases the GIL and takes it back, and in an engine whose main thread is busy in
        Python each take can wait out the interpreter's switch interval: a load's latency then grows with
        its count of torch calls, not its bytes (`bench.engine` measured it). Up to FEW_BLOCKS blocks, one
        TorchScript call does it all; a larger batch amortises its calls and takes the faster copies.
        ``parts``: each block's part of a block (default part 0)."""
        if self.ikey.construction != "mm8":
            raise LedgerInputError("construction", self.ikey.construction, "digests are mm8's first level")
        out = np.empty((len(block_ids), LANES), dtype=np.uint64)
        for g, at in self._by_part(len(block_ids), parts).items():
            out[at] = self._digests_of([block_ids[i] for i in at], g)
        return out

    def _digests_of(self, block_ids: Sequence[int], part: int) -> np.ndarray:
        self._check_part(part)
        if len(block_ids) <= FEW_BLOCKS:
            t = mm8_digests_few(self._views[part], [int(b) for b in block_ids], self._a, self._u,
                                self.num_chunks * CHUNK - self.block_bytes)
            return _host(t).view(np.uint64)
        return self._digests(self._gather(block_ids, part))

    def _pieces(self, part: int, block_id: int) -> Iterator[np.ndarray]:
        """Block `block_id`'s object (of part `part`) where it lies in the KV cache, in object order, as
        contiguous byte runs of at most this construction's PIECE_BYTES."""
        size = self._piece_bytes
        for arr in self._np_views[part]:
            blk = arr[block_id]
            for run in ((blk.reshape(-1),) if blk.flags.c_contiguous else blk):
                for at in range(0, run.shape[0], size):
                    yield run[at:at + size]

    def _hash(self, bound: bytes, pieces: Iterable[Any]) -> bytes:
        """One block's host-hashed tag (b3 or x3) over `pieces`, its object's bytes in order, on this thread
        in updates of at most PIECE_BYTES."""
        if self.ikey.construction == "x3":
            x = xxhash.xxh3_128(bound)
            for piece in pieces:
                x.update(piece)
            return x.digest().ljust(TAG_BYTES, b"\0")
        h = blake3(bound, key=self._b3_key)
        for piece in pieces:
            h.update(piece)
        return h.digest(TAG_BYTES)

    def tags(self, slot: int, keys: Sequence[str], nonces: Sequence[bytes], block_ids: Sequence[int],
             parts: Sequence[int] | None = None, rows: Mapping[int, torch.Tensor] | None = None) -> list[bytes]:
        """The TAG_BYTES of each block (of part ``parts``) under its key and nonce, from the KV
        cache as it is now; ``rows``: key index -> a copy of that block's object to tag instead (a partial
        tail's staging row, zero-padded to whole chunks). ``slot``: the caller's (its staging rows)."""
        n = len(keys)
        if len(nonces) != n or len(block_ids) != n:
            raise LedgerInputError("block_ids", len(block_ids), f"one block and one nonce per key ({n} keys, "
                                   f"{len(nonces)} nonces)")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:  # an index would wrap (numpy, torch) and tag another block
            raise LedgerInputError("block_ids", bad[:4], f"not in 0..{self.num_blocks - 1}")
        rows = rows or {}
        out: list[bytes] = [b""] * n
        if self.ikey.construction == "mm8":
            rest = [i for i in range(n) if i not in rows]
            digests = np.empty((n, LANES), dtype=np.uint64)
            if rest:
                digests[rest] = self.digests([block_ids[i] for i in rest],
                                             None if parts is None else [parts[i] for i in rest])
            for i, row in rows.items():
                digests[i] = self._digests(row[None, :])[0]
            return [_mm8_tag(self.ikey, k, d, nc) for k, d, nc in zip(keys, digests, nonces)]
        bind = self.ikey.bind
        parts_of = [0] * n if parts is None else list(parts)
        if len(parts_of) != n:
            raise LedgerInputError("parts", len(parts_of), f"one per block ({n})")
        for i in range(n):
            if i in rows:  # a staged tail: its copy, in pieces
                row = _host(rows[i][:self.block_bytes])
                size = self._piece_bytes
                out[i] = self._hash(bind(keys[i], nonces[i]),
                                    (row[at:at + size] for at in range(0, self.block_bytes, size)))
            else:
                self._check_part(parts_of[i])
                out[i] = self._hash(bind(keys[i], nonces[i]), self._pieces(parts_of[i], int(block_ids[i])))
        return out

    # ------------------------------------------------------------------ trailer slots
    @contextmanager
    def slot(self, num_keys: int) -> Iterator[int]:
        if not 0 <= num_keys <= self.max_keys:
            raise LedgerInputError("num_keys", num_keys, f"a store call of at most max_keys={self.max_keys} keys")
        try:
            i = self._free.get_nowait()
        except queue.Empty:
            raise IntegrityError(f"integrity: every one of {self._free.maxsize} trailer slots is in use") from None
        try:
            yield i
        finally:
            self._free.put_nowait(i)

    def trailer_ptrs(self, slot: int, num_keys: int) -> list[int]:
        base = self._arena[slot].data_ptr()
        return [base + i * TRAILER_BYTES for i in range(num_keys)]

    @property
    def regions(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of the trailer slots and the staging rows, to register with the store once."""
        return [(self._arena.data_ptr(), self._arena.numel()), (self._staging.data_ptr(), self._staging.numel())]

    def seal(self, slot: int, keys: Sequence[str], block_ids: Sequence[int], stages: Sequence[int] = (),
             parts: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """Write the trailers of ``keys`` (block ``block_ids``, of parts ``parts``, default part 0) into ``slot``: their
        pointers, in key order, and for each of ``stages`` (indices into ``keys``: a partial tail's keys, at
        most one per part of a block) the pointer of a copy of that block's object, made from the very bytes
        its tag was computed over. A partial tail block is put from that copy: decode may write the block's
        later token slots while it is read, which would make the bytes sent differ from the tagged ones (the
        slots the key promises never change; the others need not match)."""
        if len(keys) != len(block_ids):
            raise LedgerInputError("block_ids", len(block_ids), f"one block per key ({len(keys)} keys)")
        stages = list(stages)
        if (len(stages) > self._staging.shape[1] or len(set(stages)) != len(stages)
                or any(i.__class__ is not int or not 0 <= i < len(keys) for i in stages)):
            raise LedgerInputError("stages", stages, f"distinct key indices, at most {self._staging.shape[1]} "
                                   f"(one per part of a block)")
        if parts is not None and len(parts) != len(keys):
            raise LedgerInputError("parts", len(parts), f"one per key ({len(keys)} keys)")
        rows: dict[int, torch.Tensor] = {}
        for j, i in enumerate(stages):  # the staged ones are tagged from their copies
            g = 0 if parts is None else parts[i]
            self._check_part(g)
            row = rows[i] = self._staging[slot, j]
            if self.ikey.construction in HOST_HASHED:  # numpy copies: no torch call beside the engine's threads
                dst, at = row.numpy().view(np.uint8), 0
                for piece in self._pieces(g, int(block_ids[i])):
                    dst[at:at + piece.shape[0]] = piece
                    at += piece.shape[0]
            else:
                gather_rows(self._views[g], self._offsets[g], [int(block_ids[i])], row[None, :])
        n = len(keys)
        blob = os.urandom(NONCE_BYTES * n)
        nonces = [blob[i * NONCE_BYTES:(i + 1) * NONCE_BYTES] for i in range(n)]
        tags = self.tags(slot, keys, nonces, block_ids, parts, rows)
        raw = b"".join(MAGIC + nc + t for nc, t in zip(nonces, tags))
        if self._arena_np is not None:  # host memory: written without a torch call
            self._arena_np[slot, :n] = np.frombuffer(raw, dtype=np.uint8).reshape(n, TRAILER_BYTES)
        else:
            self._arena[slot, :n].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(n, TRAILER_BYTES))
        return self.trailer_ptrs(slot, n), [self._staging[slot, j].data_ptr() for j in range(len(stages))]

    def verify(self, slot: int, keys: Sequence[str], block_ids: Sequence[int],
               parts: Sequence[int] | None = None, rows: Sequence[int] | None = None) -> list[bool]:
        """Whether each block read into ``block_ids`` (of parts ``parts``, default part 0) with its trailer in
        ``slot`` matches its tag. ``rows``: each key's trailer row in the slot, where the keys are some of a
        get's (its row is its place in the get); default 0..n-1, the get's keys in order."""
        n = len(keys)
        if not n:
            return []
        at = list(range(n)) if rows is None else [int(r) for r in rows]
        if len(at) != n or any(not 0 <= r < self.max_keys for r in at):
            raise LedgerInputError("rows", list(rows or ()), f"must be {n} trailer rows of a slot of "
                                   f"{self.max_keys}, one per key")
        got = self._arena_np[slot, at] if self._arena_np is not None else self._arena[slot, at].cpu().numpy()
        raws = [row.tobytes() for row in got]
        nonces = [raw[len(MAGIC):len(MAGIC) + NONCE_BYTES] for raw in raws]
        tags = self.tags(slot, keys, nonces, block_ids, parts)
        out = [raw[:len(MAGIC)] == MAGIC and hmac.compare_digest(raw, MAGIC + nc + t)
               for raw, nc, t in zip(raws, nonces, tags)]
        return out
