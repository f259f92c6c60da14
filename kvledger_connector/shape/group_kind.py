"""The kind of a KV cache group and the rules that come with it, read by the scheduler side and every rank.

vLLM keeps each kind of group by its own manager, and the connector follows each manager's rule: how the
group's block table is read (which ids may be vLLM's null block), what a prefix hit needs of its keys, which
blocks a load fills, which a deferred save must keep, and how a failed load is reported. A model is its
groups' kinds in order (`GroupKinds`); a rule about the whole model (one table read as it comes, failures by
block, keys that name their group) is derived from its kinds here, once. No I/O, no vLLM import.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvledger_connector.shape.keys import KeyLayout


class GroupKind(enum.Enum):
    """The kind of a KV cache group, by vLLM's manager for it."""
    FULL_ATTENTION = "full_attention"  # every block of the request's table is its own
    SLIDING_WINDOW = "sliding_window"  # blocks that left the window are vLLM's null block
    MAMBA_STATE = "mamba_state"  # "align" mode: block p holds the state after (p + 1) * block_size tokens

    @classmethod
    def of(cls, layout: KeyLayout) -> GroupKind:
        """The kind a key layout stores (`KeyLayout.is_state`, `KeyLayout.window`)."""
        if layout.is_state:
            return cls.MAMBA_STATE
        return cls.SLIDING_WINDOW if layout.window is not None else cls.FULL_ATTENTION

    @property
    def holds_null(self) -> bool:
        """Whether the group's table may hold vLLM's null block (id 0) where the request has no block: below
        a sliding window, and everywhere but the offered states of a Mamba row. Null ids are nothing to
        pin, load or put."""
        return self is not GroupKind.FULL_ATTENTION

    @property
    def fails_by_block(self) -> bool:
        """Whether vLLM may take a failed load of this group by block. A sliding window's is failed per
        request: a block-level cut inside the window would leave its older blocks null; a Mamba state is one
        block, its request recomputes whole."""
        return self is GroupKind.FULL_ATTENTION

    @property
    def names_group(self) -> bool:
        """Whether its keys name the group (kind, window, layers). A lone full-attention group's keys predate
        KV cache groups and name none: stored keys keep their bytes."""
        return self is not GroupKind.FULL_ATTENTION

    @property
    def may_give_back(self) -> bool:
        """Whether vLLM may give a block of the request back while it lives (a sliding window's blocks once
        outside the window, a Mamba offer after its step): a deferred save keeps such blocks for its retry."""
        return self is not GroupKind.FULL_ATTENTION

    def hit_needs(self, start: int, h: int, block_size: int, window: int | None) -> range:
        """The blocks of a hit of ``h`` blocks past block ``start`` whose keys must exist, as indices past
        ``start``, by vLLM's allocation rule for the kind: full attention every one; a sliding window of
        span W those holding positions from H - W + 1 on (H = (start + h) * block_size: vLLM leaves the
        others null); a Mamba state only the last (the state after H tokens: vLLM's hit is that snapshot)."""
        if self is GroupKind.MAMBA_STATE:
            return range(h - 1, h)
        if self is GroupKind.SLIDING_WINDOW and window is not None:
            return range(max(start, ((start + h) * block_size - window + 1) // block_size) - start, h)
        return range(h)

    def load_positions(self, first: int, last: int) -> range:
        """The table positions of a hit's blocks [first, last) a load fills: a Mamba group the one state
        block at the hit's end (vLLM reads the state there), every other kind each of them."""
        return range(last - 1, last) if self is GroupKind.MAMBA_STATE else range(first, last)


@dataclass(frozen=True)
class GroupKinds:
    """A model's KV cache groups' kinds, groups 0.. in order (one for most models)."""
    kinds: tuple[GroupKind, ...]

    @classmethod
    def of_layouts(cls, layouts: Iterable[KeyLayout]) -> GroupKinds:
        """The kinds of the groups these key layouts (a side's builders' or a block's parts') store, by
        `KeyLayout.group`; several layouts of one group (shards, head shards) count once."""
        by_group: dict[int, GroupKind] = {}
        for lay in layouts:
            by_group.setdefault(lay.group, GroupKind.of(lay))
        return cls(tuple(by_group[g] for g in sorted(by_group)))

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def one_table(self) -> bool:
        """One group whose table holds no null id: a request's table is its every block, and a job's or a
        load's ids are that table's blocks as they come (no null position, no group per id). Else each
        group's table is read by its kind's rule."""
        return len(self.kinds) <= 1 and not any(k.holds_null for k in self.kinds)

    @property
    def fails_by_block(self) -> bool:
        """Whether a failed load is reported by block (vLLM takes the failed block ids and cuts the request
        at the first): one group of a kind that allows it. With several groups vLLM takes a failed load per
        request only (the ranks report its req_id), and so are loads asynchronous."""
        return len(self.kinds) <= 1 and all(k.fails_by_block for k in self.kinds)

    @property
    def keys_name_groups(self) -> bool:
        """Whether the keys name their group (`GroupKind.names_group`): always with several groups."""
        return len(self.kinds) > 1 or any(k.names_group for k in self.kinds)

    def kind(self, group: int) -> GroupKind:
        """Group ``group``'s kind; a group no key layout names (a driver's bare config) is read as full
        attention: every block of its table."""
        return self.kinds[group] if 0 <= group < len(self.kinds) else GroupKind.FULL_ATTENTION

    def groups(self, pred: GroupKind | None = None, *, may_give_back: bool = False) -> frozenset[int]:
        """The indices of the groups of kind ``pred`` (or, with ``may_give_back``, of every kind whose blocks
        vLLM may give back)."""
        return frozenset(g for g, k in enumerate(self.kinds)
                         if (pred is not None and k is pred) or (may_give_back and k.may_give_back))


#: a model of one full-attention group (and a side told no shape yet)
ONE_FULL_ATTENTION = GroupKinds((GroupKind.FULL_ATTENTION,))
