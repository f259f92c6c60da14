"""THIS IS A TEST DOUBLE base: `StoreDouble` answers every `KVStore` call as a store that cannot make it does
(kvledger_connector/store/contract.py): `StoreCode.UNSUPPORTED` per key or as the one code, no breaker,
nothing inside the client, nothing to register or close. A double subclasses it and overrides what it does,
so every double implements the whole protocol and no caller has to ask what a store has."""
from __future__ import annotations

from collections.abc import Sequence

from kvledger_connector.store.contract import StoreCode

UNSUPPORTED = int(StoreCode.UNSUPPORTED)


class StoreDouble:
    """THIS IS A TEST DOUBLE: a `KVStore` that can do nothing (module doc)."""

    removes_by_regex = False
    breaker_open = False
    calls_inside = 0

    def register_buffer(self, ptr: int, size: int) -> None:
        return None

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [UNSUPPORTED] * len(keys)

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        return [UNSUPPORTED] * len(keys)

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        return [UNSUPPORTED] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        return UNSUPPORTED

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        return UNSUPPORTED

    def healthy(self) -> bool:
        return True

    def trip(self) -> None:
        return None

    def close(self) -> None:
        return None
