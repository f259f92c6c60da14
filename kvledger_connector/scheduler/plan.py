"""EmitStore's and the lookup's pure functions: plain values in, plain values out (no state, no I/O).

What a request is read as (`RequestLike`, its generation, its partial tail's hash), the keys a lookup asks
and how its answers are read back, the blocks a store job covers (`save_end`, `StoreRange`) and pins and
sends (`plan_store`). The steps (kvledger_connector/scheduler/steps.py) and the conformance replay call
these, never a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from kvledger.errors import LedgerInputError
from kvledger_connector.shape.keys import KeyBuilder, partial_tail_hash

class RequestLike(Protocol):
    """What the steps read of a request (vLLM's ``vllm.v1.request.Request`` has each field)."""

    request_id: str
    num_preemptions: int
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: Sequence[bytes]
    all_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int] | None


def _leading_nulls(table: Sequence[int], end: int) -> int:
    """How many of a table's first ``end`` blocks are vLLM's null block (0) before its first real one: a
    sliding-window group's blocks below its window, freed by vLLM."""
    for i in range(min(end, len(table))):
        if table[i] != 0:
            return i
    return min(end, len(table))


def generation_of(request: RequestLike) -> int:
    """The request's generation as the connector counts it: admissions that were preempted so far."""
    return int(request.num_preemptions)


def tail_hash(request: RequestLike, num_tokens: int, tokens: Sequence[int] | None, block_size: int
              ) -> bytes | None:
    """The key hash of the first ``num_tokens`` tokens' partial last block, or None when it has none worth
    saving: fewer than 2 tokens past the last full block (a hit must leave one to compute), no full block
    before it (the parent hash carries the cache salt and LoRA of the chain), its full blocks not hashed
    yet, or hashes that cover more than token ids (multimodal, prompt embeddings)."""
    k, r = divmod(num_tokens, block_size)
    if r < 2 or k < 1 or len(request.block_hashes) < k or tokens is None:
        return None
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    return partial_tail_hash(request.block_hashes[k - 1], tokens[k * block_size:num_tokens])


def lookup_keys(key_builders: Sequence[KeyBuilder], hashes: Sequence[bytes]) -> list[str]:
    """The keys a lookup asks ``batch_is_exist`` for, shard-major: every hash's key under builder 0, then
    under builder 1, ... (`shard_answers` reads the answers back in this order)."""
    return [k for kb in key_builders for k in kb.keys(hashes)]


def shard_answers(res: Sequence[int], num_builders: int, num_hashes: int) -> list[Sequence[int]]:
    """``batch_is_exist``'s answers to `lookup_keys`, one row per key builder: ``rows[s][i]`` answers builder
    ``s``'s key of hash ``i``."""
    if len(res) != num_builders * num_hashes:
        raise LedgerInputError("batch_is_exist", len(res), f"one answer per key ({num_builders * num_hashes})")
    return [res[s * num_hashes:(s + 1) * num_hashes] for s in range(num_builders)]


@dataclass(frozen=True)
class StoreRange:
    """What EmitStore pins and puts for one request: the table's blocks [0, end) (every one: a rank resumes
    from its own saved offset, which can lag), then, when ``tail`` is set, table block ``end``, the
    prompt's partial tail, stored under the tail key ``tail``."""

    start: int  # full blocks already covered by earlier jobs (or a load) of this generation
    end: int
    tail: bytes | None
    tail_tokens: int

    @property
    def reach(self) -> int:
        """Table blocks the job reads."""
        return self.end + (self.tail is not None)


def save_end(*, token_len: int, num_prompt_tokens: int, num_tokens: int, num_hashes: int, block_size: int,
             save_decode: bool) -> int:
    """EmitStore's end: the full blocks whose KV exists once ``token_len`` tokens are computed (the
    prompt's, or every token's with ``save_decode``) and have a hash."""
    limit = num_tokens if save_decode else num_prompt_tokens
    return min(min(token_len, limit) // block_size, num_hashes)


@dataclass(frozen=True)
class StorePlan:
    """One store job's blocks (`plan_store`)."""

    rows: tuple[tuple[int, ...], ...]  # each KV cache group's table as the job reads it (null: nothing there)
    pins: tuple[int, ...]  # blocks of [0, end) the job pins, group by group
    tail_pins: tuple[int, ...]  # the partial tail's block, one per group that holds one
    sent_ids: tuple[int, ...]  # ids of blocks [sent_blocks, reach) the ranks get, block major, one per group
    null_before: tuple[int, ...]  # per group, its null blocks before its first real one in [0, end); () one table
    kept_used: int  # null positions filled from a deferred job's kept blocks
    kept_expired: tuple[tuple[int, int], ...]  # kept blocks due here whose prefix-cache record changed


def plan_store(rng: StoreRange, tables: Sequence[Sequence[int]], *, sent_blocks: int, block_size: int,
               one_table: bool, state_groups: frozenset[int], offers: Sequence[tuple[int, int, int]],
               kept: Mapping[tuple[int, int], tuple[int, bool]], reachable: Mapping[int, Sequence[bool]]
               ) -> StorePlan:
    """EmitStore's choice of blocks for the job of `rng`, from plain values: the request's tables (one per KV
    cache group, each at least ``rng.reach`` long), the blocks [0, sent_blocks) whose ids the ranks hold
    already, vLLM's Mamba hand-offs of this step (``offers``: (group, block id, boundary tokens)), a deferred
    job's kept blocks ((group, block) -> (block id, its prefix-cache record unchanged)) and each sliding-window
    group's mask of blocks [sent_blocks, end) a later hit can use. The rows are rewritten in that order (state
    offers, kept blocks, masks). Null ids are nothing to pin: dropped here, the one place (the ledger refuses
    them); with ``one_table`` (`GroupKinds.one_table`: one full-attention group) the table is the request's
    every block and the ranks get no null positions."""
    lo, hi = sent_blocks, rng.end
    rows = _state_rows(tables, offers, lo, hi, block_size, state_groups)
    rows, kept_used, kept_expired = _with_kept_blocks(rows, kept, lo, hi)
    rows = _reachable_rows(rows, reachable, lo, hi)
    pins = tuple(b for t in rows for b in t[:hi] if b != 0)
    tail_pins = tuple(t[p] for t in rows for p in range(hi, rng.reach) if t[p] != 0)
    null_before = () if one_table else tuple(_leading_nulls(t, hi) for t in rows)
    sent_ids = tuple(t[p] for p in range(lo, rng.reach) for t in rows)
    return StorePlan(tuple(tuple(t) for t in rows), pins, tail_pins, sent_ids, null_before, kept_used, kept_expired)


def _state_rows(tables: Sequence[Sequence[int]], offers: Sequence[tuple[int, int, int]], lo: int, hi: int,
                block_size: int, state_groups: frozenset[int]) -> list[Sequence[int]]:
    """The tables with each Mamba group's row replaced by this step's offered states in blocks [lo, hi):
    block p holds the id vLLM handed off for the state after (p + 1) * block_size tokens, else null.
    vLLM's align-mode row is not the states by position (it keeps a running state and nulls the rest),
    and vLLM promises an offered block's bytes only for its step: an earlier step's offer is used only
    as a deferred job's kept block (`_with_kept_blocks`), so a lagging rank never reads a state block
    that was given back."""
    if not state_groups:
        return list(tables)
    at = {(g, tokens // block_size - 1): b for g, b, tokens in offers
          if g in state_groups and tokens > 0 and tokens % block_size == 0 and lo < tokens // block_size <= hi}
    return [[at.get((k, p), 0) for p in range(len(t))] if k in state_groups else t for k, t in enumerate(tables)]


def _with_kept_blocks(tables: list[Sequence[int]], kept: Mapping[tuple[int, int], tuple[int, bool]], lo: int,
                      hi: int) -> tuple[list[Sequence[int]], int, tuple[tuple[int, int], ...]]:
    """The tables with the null positions of [lo, hi) filled from a deferred job's kept blocks whose
    prefix-cache record is unchanged, how many were filled, and the kept blocks due here whose record
    changed (evicted, or the entry moved: not saved)."""
    if not kept:
        return tables, 0, ()
    out = [list(t) for t in tables]
    filled, expired = 0, []
    for (g, p), (block_id, live) in kept.items():
        if not lo <= p < min(hi, len(out[g])) or out[g][p] != 0:
            continue
        if live:
            out[g][p] = block_id
            filled += 1
        else:
            expired.append((g, p))
    return out, filled, tuple(expired)


def _reachable_rows(tables: list[Sequence[int]], reachable: Mapping[int, Sequence[bool]], lo: int, hi: int
                    ) -> list[Sequence[int]]:
    """The tables with each sliding-window group's blocks [lo, hi) that no later hit can use (its mask in
    ``reachable``) made null: nothing to pin or put. Blocks before ``lo`` were sent already and keep what
    they were sent as."""
    if not reachable or hi <= lo:
        return tables
    out = list(tables)
    for k, mask in reachable.items():
        if len(mask) != hi - lo:
            raise LedgerInputError("reachable_blocks", len(mask), f"one per block of [{lo}, {hi})")
        row = list(tables[k])
        for i, keep in enumerate(mask):
            if not keep:
                row[lo + i] = 0
        out[k] = row
    return out
