"""EmitStore's choice of blocks as a pure function (`kvledger_connector.scheduler.steps.plan_store`): plain
tables in, the pins, the tail pins, the ids the ranks get and each group's leading nulls out."""
from __future__ import annotations

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.scheduler.plan import StoreRange, lookup_keys, plan_store, shard_answers

BS = 4


def _plan(rng: StoreRange, tables, *, sent: int = 0, one_table: bool = False, state=frozenset(), offers=(),
          kept=None, reachable=None):
    return plan_store(rng, tables, sent_blocks=sent, block_size=BS, one_table=one_table, state_groups=frozenset(state),
                      offers=offers, kept=kept or {}, reachable=reachable or {})


def test_one_full_attention_group_pins_its_table_and_sends_from_the_sent_offset():
    plan = _plan(StoreRange(1, 3, b"t", 2), [[5, 6, 7, 8]], sent=1, one_table=True)
    assert plan.pins == (5, 6, 7) and plan.tail_pins == (8,)
    assert plan.sent_ids == (6, 7, 8) and plan.null_before == ()
    assert plan.rows == ((5, 6, 7, 8),)


def test_several_groups_drop_nulls_and_send_block_major():
    plan = _plan(StoreRange(0, 3, None, 0), [[1, 2, 3], [0, 0, 9]])
    assert plan.pins == (1, 2, 3, 9) and plan.tail_pins == ()
    assert plan.sent_ids == (1, 0, 2, 0, 3, 9) and plan.null_before == (0, 2)


def test_a_mamba_group_saves_only_this_steps_offers_and_kept_blocks_fill_nulls():
    offers = [(1, 40, 2 * BS), (1, 41, 2 * BS + 1), (0, 42, BS)]  # one state at block 1; a partial one; not a state
    plan = _plan(StoreRange(0, 3, None, 0), [[1, 2, 3], [7, 7, 7]], state={1}, offers=offers,
                 kept={(1, 0): (30, True), (1, 2): (31, False)})
    assert plan.rows[1] == (30, 40, 0)
    assert plan.kept_used == 1 and plan.kept_expired == ((1, 2),)
    assert plan.pins == (1, 2, 3, 30, 40)


def test_a_sliding_groups_unreachable_blocks_are_not_pinned():
    plan = _plan(StoreRange(0, 3, None, 0), [[1, 2, 3], [4, 5, 6]], sent=1, reachable={1: [False, True]})
    assert plan.rows[1] == (4, 0, 6) and plan.pins == (1, 2, 3, 4, 6)
    with pytest.raises(LedgerInputError, match="reachable_blocks"):
        _plan(StoreRange(0, 3, None, 0), [[1, 2, 3], [4, 5, 6]], reachable={1: [True]})


def test_lookup_answers_are_read_back_in_the_order_they_were_asked():
    class KB:  # TEST DOUBLE: a key builder of prefix p
        def __init__(self, p: str) -> None:
            self.p = p

        def keys(self, hashes):
            return [f"{self.p}{h}" for h in hashes]
    keys = lookup_keys([KB("a"), KB("b")], ["0", "1", "2"])  # type: ignore[list-item]
    assert keys == ["a0", "a1", "a2", "b0", "b1", "b2"]
    rows = shard_answers([1 if k in ("a1", "b2") else 0 for k in keys], 2, 3)
    assert [list(r) for r in rows] == [[0, 1, 0], [0, 0, 1]]
    with pytest.raises(LedgerInputError, match="batch_is_exist"):
        shard_answers([1, 1], 2, 3)
