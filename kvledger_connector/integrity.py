"""Integrity of stored blocks: every object carries a tag over its bytes, checked before a load reports
the block loaded. A mismatch is a load error (vLLM's ``kv_load_failure_policy`` acts), never wrong KV.

The object under a key is the block's bytes (kvledger_connector/kvlayout.py) followed by a trailer::

    | block bytes (P0) | "KVLTAG01" | nonce (8 bytes) | tag: 8 lanes x uint64, little-endian |
                         `------------------ TRAILER_BYTES = 80 -------------------------------'

The tag (`reference_digest` is its definition without torch; `BlockSeal` computes it with torch on the
device the KV cache lives in, and a unit test holds the two equal):

    b     the block's bytes as int8, zero-padded to P = ceil(P0 / CHUNK) * CHUNK
    h     h[c, l] = sum_j b[c*CHUNK + j] * A[j, l]          exact in int32 (|h| < 2**23)
    T     T[l]   = sum_c U[c, l] * h[c, l]   mod 2**64
    tag   tag[l] = T[l] + pad[l]             mod 2**64

``A`` (int8, CHUNK x LANES) and ``U`` (int64 per chunk and lane) are drawn by SHAKE-256 from the mode and
the deployment secret; ``pad`` is HMAC-SHA512(secret, key || nonce), a fresh one-time pad per put (the
nonce is random), so equal keys written twice with bit-different KV (GPU kernels need not be bitwise
deterministic) never reuse a pad, and a tag holds only under its own key.

* ``checksum`` (the default only with a configured master and no secret file, said once at start-up):
  the secret is empty, so anyone can compute a tag. It catches bytes changed
  in the store, a torn transfer, a block stored under another block's key, and a client that overwrites
  a value with bytes of its own, unless it recomputes the tag on purpose.
* ``mac`` (the default where the connector starts the store; `IntegrityKey.resolve`): a secret from
  ``integrity_secret_file``, or one generated per engine in its private runtime directory
  (kvledger_connector/rendezvous.py `engine_secret`). A client without it cannot make a value that loads:
  for a changed value under an existing nonce it must guess, per lane, a first-level hash that is zero
  with probability at most 2**-8 or the second-level sum mod 2**64; for a new nonce, the pad. About
  2**-64 per attempt. Bytes are not encrypted: the store still shows them to whoever can read it.
* ``off``: no trailer (the object format of earlier versions, under the same keys).

The mode and a fingerprint of the secret are in every key's layout digest (`key_tag`): engines with
different modes or secrets never share keys, so none fails every load on the other's objects.

Cost: one gather of the block into a contiguous int8 buffer, one int8 matmul (``torch._int_mm``; a float32
matmul, exact for these ranges, where it is not available), one int64 multiply-sum over 1/64 of the bytes.
On a GPU each is a pass over HBM (TB/s) while the block itself crosses a NIC or PCIe (tens of GB/s); on a
CPU the same work runs on the cores at a few GB/s, several times what Mooncake's in-process memcpy takes
(`bench.datapath` measures it; README: bench.datapath).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvledger.errors import LedgerError, LedgerInputError
from kvledger_connector.config import integrity_mode
from kvledger_connector.kvlayout import BlockCopyPlan, KVLayoutError
from kvledger_connector.ownfile import read_own_file

MODES = ("checksum", "mac", "off")
MAGIC = b"KVLTAG01"
NONCE_BYTES = 8
LANES = 8
CHUNK = 512  # bytes per first-level sum: 512 * 128 * 128 = 2**23, exact in int32 and in float32
TRAILER_BYTES = len(MAGIC) + NONCE_BYTES + 8 * LANES
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 4096
FEW_BLOCKS = 16  # up to this many blocks per call, one TorchScript call computes the tags (`BlockSeal.digests`)
_MASK = (1 << 64) - 1
#: said once at start-up when an engine runs 'checksum' (`IntegrityKey.resolve` chose it or the operator did)
CHECKSUM_ONLY = ("integrity 'checksum': a stored block's tag detects corruption and a block under another key, "
                 "but not a forger: any client of this Mooncake master can recompute it. Set integrity_secret_file "
                 "(16-4096 random bytes, mode 0600, the same file on every engine sharing the store) to run 'mac'")


class IntegrityError(LedgerError):
    """A trailer slot was asked for with none free (more concurrent store calls than the seal was sized for)."""


def read_secret(path: str) -> bytes:
    """The deployment secret: a regular file owned by this user, readable by no one else, of
    MIN_SECRET_BYTES..MAX_SECRET_BYTES bytes; opened without following a link."""
    blob = read_own_file("integrity_secret_file", path, max_bytes=MAX_SECRET_BYTES, private=True)
    if not MIN_SECRET_BYTES <= len(blob) <= MAX_SECRET_BYTES:
        raise LedgerInputError("integrity_secret_file", path, f"holds {len(blob)} bytes; a secret is "
                               f"{MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes (e.g. `head -c 32 /dev/urandom`)")
    return blob


@dataclass(frozen=True)
class IntegrityKey:
    """The mode and the secret: what a tag is computed with (the same on every rank and engine)."""

    mode: str = "checksum"
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LedgerInputError("integrity", self.mode, f"must be one of {MODES}")
        if (self.mode == "mac") != bool(self.secret):
            raise LedgerInputError("integrity_secret_file", "<set>" if self.secret else None,
                                   f"a secret is needed by integrity 'mac' and only by it (integrity={self.mode!r})")

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
                generated: Callable[[], bytes]) -> IntegrityKey:
        """The engine's key by `config.integrity_mode`: the operator's secret file, else under 'mac' the
        engine's generated secret (``generated()``, asked only then), else no secret."""
        mode = integrity_mode(mode, secret_file, embedded=embedded)
        if mode != "mac":
            return cls(mode)
        return cls(mode, read_secret(secret_file) if secret_file is not None else generated())

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def key_tag(self) -> str:
        """What goes into every key's layout digest: '' (off: the old object format), 'ck1', or 'mac1-' and
        16 hex chars of an HMAC of the secret (not the secret: the digest is public)."""
        if self.mode == "off":
            return ""
        if self.mode == "checksum":
            return "ck1"
        fp = hmac.new(self.secret, b"kvledger key tag v1", hashlib.sha256).hexdigest()[:16]
        return f"mac1-{fp}"

    def material(self, num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """(A: int8 [CHUNK, LANES], U: uint64 [num_chunks, LANES]); U's rows do not depend on num_chunks."""
        shake = hashlib.shake_256(b"kvledger-integrity-v1\0" + self.mode.encode() + b"\0" + self.secret)
        na = CHUNK * LANES
        blob = shake.digest(na + num_chunks * LANES * 8)
        a = np.frombuffer(blob[:na], dtype=np.int8).reshape(CHUNK, LANES)
        u = np.frombuffer(blob[na:], dtype="<u8").reshape(num_chunks, LANES)
        return a, u

    def pad(self, key: str, nonce: bytes) -> np.ndarray:
        """The one-time pad of a (key, nonce): uint64 [LANES]. Under 'checksum' the secret is empty: anyone
        can compute it, and it still binds the tag to its key (a block stored under another key fails)."""
        mac = hmac.new(self.secret, key.encode() + b"\0" + nonce, hashlib.sha512).digest()
        return np.frombuffer(mac, dtype="<u8").astype(np.uint64)


def reference_digest(obj: bytes, ikey: IntegrityKey) -> list[int]:
    """T of the module's definition in numpy and Python integers, no torch (slow; what `BlockSeal.digests`
    is tested against)."""
    n = -(-len(obj) // CHUNK)
    b = np.frombuffer(obj + bytes(n * CHUNK - len(obj)), dtype=np.int8).astype(np.int64).reshape(n, CHUNK)
    a, u = ikey.material(n)
    h = b @ a.astype(np.int64)  # exact: |h| < 2**23
    return [sum(int(u[c, l]) * int(h[c, l]) for c in range(n)) & _MASK for l in range(LANES)]


def trailer(ikey: IntegrityKey, key: str, digest: Sequence[int], nonce: bytes) -> bytes:
    """The TRAILER_BYTES that follow a block's bytes under ``key``."""
    tag = (np.asarray([int(d) for d in digest], dtype=np.uint64) + ikey.pad(key, nonce)).astype("<u8")
    return MAGIC + nonce + tag.tobytes()


@torch.jit.script
def _digests_few(views: list[torch.Tensor], block_ids: list[int], a: torch.Tensor, u: torch.Tensor,
                 pad: int) -> torch.Tensor:
    """T of a few blocks (int64 [n, LANES]) in one call: TorchScript runs the whole graph with the GIL
    released once (`BlockSeal.digests` says why that matters); the same arithmetic as `_digests`."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=a.device)
    n = ids.size(0)
    parts = [v.index_select(0, ids).reshape(n, -1) for v in views]
    if pad > 0:
        parts.append(torch.zeros((n, pad), dtype=torch.int8, device=ids.device))
    x = torch.cat(parts, dim=1).reshape(-1, a.size(0))
    if x.is_cuda and x.size(0) <= 16:  # the int8 kernel's smallest m on CUDA; float32 is exact here too
        h = (x.to(torch.float32) @ a.to(torch.float32)).to(torch.int32)
    else:
        h = torch._int_mm(x, a)
    return (h.reshape(n, -1, a.size(1)).to(torch.int64) * u).sum(dim=1)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _int8_matmul(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [m, CHUNK] int8 @ a [CHUNK, LANES] int8 -> int32, exact either way."""
    try:
        return torch._int_mm(x, a)
    except RuntimeError:  # shapes or a device the int8 kernel does not take: float32 holds every value exactly
        return (x.to(torch.float32) @ a.to(torch.float32)).to(torch.int32)


@dataclass(frozen=True)
class _Group:
    """Segments of one storage with one size and stride, at an even spacing: one [blocks, count, nbytes] view."""

    view: torch.Tensor
    offset: int  # in the object
    nbytes: int  # count * segment bytes


class BlockSeal:
    """Tags of a rank's blocks, computed where its KV cache lives, and the trailer slots the store calls use.

    ``slots`` trailer slots of ``max_keys`` rows each, one per thread that may be inside a put or a get at
    once (the store thread, the load threads, the step's sync load): `slot` takes one for a call.

    A hybrid model's KV cache groups: one copy plan per group (equal block bytes), and the calls name each
    block's group (``kv_groups``), whose views its tag is computed from."""

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
        self._segs = [self._group(p, flats) for p in plans]  # per KV cache group
        self.num_chunks = -(-self.block_bytes // CHUNK)
        a, u = ikey.material(self.num_chunks)
        self._a = torch.from_numpy(a.copy()).to(device)
        self._u = torch.from_numpy(u.view(np.int64).copy()).to(device)
        self._arena = torch.zeros((slots, max_keys, TRAILER_BYTES), dtype=torch.uint8, device=device)
        # a partial tail's copies: one per part of a block (a job puts one tail block)
        self._staging = torch.zeros((slots, len(plans), self.num_chunks * CHUNK), dtype=torch.int8, device=device)
        self._arena_np = self._arena.numpy() if device.type == "cpu" else None  # the same memory
        self._free: queue.Queue[int] = queue.Queue(maxsize=slots)
        for i in range(slots):
            self._free.put_nowait(i)
        self.num_mismatches = 0
        self.trailer_bytes = TRAILER_BYTES
        # the first calls compile and profile the TorchScript graph and set up the int8 kernel (tens of ms):
        # paid here, at start-up, on vLLM's null block 0, not by the first loads while the engine serves
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

    # ------------------------------------------------------------------ tags
    def _gather(self, block_ids: Sequence[int], kv_group: int = 0) -> torch.Tensor:
        """The blocks' objects, zero-padded to whole chunks: int8 [n, num_chunks * CHUNK].

        One strided copy per block and group: a gather (index_select) of these views runs at a fraction of
        memcpy speed on a CPU."""
        n = len(block_ids)
        buf = torch.empty((n, self.num_chunks * CHUNK), dtype=torch.int8, device=self.device)
        buf[:, self.block_bytes:].zero_()
        for i, b in enumerate(block_ids):
            row = buf[i]
            for g in self._segs[kv_group]:
                row[g.offset:g.offset + g.nbytes].view(g.view.shape[1], g.view.shape[2]).copy_(g.view[b])
        return buf

    def _digests(self, buf: torch.Tensor) -> np.ndarray:
        n = buf.shape[0]
        h = _int8_matmul(buf.view(n * self.num_chunks, CHUNK), self._a).view(n, self.num_chunks, LANES)
        t = (h.to(torch.int64) * self._u).sum(dim=1)  # int64 arithmetic wraps: mod 2**64
        return _host(t).view(np.uint64)

    def digests(self, block_ids: Sequence[int], kv_groups: Sequence[int] | None = None) -> np.ndarray:
        """T of each block (uint64 [n, LANES]), from the KV cache as it is now.

        Every torch call releases the GIL and takes it back, and in an engine whose main thread is busy in
        Python each take can wait out the interpreter's switch interval: a load's latency then grows with
        its count of torch calls, not its bytes (`bench.engine` measured it). Up to FEW_BLOCKS blocks, one
        TorchScript call does it all; a larger batch amortises its calls and takes the faster copies.
        ``kv_groups``: each block's KV cache group (several groups; default group 0)."""
        if kv_groups is not None and len(self._segs) > 1:
            if len(kv_groups) != len(block_ids):
                raise LedgerInputError("kv_groups", len(kv_groups), f"one per block ({len(block_ids)})")
            out = np.empty((len(block_ids), LANES), dtype=np.uint64)
            for g in sorted(set(kv_groups)):
                at = [i for i, k in enumerate(kv_groups) if k == g]
                out[at] = self._digests_of([block_ids[i] for i in at], g)
            return out
        return self._digests_of(block_ids, 0)

    def _digests_of(self, block_ids: Sequence[int], kv_group: int) -> np.ndarray:
        if not 0 <= kv_group < len(self._segs):
            raise LedgerInputError("kv_group", kv_group, f"not one of this seal's {len(self._segs)} groups")
        if len(block_ids) <= FEW_BLOCKS:
            t = _digests_few([g.view for g in self._segs[kv_group]], [int(b) for b in block_ids], self._a,
                             self._u, self.num_chunks * CHUNK - self.block_bytes)
            return _host(t).view(np.uint64)
        return self._digests(self._gather(block_ids, kv_group))

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
             kv_groups: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """Write the trailers of ``keys`` (block ``block_ids``, of parts ``kv_groups``) into ``slot``: their
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
        several = kv_groups is not None and len(self._segs) > 1
        rest = [i for i in range(len(keys)) if i not in stages]  # the staged ones are tagged from their copies
        digests = np.empty((len(keys), LANES), dtype=np.uint64)
        if rest:
            digests[rest] = self.digests([block_ids[i] for i in rest],
                                         None if kv_groups is None else [kv_groups[i] for i in rest])
        staged = []
        for j, i in enumerate(stages):
            buf = self._gather([block_ids[i]], kv_groups[i] if several else 0)  # type: ignore[index]
            digests[i] = self._digests(buf)[0]
            self._staging[slot, j].copy_(buf[0])
            staged.append(self._staging[slot, j].data_ptr())
        rows = bytearray()
        for key, d in zip(keys, digests):
            rows += trailer(self.ikey, key, d, os.urandom(NONCE_BYTES))
        n = len(keys)
        if self._arena_np is not None:  # host memory: written without a torch call
            self._arena_np[slot, :n] = np.frombuffer(bytes(rows), dtype=np.uint8).reshape(n, TRAILER_BYTES)
        else:
            self._arena[slot, :n].copy_(torch.frombuffer(rows, dtype=torch.uint8).view(n, TRAILER_BYTES))
        return self.trailer_ptrs(slot, n), staged

    def verify(self, slot: int, keys: Sequence[str], block_ids: Sequence[int],
               kv_groups: Sequence[int] | None = None) -> list[bool]:
        """Whether each block read into ``block_ids`` (of KV cache groups ``kv_groups``) with its trailer in
        ``slot`` matches its tag."""
        n = len(keys)
        if not n:
            return []
        rows = self._arena_np[slot, :n] if self._arena_np is not None else self._arena[slot, :n].cpu().numpy()
        digests = self.digests(block_ids, kv_groups)
        out = []
        for key, row, d in zip(keys, rows, digests):
            raw = row.tobytes()
            nonce = raw[len(MAGIC):len(MAGIC) + NONCE_BYTES]
            out.append(raw[:len(MAGIC)] == MAGIC and hmac.compare_digest(raw, trailer(self.ikey, key, d, nonce)))
        self.num_mismatches += out.count(False)
        return out
