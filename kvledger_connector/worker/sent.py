"""`SentBlocks`: one rank's copy of the table blocks the scheduler's SaveSpecs sent, from which each store job's
blocks are resolved (`SaveSteps.receive_save`, kvledger_connector/worker/saves.py)."""
from __future__ import annotations

from typing import Any

from kvledger.counts import Counter, Counts
from kvledger.errors import LedgerInputError
from kvledger_connector.metadata import SaveSpec, check_save_spec


class SentBlocks:
    """One rank's copy of what the scheduler's SaveSpecs sent: per req_id, the ids and hashes of its current
    generation's full table blocks, in table order. A SaveSpec carries only the blocks no earlier job of
    the generation sent; a job may read any block before its end (the rank resumes from its own saved
    offset), so the rank resolves them here. A full-attention group's table never changes while its
    generation lives (vLLM only appends to it), so a job keeps the ids it resolved even after its
    generation's table is dropped or replaced. A sliding-window group's table turns null below the window
    (vLLM frees those blocks, which no job then pins): each spec says where (`SaveSpec.null_before`) and the
    ids kept below it become 0, never read again.

    Bounded by ``max_requests`` tables (the oldest table is dropped to make room; a later spec continuing
    it is refused as input error, and its job reported at once: a cache miss, never a wrong block) and each
    by the request's table."""

    def __init__(self, max_requests: int, counts: Counter | None = None) -> None:
        if max_requests.__class__ is not int or max_requests <= 0:
            raise LedgerInputError("max_requests", max_requests, "must be an int > 0")
        self.max_requests = max_requests
        self._tables: dict[str, tuple[int, list[int], list[Any]]] = {}  # req_id -> (generation, ids, hashes)
        self.counts: Counter = counts if counts is not None else Counts()  # sent_tables_evicted

    def __len__(self) -> int:
        return len(self._tables)

    def resolve(self, spec: SaveSpec) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The job's blocks [0, spec.end_block): the table's, extended by the spec's new full blocks, then
        its partial tail if it has one. Refuses (LedgerInputError, the table unchanged) a spec whose
        blocks do not continue its generation's table."""
        check_save_spec(spec)  # its fields; the block ids' range is the worker's to check (it knows the cache)
        start, g = spec.start_block, spec.num_groups
        where = f"SaveSpec job {spec.store_job_id} ({spec.req_id!r})"
        full_end = spec.full_end_block
        known = self._tables.get(spec.req_id)
        if start == 0:
            ids: list[int] = []
            hashes: list[Any] = []
        elif known is None or known[0] != spec.generation or len(known[2]) < start:
            have = "none" if known is None else f"generation {known[0]}, {len(known[2])} blocks"
            raise LedgerInputError(f"{where} start_block", start,
                                   f"continues generation {spec.generation}'s blocks, this rank holds {have}")
        else:
            ids, hashes = known[1], known[2]
            del ids[start * g:], hashes[start:]  # a spec may resend blocks; they are the same blocks
        n_new = full_end - start
        ids.extend(spec.block_ids[:n_new * g])
        hashes.extend(spec.block_hashes[:n_new])
        for grp, below in enumerate(spec.null_before):  # freed by vLLM since they were sent: never read
            for b in range(min(below, len(hashes))):
                ids[b * g + grp] = 0
        if known is None or start == 0:
            self._tables.pop(spec.req_id, None)
            if len(self._tables) >= self.max_requests:
                del self._tables[next(iter(self._tables))]  # the oldest: its next spec is refused
                self.counts.add("sent_tables_evicted")
        self._tables[spec.req_id] = (spec.generation, ids, hashes)
        return (tuple(ids) + tuple(spec.block_ids[n_new * g:]),
                tuple(hashes) + tuple(spec.block_hashes[n_new:]))

    def drop(self, req_id: str, generation: int | None) -> None:
        """DropGeneration: forget ``req_id``'s table unless it is of a newer generation (a late notice)."""
        known = self._tables.get(req_id)
        if known is not None and (generation is None or known[0] <= generation):
            del self._tables[req_id]

