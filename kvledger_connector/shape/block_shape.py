"""What one stored block is on this rank: its parts in order, each a key of the store.

A part is one KV cache group's slice of the block (a hybrid model has several groups, each its own block
table) and, in the TP-shared layout, one shard of that group's KV heads. Every part has its key builder;
a model with one KV cache group and a key per block is the shape with one part. The worker side works
over the parts and never asks how many there are.

Built once from the engine's facts (`EngineFacts.block_shape`), or from a driver's key builders
(`BlockShape.of_keys`); a weights-version switch gives the same parts new builders (`rekeyed`). No I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from kvledger.errors import LedgerInputError
from kvledger_connector.shape.group_kind import GroupKind, GroupKinds
from kvledger_connector.shape.keys import KeyBuilder
from kvledger_connector.shape.kvlayout import BlockCopyPlan

__all__ = ["BlockPart", "BlockShape", "GroupKind", "PartBuffers"]


@dataclass(frozen=True)
class BlockPart:
    """One part of a stored block: its KV cache group, the group's kind and window, and its key builder."""
    group: int  # in kv_cache_config.kv_cache_groups; a SaveSpec's or LoadSpec's group index
    kind: GroupKind
    window: int | None  # SLIDING_WINDOW: the tokens vLLM keeps behind a position; else None
    builder: KeyBuilder

    @classmethod
    def of(cls, builder: KeyBuilder) -> BlockPart:
        """The part its builder's key layout describes (`KeyLayout.group`, `window`, `is_state`)."""
        lay = builder.layout
        return cls(lay.group, GroupKind.of(lay), lay.window, builder)


@dataclass(frozen=True)
class BlockShape:
    """The parts of a block in order: each KV cache group's parts together, groups 0.. in order, every
    group with as many parts (`keys_per_block`)."""
    parts: tuple[BlockPart, ...]

    def __post_init__(self) -> None:
        parts = self.parts
        if not isinstance(parts, tuple) or not parts or not all(isinstance(p, BlockPart) for p in parts):
            raise LedgerInputError("BlockShape.parts", parts, "must be a non-empty tuple of BlockPart")
        groups = [p.group for p in parts]
        num_groups = max(groups) + 1
        per = len(parts) // num_groups
        if groups != [g for g in range(num_groups) for _ in range(per)]:
            raise LedgerInputError("BlockShape.parts", groups, "each KV cache group's parts together, groups "
                                   "0.. in order, as many parts per group")
        kinds = {(p.group, p.kind, p.window) for p in parts}
        if len(kinds) != num_groups:
            raise LedgerInputError("BlockShape.parts", sorted(str(k) for k in kinds),
                                   "the parts of one KV cache group must share its kind and window")

    @classmethod
    def of_keys(cls, builders: Sequence[KeyBuilder]) -> BlockShape:
        """The shape whose parts are these builders' (`BlockPart.of`), in order."""
        return cls(tuple(BlockPart.of(kb) for kb in builders))

    def rekeyed(self, builders: Sequence[KeyBuilder]) -> BlockShape:
        """The same parts under new key builders (another weights version): refused unless each builder
        describes its part's group and kind."""
        new = BlockShape.of_keys(builders)
        if [(p.group, p.kind, p.window) for p in new.parts] != [(p.group, p.kind, p.window) for p in self.parts]:
            raise LedgerInputError("builders", len(builders), f"must describe this shape's {len(self.parts)} "
                                   f"parts, in order")
        return new

    @property
    def builders(self) -> tuple[KeyBuilder, ...]:
        return tuple(p.builder for p in self.parts)

    @property
    def num_groups(self) -> int:
        """KV cache groups: ids per block in a SaveSpec, the range of a LoadSpec's groups."""
        return self.parts[-1].group + 1

    @property
    def keys_per_block(self) -> int:
        """A block's keys in its group (one per head shard in the TP-shared layout, else one)."""
        return len(self.parts) // self.num_groups

    def parts_of(self, group: int) -> range:
        """The part indices of KV cache group ``group``."""
        k = self.keys_per_block
        return range(group * k, (group + 1) * k)

    @cached_property
    def kinds(self) -> GroupKinds:
        """Its KV cache groups' kinds in order (kvledger_connector/shape/group_kind.py): how a job's ids are read
        and how a failed load is reported, by the same rules as the scheduler side's."""
        return GroupKinds(tuple(self.parts[i * self.keys_per_block].kind for i in range(self.num_groups)))

    @property
    def stripe(self) -> tuple[int, int]:
        """(this rank's replica index, replicas) among ranks sharing its keys (`kvledger.put_positions`)."""
        lay = self.parts[0].builder.layout
        return lay.replica, lay.kv_replicas


class PartBuffers:
    """Where a block's parts lie in the registered KV cache: ``(ptrs, sizes)`` of each (block id, part) for
    one store batch call, from each part's copy plan (kvledger_connector/shape/kvlayout.py). Built once the
    KV cache is registered; before that (no plans) every block id is refused. Block 0 is vLLM's null block:
    refused too. A value of the shape, read by the worker steps: no call back into the worker side."""

    def __init__(self, plans: Sequence[BlockCopyPlan] = ()) -> None:
        self.plans = tuple(plans)
        self.num_blocks = self.plans[0].num_blocks if self.plans else 0

    def __call__(self, block_ids: Sequence[int], parts: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Entry i is part ``parts[i]`` of block ``block_ids[i]``."""
        for b in block_ids:
            if not self.plans or not 0 < b < self.num_blocks:
                raise LedgerInputError("block_id", b, f"not in 1..{self.num_blocks - 1} (or no KV cache "
                                       f"registered)")
        if len(parts) != len(block_ids) or not all(0 <= p < len(self.plans) for p in parts):
            raise LedgerInputError("parts", sorted(set(parts)), f"one of 0..{len(self.plans) - 1} per block id")
        ptrs: list[list[int]] = [[] for _ in block_ids]
        sizes: list[list[int]] = [[] for _ in block_ids]
        for p, plan in enumerate(self.plans):
            at = [i for i, pi in enumerate(parts) if pi == p]
            if len(at) == len(parts):  # the batch is of one part: its plan's buffers as they come
                return plan.batch_buffers(block_ids)
            if at:
                got, got_sizes = plan.batch_buffers([block_ids[i] for i in at])
                for i, pi, si in zip(at, got, got_sizes):
                    ptrs[i], sizes[i] = pi, si
        return ptrs, sizes
