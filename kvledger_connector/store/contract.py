"""The store's contract: the result codes every store call answers with (`StoreCode`) and the whole of what
the connector asks of a store (`KVStore`). Nothing here talks to a store: the Mooncake client
(kvledger_connector/store/client.py) is one implementation, a test double another; the steps and the call
wrapper (kvledger_connector/store/io.py) know only this module.

A store that cannot do something still answers the call: `StoreCode.UNSUPPORTED` per key (or as the one
code), never an exception and never a missing method, so no caller probes what a store has.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvledger import codes as ledger_codes


class StoreCode(enum.IntEnum):
    """Result codes. Mooncake's own (mooncake-store/include/types.h, seen through Python) plus local
    ones below -9000 for outcomes decided in this wrapper. Results stay plain ints; use `StoreCode.label`."""

    OK = 0
    INTERNAL_ERROR = -1  # setup() failed (e.g. no valid LAN address)
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = ledger_codes.NO_AVAILABLE_HANDLE  # no space (defined once, in kvledger.codes)
    INVALID_PARAMS = -600  # destination too small, bad size, empty key, client not initialised
    OBJECT_NOT_FOUND = -704  # missing / evicted / lost in a master restart
    OBJECT_ALREADY_EXISTS = -705  # swallowed by put (first writer wins -> 0)
    OBJECT_HAS_LEASE = -706  # remove within the lease without force
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800  # destination larger than the object; segment owner dead
    RPC_FAIL = -900  # master unreachable
    RPC_TIMEOUT = -901  # master hung past MC_RPC_TIMEOUT_MS
    UNABLE_OFFLOAD = -1300  # setup() with the disk tier against a master started without --enable_offload
    # local codes (never produced by Mooncake)
    KEY_TOO_LONG = -9001  # key longer than max_key_bytes: not sent
    UNHEALTHY_SKIPPED = -9002  # skipped: master failed recently (backoff)
    CLIENT_EXCEPTION = -9003  # the client raised; see MooncakeStore.last_exception
    BAD_BUFFER = -9004  # null pointer or size <= 0 for this key: not sent
    # read whole, but its trailer's tag does not match (kvledger_connector/shape/integrity.py)
    INTEGRITY_MISMATCH = -9005
    UNSUPPORTED = -9006  # this store cannot make the call (module doc)

    @staticmethod
    def label(code: int) -> str:
        """Name of a code, e.g. "OBJECT_NOT_FOUND(-704)"; positive results are byte counts."""
        if code > 0:
            return f"BYTES({code})"
        try:
            return f"{StoreCode(code).name}({code})"
        except ValueError:
            return f"UNKNOWN({code})"


MASTER_DOWN_CODES = frozenset({StoreCode.RPC_FAIL, StoreCode.RPC_TIMEOUT})


class StoreError(RuntimeError):
    """A store operation that has no per-key result failed (setup, buffer registration)."""


@runtime_checkable
class KVStore(Protocol):
    """What the connector asks of a store, all of it. `MooncakeStore` is the real one; `DeadlineStore`
    bounds the scheduler's calls to one; `testbed.faults.FaultyStore` wraps any KVStore to inject faults.
    Every batch method returns one int per key; a store without a breaker answers `breaker_open` False,
    `trip` by doing nothing and `calls_inside` 0."""

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register memory the batch calls read and write (required for RDMA); `StoreError` when refused."""
        ...

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 exists, 0 missing, < 0 error."""
        ...

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """0 stored (or already present: first writer wins), < 0 error."""
        ...

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """bytes read (== the object's size) on success, < 0 error."""
        ...

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 leased (``force`` removes it anyway), < 0 error."""
        ...

    @property
    def removes_by_regex(self) -> bool:
        """Whether `remove_by_regex` can succeed (a reset is refused up front where it cannot)."""
        ...

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        """Keys removed (>= 0) or < 0 error; `StoreCode.UNSUPPORTED` where `removes_by_regex` is False."""
        ...

    def healthy(self) -> bool:
        """Cheap: whether calls are expected to reach the store now."""
        ...

    @property
    def breaker_open(self) -> bool:
        """True while calls are answered at once without a round trip (a master failure opened a breaker)."""
        ...

    def trip(self) -> None:
        """Open the breaker as a master failure does (a caller's deadline passed on a call still inside)."""
        ...

    @property
    def calls_inside(self) -> int:
        """Calls now inside the store's client (shutdown diagnostics)."""
        ...

    def close(self) -> object:
        """Leave the store; idempotent. What it returns is the implementation's own (MooncakeStore: done)."""
        ...
