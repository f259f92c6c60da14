"""The store's contract (kvledger_connector/store/contract.py): every store the connector or a test is given
has the whole `KVStore` protocol, a store that cannot make a call answers UNSUPPORTED, and no connector
module asks a store what it has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.store.contract import KVStore, StoreCode
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.store.io import StoreCall, StoreIO
from testbed.faults import FaultyStore
from testbed.store_double import StoreDouble

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(n for n in vars(KVStore) if not n.startswith("_"))


@pytest.mark.parametrize("cls", [MooncakeStore, FaultyStore, StoreDouble], ids=lambda c: c.__name__)
def test_every_store_has_the_whole_protocol(cls: type) -> None:
    assert {"remove_by_regex", "removes_by_regex", "breaker_open", "trip", "calls_inside"} <= set(MEMBERS)
    assert [n for n in MEMBERS if not hasattr(cls, n)] == []


def test_a_store_that_cannot_make_a_call_answers_unsupported() -> None:
    st = StoreDouble()
    assert isinstance(st, KVStore) and isinstance(FaultyStore(st), KVStore)
    code = int(StoreCode.UNSUPPORTED)
    assert st.batch_is_exist(["a", "b"]) == [code] * 2 and st.batch_get(["a"], [[1]], [[1]]) == [code]
    assert st.batch_put(["a"], [[1]], [[1]]) == [code] and st.remove("a") == code
    assert (st.removes_by_regex, st.remove_by_regex("^a$"), st.breaker_open, st.calls_inside) == (False, code, False, 0)
    assert StoreCode.label(code) == "UNSUPPORTED(-9006)"


def test_a_lookup_is_a_store_call_made_by_store_io_through_the_deadline() -> None:
    class Present(StoreDouble):  # THIS IS A TEST DOUBLE: every key present
        def batch_is_exist(self, keys):  # type: ignore[no-untyped-def]
            return [1] * len(keys)

    bounded = DeadlineStore(Present(), 5.0)
    try:
        assert StoreIO(bounded)(StoreCall("batch_is_exist", ("a", "b"))) == [1, 1]
        assert bounded.counts.total("lookup_s") > 0  # timed as a prefix lookup
    finally:
        bounded.stop()


def test_no_connector_module_probes_what_a_store_has() -> None:
    probe = re.compile(r"getattr\(\s*[\w.]*store[\w.]*\s*,|callable\(getattr\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "kvledger_connector").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []
