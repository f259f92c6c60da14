"""One classification of a store's per-key result codes, used by the connector's step functions
(kvledger_connector/worker/steps.py) and therefore by the conformance driver, which calls them.

What Mooncake returns (per key, in a list as long as the batch):

    batch_is_exist   1 present, 0 missing, < 0 error          present only on 1 (an error: try the put)
    batch_put        0 stored (or already there: first writer   a batch is stored only if EVERY key is 0;
                     wins, -705 is turned into 0), < 0 error    a positive code is no put result: failed.
                                                                NO_AVAILABLE_HANDLE (-200) anywhere in the
                                                                batch: the store has no space (pressure)
    batch_get        bytes read (== the object's size), < 0     loaded only if exactly the key's size was
                                                                read: a short (or longer) read fails like
                                                                a negative code

A result list of the wrong length is a broken store: :class:`LedgerInputError` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

from .errors import LedgerInputError

T = TypeVar("T")

EXISTS = 1
STORED = 0
NO_AVAILABLE_HANDLE = -200  # Mooncake: no space (store full, nothing evictable yet, segment not mounted)


def check_count(field: str, codes: Sequence[int], num_keys: int) -> None:
    if len(codes) != num_keys:
        raise LedgerInputError(field, len(codes), f"results for a batch of {num_keys} keys (one per key)")


def missing(codes: Sequence[int], num_keys: int) -> list[int]:
    """Positions of a ``batch_is_exist`` answer whose key must be put (not exactly present)."""
    check_count("batch_is_exist codes", codes, num_keys)
    return [i for i, c in enumerate(codes) if c != EXISTS]


@dataclass(frozen=True)
class PutOutcome:
    stored: bool  # every key of the batch is in the store
    pressure: bool  # the store had no space for some key
    failed_codes: tuple[int, ...]  # the code of every key not stored, in batch order


def classify_put(codes: Sequence[int], num_keys: int) -> PutOutcome:
    """A ``batch_put``'s per-key codes: stored only if every key answered 0 (an empty batch is stored)."""
    check_count("batch_put codes", codes, num_keys)
    bad = tuple(c for c in codes if c != STORED)
    return PutOutcome(stored=not bad, pressure=NO_AVAILABLE_HANDLE in bad, failed_codes=bad)


def is_loaded(code: int, key_bytes: int) -> bool:
    """One ``batch_get`` result: the key's object was read whole into its buffers."""
    return code == key_bytes


def split_loaded(items: Sequence[T], codes: Sequence[int], key_bytes: int) -> tuple[list[T], list[tuple[T, int]]]:
    """``items`` (one per key of a batch get) split into loaded ones and (item, code) of the others."""
    check_count("batch_get codes", codes, len(items))
    if key_bytes.__class__ is not int or key_bytes <= 0:
        raise LedgerInputError("key_bytes", key_bytes, "must be an int > 0 (the size of one key's object)")
    ok = [x for x, c in zip(items, codes) if is_loaded(c, key_bytes)]
    bad = [(x, c) for x, c in zip(items, codes) if not is_loaded(c, key_bytes)]
    return ok, bad
