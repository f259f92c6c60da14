"""A rank's block as one shape (kvledger_connector/shape/block_shape.py): its parts, their KV cache groups and kinds,
read from the key builders' layouts; malformed shapes refused by name; a rekey keeps the parts."""
from __future__ import annotations

import dataclasses

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.shape.block_shape import BlockPart, BlockShape, GroupKind
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout

BASE = KeyLayout(model="shape", tp_rank=0, tp_size=1, block_size=16, dtype="torch.float32", kv_layout="LBNHC",
                 num_layers=1, num_kv_heads=1, head_size=8)


def _kb(**extra: str) -> KeyBuilder:
    return KeyBuilder(dataclasses.replace(BASE, extra=tuple(extra.items())))


def test_one_group_is_the_shape_of_one_part():
    shape = BlockShape.of_keys([_kb()])
    assert [(p.group, p.kind, p.window) for p in shape.parts] == [(0, GroupKind.FULL_ATTENTION, None)]
    assert (shape.num_groups, shape.keys_per_block, list(shape.parts_of(0))) == (1, 1, [0])
    assert shape.kinds.one_table and shape.kinds.fails_by_block and shape.stripe == (0, 1)


def test_a_hybrid_shape_names_each_part_group_and_kind():
    shape = BlockShape.of_keys([_kb(), _kb(group="1", window="32"), _kb(group="2", state="align")])
    assert [(p.group, p.kind, p.window) for p in shape.parts] == [
        (0, GroupKind.FULL_ATTENTION, None), (1, GroupKind.SLIDING_WINDOW, 32), (2, GroupKind.MAMBA_STATE, None)]
    assert (shape.num_groups, shape.keys_per_block, list(shape.parts_of(2))) == (3, 1, [2])
    assert not shape.kinds.one_table and not shape.kinds.fails_by_block


def test_head_shards_are_parts_of_their_group():
    lays = [dataclasses.replace(BASE, heads=(j, 2), extra=(("group", str(g)),)) for g in range(2) for j in range(2)]
    shape = BlockShape.of_keys([KeyBuilder(lay) for lay in lays])
    assert [p.group for p in shape.parts] == [0, 0, 1, 1]
    assert (shape.keys_per_block, list(shape.parts_of(1))) == (2, [2, 3])


@pytest.mark.parametrize("parts", [
    (),
    ("not a part",),
    (BlockPart(1, GroupKind.FULL_ATTENTION, None, _kb()),),  # group 0 missing
    (BlockPart(0, GroupKind.FULL_ATTENTION, None, _kb()), BlockPart(1, GroupKind.FULL_ATTENTION, None, _kb()),
     BlockPart(1, GroupKind.FULL_ATTENTION, None, _kb())),  # unequal parts per group
    (BlockPart(0, GroupKind.FULL_ATTENTION, None, _kb()), BlockPart(0, GroupKind.SLIDING_WINDOW, 8, _kb())),
])
def test_a_malformed_shape_is_refused_by_name(parts):
    with pytest.raises(LedgerInputError) as e:
        BlockShape(parts)  # type: ignore[arg-type]
    assert e.value.field == "BlockShape.parts"


def test_a_rekey_keeps_the_parts_and_swaps_the_builders():
    shape = BlockShape.of_keys([_kb(), _kb(group="1", window="32")])
    new = [KeyBuilder(dataclasses.replace(kb.layout, model_hash="v2")) for kb in shape.builders]
    again = shape.rekeyed(new)
    assert again.builders == tuple(new) and [p.kind for p in again.parts] == [p.kind for p in shape.parts]
    with pytest.raises(LedgerInputError):
        shape.rekeyed(new[:1])
