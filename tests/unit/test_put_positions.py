"""Identical KV stored once: which rank puts which key (`kvledger.put_positions`, `KeyLayout.kv_replicas`)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger import put_positions
from kvledger.errors import LedgerInputError
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout


@given(start=st.integers(0, 40), n=st.integers(0, 40), replicas=st.integers(1, 8))
def test_the_replicas_put_every_position_exactly_once(start: int, n: int, replicas: int):
    shares = [put_positions(start, start + n, i, replicas) for i in range(replicas)]
    flat = sorted(p for s in shares for p in s)
    assert flat == list(range(start, start + n))  # every key of the job, none twice
    for i, s in enumerate(shares):
        assert all(p % replicas == i for p in s)  # by position: two jobs of one request agree


@pytest.mark.parametrize("args", [(0, 4, 2, 2), (0, 4, -1, 2), (0, 4, 0, 0), (-1, 4, 0, 1), (0, 4, True, 2)])
def test_bad_stripes_are_refused_by_name(args):
    with pytest.raises(LedgerInputError):
        put_positions(*args)


def _layout(tp_rank: int, tp_size: int, kv_replicas: int = 1) -> KeyLayout:
    return KeyLayout(model="m", tp_rank=tp_rank, tp_size=tp_size, block_size=16, dtype="torch.bfloat16",
                     kv_layout="NHD", num_layers=2, num_kv_heads=1, head_size=8, kv_replicas=kv_replicas)


def test_replicas_share_a_prefix_and_groups_do_not():
    # 8 ranks, 2 KV heads: ranks 0-3 hold head 0, 4-7 head 1 (vLLM's QKVParallelLinear)
    prefixes = [KeyBuilder(_layout(r, 8, 4)).prefix for r in range(8)]
    assert len(set(prefixes[:4])) == 1 and len(set(prefixes[4:])) == 1 and prefixes[0] != prefixes[4]
    assert "/tp0+4of8-" in prefixes[0] and "/tp4+4of8-" in prefixes[4]
    assert [_layout(r, 8, 4).replica for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # one copy per rank, as before: the key names the rank
    assert "/tp3of8-" in KeyBuilder(_layout(3, 8)).prefix


@pytest.mark.parametrize("bad", [0, 3, True, 16])
def test_kv_replicas_must_divide_tp_size(bad):
    with pytest.raises(ValueError, match="kv_replicas"):
        _layout(0, 8, bad)
