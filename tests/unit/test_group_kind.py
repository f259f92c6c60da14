"""The group kind carries its rules (kvledger_connector/shape/group_kind.py): how a table is read, what a hit
needs, which blocks a load fills, how a failed load is reported; a model's rules follow from its kinds."""
from __future__ import annotations

import pytest

from kvledger_connector.shape.group_kind import ONE_FULL_ATTENTION, GroupKind, GroupKinds
from kvledger_connector.shape.keys import KeyLayout

FULL, SLIDING, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA_STATE


def _lay(group: int = 0, window: int = 0, state: bool = False) -> KeyLayout:
    extra = (("group", str(group)), ("window", str(window))) + ((("state", "align"),) if state else ())
    return KeyLayout(model="m", tp_rank=0, tp_size=1, block_size=4, dtype="bf16", kv_layout="LBNHC",
                     num_layers=2, num_kv_heads=1, head_size=8, extra=extra)


def test_a_key_layout_names_its_kind() -> None:
    assert GroupKind.of(_lay()) is FULL
    assert GroupKind.of(_lay(window=8)) is SLIDING
    assert GroupKind.of(_lay(state=True)) is MAMBA


def test_only_full_attention_reads_its_table_whole_and_fails_by_block() -> None:
    assert (FULL.holds_null, FULL.fails_by_block, FULL.names_group, FULL.may_give_back) == (False, True, False, False)
    for kind in (SLIDING, MAMBA):
        assert (kind.holds_null, kind.fails_by_block, kind.names_group, kind.may_give_back) == (True, False, True, True)


@pytest.mark.parametrize("kind, window, needs", [
    (FULL, None, range(0, 5)),
    (SLIDING, 8, range(3, 5)),  # a hit ending at token 28 (blocks 2..6): a span of 8 keeps tokens 21.. (blocks 5, 6)
    (MAMBA, None, range(4, 5)),  # the state after the hit's last block only
])
def test_what_a_hit_needs_by_kind(kind: GroupKind, window: int | None, needs: range) -> None:
    assert kind.hit_needs(2, 5, 4, window) == needs


def test_a_mamba_load_fills_the_state_block_at_the_hit_end_only() -> None:
    assert MAMBA.load_positions(2, 6) == range(5, 6)
    assert FULL.load_positions(2, 6) == SLIDING.load_positions(2, 6) == range(2, 6)


def test_a_models_rules_follow_from_its_kinds() -> None:
    assert ONE_FULL_ATTENTION.one_table and ONE_FULL_ATTENTION.fails_by_block
    assert not ONE_FULL_ATTENTION.keys_name_groups
    lone_sliding = GroupKinds.of_layouts([_lay(window=8)])
    assert lone_sliding.kinds == (SLIDING,)
    assert not lone_sliding.one_table and not lone_sliding.fails_by_block and lone_sliding.keys_name_groups
    two_full = GroupKinds.of_layouts([_lay(0), _lay(0), _lay(1)])  # shards of one group count once
    assert two_full.kinds == (FULL, FULL)
    assert not two_full.one_table and not two_full.fails_by_block and two_full.keys_name_groups
    hybrid = GroupKinds((FULL, SLIDING, MAMBA))
    assert hybrid.groups(MAMBA) == {2} and hybrid.groups(SLIDING) == {1}
    assert hybrid.groups(may_give_back=True) == {1, 2}
    assert hybrid.kind(1) is SLIDING and hybrid.kind(3) is FULL
