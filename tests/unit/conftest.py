"""Unit tests of the pure core. The block pool is vLLM 0.32.0's real ``BlockPool`` on CPU."""
from __future__ import annotations

import pytest


def make_pool(num_blocks: int = 64):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def alloc(pool, n: int) -> list[int]:
    """Blocks of a running request: allocated by the pool, ref_cnt 1."""
    return [b.block_id for b in pool.get_new_blocks(n)]


def refs(pool, ids) -> list[int]:
    return [pool.blocks[b].ref_cnt for b in ids]


@pytest.fixture
def pool():
    return make_pool()
