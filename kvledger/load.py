"""Load side (one per rank): every attempted block ends loaded or reported.

Per load, on a receive thread (the connector holds one lock around every call)::

    begin_load(req_id, block_ids, keys_per_block) -> load_id   attempted = block_ids (an empty list is
                                                       fine); a block is loaded once that many of its keys are
    load_order(len(keys), tp_rank)                    pure: the rotated key order (no division by 0)
    record_results(load_id, block_ids, codes, key_bytes)  Load(w, r): per key, loaded only if the key's
                                                       size was read (kvledger.codes), else failed
    fail_pending(load_id, reason)                      exception, oversized key, or an earlier sub-batch
                                                       failed: every block neither loaded nor reported fails
    finish_load(load_id)                               raises S8 LoadErrorsReported if a block is pending
    take_errors() -> set[int]                          HandleLoadErrors: vLLM's
                                                       get_block_ids_with_load_errors (get-and-clear)

Failures are kept by block id, so rotating the key list by ``tp_rank`` cannot mis-map them: the block id
travels with its key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from . import codes as _codes
from .counts import Counter, Counts
from .errors import LedgerInputError, LedgerInvariantError, check_positive_int
from .trace import TraceSink


def rotation(num_keys: int, tp_rank: int) -> int:
    """How far rank ``tp_rank`` rotates a key list of ``num_keys`` (0 for an empty list, never a
    ZeroDivisionError)."""
    return tp_rank % num_keys if num_keys else 0


def load_order(num_keys: int, tp_rank: int) -> list[int]:
    """The key positions in the order rank ``tp_rank`` loads them: rotated left by
    ``rotation(num_keys, tp_rank)`` (ranks start on different keys); position i of the order is key
    ``(i + r) % n``, and the caller carries each key's block id along, so failures map back exactly."""
    r = rotation(num_keys, tp_rank)
    return [(i + r) % num_keys for i in range(num_keys)]


def load_batch_keys(sub_batch_keys: int, key_bytes: int, readers: int, staging_bytes: int | None = None) -> int:
    """Keys per batch get for objects of ``key_bytes``: ``sub_batch_keys`` (the config's
    `load_sub_batch_keys`), and with the disk tier (``staging_bytes``: its `disk_offload_staging_size`; None
    without the tier) no more than one owner's staging buffer holds for ``readers`` ranks reading its files
    at once: past it every disk-resident key of the batch fails (-10; docs/disk-tier.md).
    `LedgerInputError` naming the field when not even one key per reader fits."""
    if key_bytes < 1 or readers < 1:
        raise LedgerInputError("key_bytes" if key_bytes < 1 else "readers", min(key_bytes, readers), "must be >= 1")
    if staging_bytes is None:
        return sub_batch_keys
    fits = staging_bytes // (key_bytes * readers)
    if fits < 1:
        raise LedgerInputError("disk_offload_staging_size", staging_bytes,
                               f"holds no key of {key_bytes} bytes for each of {readers} ranks reading the tier "
                               f"at once: raise it to at least {key_bytes * readers}")
    return min(sub_batch_keys, fits)


@dataclass(frozen=True)
class LoadResult:
    load_id: int
    req_id: str
    loaded: frozenset[int]
    failed: frozenset[int]


class _Load:
    __slots__ = ("load_id", "req_id", "attempted", "loaded", "failed", "reasons", "keys_per_block", "keys_read")

    def __init__(self, load_id: int, req_id: str, attempted: list[int], keys_per_block: int = 1) -> None:
        self.load_id = load_id
        self.req_id = req_id
        self.attempted = attempted
        self.keys_per_block = keys_per_block
        self.keys_read: dict[int, int] = {}  # keys read so far per block not yet loaded (several per block)
        self.loaded: set[int] = set()
        self.failed: set[int] = set()
        self.reasons: list[str] = []

    def pending(self) -> list[int]:
        return [b for b in self.attempted if b not in self.loaded and b not in self.failed]


class LoadLedger:
    """Bounds: ``max_inflight_loads`` loads begun and not finished; ``max_error_blocks`` block ids
    reported and not yet taken (vLLM takes them every step, so this is only reached if nobody does).

    Counted into ``counts`` (the connector's recorder, or the ledger's own `Counts`): loads_finished. The
    blocks reported failed are counted by the caller that reports them (load_errors_reported)."""

    def __init__(self, rank: int = 0, *, max_inflight_loads: int, max_error_blocks: int = 1 << 20,
                 trace: TraceSink | None = None, counts: Counter | None = None) -> None:
        check_positive_int("rank", rank, allow_zero=True)
        check_positive_int("max_inflight_loads", max_inflight_loads)
        check_positive_int("max_error_blocks", max_error_blocks)
        self.rank = rank
        self._actor = f"w{rank}"
        self._max_loads = max_inflight_loads
        self._max_errors = max_error_blocks
        self._loads: dict[int, _Load] = {}
        self._errors: set[int] = set()
        self._next_load_id = 0
        self._trace = trace
        self.counts: Counter = counts if counts is not None else Counts()

    def begin_load(self, req_id: str, block_ids: Sequence[int], keys_per_block: int = 1) -> int:
        """Start a load of ``block_ids`` (the blocks the keys load into) for ``req_id``; a block is stored
        as ``keys_per_block`` keys (the TP-shared layout's head shards), and loaded only once every one of
        them is read whole."""
        check_positive_int("keys_per_block", keys_per_block)
        if len(self._loads) >= self._max_loads:
            raise LedgerInputError("max_inflight_loads", self._max_loads,
                                   f"rank {self.rank}: that many loads in flight; {req_id!r} refused")
        bad = [b for b in block_ids if b.__class__ is not int or b < 0]
        if bad:
            raise LedgerInputError("block_ids", bad, f"not block ids (load of {req_id!r})")
        load_id = self._next_load_id
        self._next_load_id += 1
        self._loads[load_id] = _Load(load_id, req_id, list(dict.fromkeys(block_ids)), keys_per_block)
        return load_id

    def _load(self, load_id: int) -> _Load:
        ld = self._loads.get(load_id)
        if ld is None:
            raise LedgerInputError("load_id", load_id, f"not an in-flight load on rank {self.rank}")
        return ld

    def _check_attempted(self, ld: _Load, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        att = set(ld.attempted)
        extra = [b for b in ids if b not in att]
        if extra:
            raise LedgerInputError("block_ids", extra, f"not attempted by load {ld.load_id} ({ld.req_id!r})")
        return ids

    def record_ok(self, load_id: int, block_ids: Iterable[int]) -> None:
        """A key of each of these blocks was read whole (a block id once per key); a block is loaded when
        all its keys are (a block already reported failed stays failed)."""
        ld = self._load(load_id)
        for b in self._check_attempted(ld, block_ids):
            if b in ld.failed or b in ld.loaded:
                continue
            n = ld.keys_read.get(b, 0) + 1
            if n < ld.keys_per_block:
                ld.keys_read[b] = n
            else:
                ld.keys_read.pop(b, None)
                ld.loaded.add(b)

    def record_failed(self, load_id: int, block_ids: Iterable[int], reason: str) -> None:
        """These blocks were not loaded: reported now (for :meth:`take_errors`)."""
        ld = self._load(load_id)
        ids = self._check_attempted(ld, block_ids)
        new = [b for b in ids if b not in ld.failed]
        if len(self._errors) + len(new) > self._max_errors:
            raise LedgerInputError("max_error_blocks", self._max_errors,
                                   f"{len(self._errors)} error blocks not taken; take_errors() is not called")
        for b in new:
            ld.loaded.discard(b)
            ld.failed.add(b)
        self._errors.update(new)
        if new:
            ld.reasons.append(reason)

    def record_results(self, load_id: int, block_ids: Sequence[int], codes: Sequence[int],
                       key_bytes: int) -> list[tuple[int, int]]:
        """Per-key results of one batch get (:mod:`kvledger.codes`: loaded only if exactly ``key_bytes``
        were read; a short read or a negative code fails). Returns (block id, code) of the failed keys."""
        ok, bad = _codes.split_loaded(list(block_ids), codes, key_bytes)
        self.record_ok(load_id, ok)
        if bad:
            self.record_failed(load_id, [b for b, _ in bad], f"store codes {sorted({c for _, c in bad})}")
        return bad

    def fail_pending(self, load_id: int, reason: str) -> list[int]:
        """Report every attempted block of the load that is neither loaded nor reported (an exception, an
        oversized key, or a failed sub-batch that stops the remaining ones). Returns them."""
        ld = self._load(load_id)
        pend = ld.pending()
        if pend:
            self.record_failed(load_id, pend, reason)
        return pend

    def pending(self, load_id: int) -> list[int]:
        return self._load(load_id).pending()

    def finish_load(self, load_id: int) -> LoadResult:
        """The load is over. Raises S8 LoadErrorsReported (the load stays open, nothing is lost) if an
        attempted block is neither loaded nor reported."""
        ld = self._load(load_id)
        pend = ld.pending()
        if pend:
            raise LedgerInvariantError.of(
                "S8", f"rank {self.rank}: load {load_id} of {ld.req_id!r} would finish with blocks {pend} "
                      f"neither loaded nor reported (call fail_pending first)")
        del self._loads[load_id]
        self.counts.add("loads_finished")
        if self._trace is not None:
            self._trace.emit(self._actor, "Load", {
                "load": load_id, "req_id": ld.req_id, "attempted": ld.attempted,
                "loaded": sorted(ld.loaded), "failed": sorted(ld.failed)})
        return LoadResult(load_id, ld.req_id, frozenset(ld.loaded), frozenset(ld.failed))

    def take_errors(self) -> set[int]:
        """Get and clear the block ids whose load failed (vLLM's ``get_block_ids_with_load_errors``)."""
        errs = self._errors
        self._errors = set()
        if errs and self._trace is not None:
            self._trace.emit(self._actor, "HandleLoadErrors", {"blocks": sorted(errs)})
        return errs

    @property
    def num_inflight_loads(self) -> int:
        return len(self._loads)
