"""Lookup: how many of a request's next tokens the store holds for every shard (vLLM's
``get_num_new_matched_tokens``), in two halves around the one store call the side makes (`ask`, `answer`);
and whether the load of such a hit runs inside the step (`load_is_async`).

A hit is read by each KV cache group's kind (`GroupKind.hit_needs`, kvledger_connector/shape/group_kind.py):
the longest run of blocks every full-attention key holds, cut back until each sliding-window group holds
its window's blocks and each Mamba group its state at the hit's end. Answers are cached per (req_id,
generation, num_computed_tokens) while the request waits, in the request table's LRU (bounded by
``max_lookup_cache``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvledger_connector.scheduler.base import StepsBase
from kvledger_connector.scheduler.plan import RequestLike, generation_of, lookup_keys, shard_answers, tail_hash
from kvledger_connector.scheduler.requests import _Lookup
from kvledger_connector.shape.group_kind import GroupKind
from kvledger_connector.store.contract import StoreCode

# the loads whose outcomes decide whether a short load may still run inside the step (`load_is_async`)
LOAD_OUTCOME_WINDOW = 16


@dataclass(frozen=True)
class LookupAsk:
    """The store call a lookup needs (`SchedulerSteps.ask`): `batch_is_exist` of ``keys``, in `lookup_keys`'
    order, for the blocks ``hashes`` from block ``start`` and the partial ``tail``."""
    keys: tuple[str, ...]
    generation: int
    num_computed_tokens: int
    start: int
    hashes: tuple[Any, ...]
    tail: bytes | None


class LookupSteps(StepsBase):
    """The Lookup steps of `SchedulerSteps` (kvledger_connector/scheduler/steps.py), over its state."""

    def requeue_after_failed_load(self, request: RequestLike) -> bool:
        """Whether this lookup must answer "not known yet" (vLLM: ``None``, the request is skipped for this
        step), once after an async load of the request failed under ``recompute``. vLLM (0.32, 0.33) then
        frees every block of a request whose load failed as a whole (several KV cache groups; a failure at the
        hit's first block) but leaves it at the head of its queue of requests holding KV blocks
        (``kv_holding_waiting``), where it must now fit its whole prompt: when it does not, ``schedule()``
        stops there every step and never reaches the parked requests behind it whose blocks it would need,
        though their loads finished (running 0: a stall). Skipped without blocks, vLLM moves it to its
        ``waiting`` queue, so the parked requests behind it are promoted and go on."""
        st = self._reqs.get(request.request_id)
        if st is None or not self._reqs.current(st).requeue:
            return False
        st.requeue = False
        self.stats.add("failed_load_requeues")
        return True

    def ask(self, request: RequestLike, num_computed_tokens: int) -> int | LookupAsk:
        """Lookup, first half: the answer when there is one without the store (tokens beyond
        ``num_computed_tokens``: 0 with loads off or nothing to ask; the cached answer of the same question,
        per (req_id, generation, num_computed_tokens) while it waits), else the one store call to make
        (`LookupAsk`), whose codes go to `answer`. The steps make no store call: the caller does
        (`kvledger_connector.scheduler.side.ask_store`)."""
        st = self._reqs.ensure(request)
        if not self.load_enabled:  # nothing to ask, nothing to cache
            return 0
        gen = generation_of(request)
        hit = st.lookup
        if hit is not None and hit.generation == gen and hit.num_computed_tokens == num_computed_tokens:
            return max(hit.hit_tokens - num_computed_tokens, 0)
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if st.load_failed_at is not None:  # see `note_load_errors`
            end = min(end, st.load_failed_at)
        hashes = tuple(request.block_hashes[start:end]) if end > start else ()
        tail = None
        if self.save_partial_tail and end == request.num_tokens // bs:  # every full block is asked for
            tail = tail_hash(request, request.num_tokens, request.all_token_ids, bs)
        if not hashes and tail is None:
            self._reqs.set_lookup(st, _Lookup(gen, num_computed_tokens, num_computed_tokens))
            return 0
        asked = list(hashes) + ([tail] if tail is not None else [])
        return LookupAsk(tuple(lookup_keys(self.key_builders, asked)), gen, num_computed_tokens, start, hashes, tail)

    def answer(self, request: RequestLike, ask: LookupAsk, codes: Sequence[int] | None) -> int:
        """Lookup, second half: the store's codes for ``ask.keys`` (None: the call raised) -> the tokens
        beyond ``ask.num_computed_tokens`` that every shard holds (block aligned unless a partial tail hits;
        never the whole prompt: vLLM must compute at least one token), cached for the same question."""
        st = self._reqs.ensure(request)
        hit = self._hit(request, ask, codes)
        self._reqs.set_lookup(st, hit)
        return max(hit.hit_tokens - ask.num_computed_tokens, 0)

    def _hit(self, request: RequestLike, ask: LookupAsk, codes: Sequence[int] | None) -> _Lookup:
        bs, gen, start = self.block_size, ask.generation, ask.start
        self.stats.add("lookups")
        if codes is None:  # the store wrapper returns codes; only a raising test double gets here
            self.stats.fail_code(int(StoreCode.CLIENT_EXCEPTION), len(ask.keys))
            return _Lookup(gen, ask.num_computed_tokens, ask.num_computed_tokens)
        n = len(ask.hashes)
        rows = shard_answers(codes, len(self.key_builders), n + (ask.tail is not None))
        run = self._hit_run(rows, start, n)
        if self.events is not None and n:  # an announced block found missing: BlockRemoved
            self.events.looked_up(list(ask.hashes), [row[i] for row in rows for i in range(n)])
        if ask.tail is not None and run == n and all(row[n] == 1 for row in rows):
            self.stats.add("tail_hits")
            self.stats.add("lookup_hit_tokens", request.num_tokens - 1 - ask.num_computed_tokens)
            return _Lookup(gen, ask.num_computed_tokens, request.num_tokens - 1, ask.tail)
        self.stats.add("lookup_hit_tokens", run * bs)
        return _Lookup(gen, ask.num_computed_tokens, (start + run) * bs)

    def _hit_run(self, rows: Sequence[Sequence[int]], start: int, n: int) -> int:
        """The hit, in blocks past ``start``, from the lookup's answers (`shard_answers`), by vLLM's
        allocation rule: the longest h such that every full-attention key of blocks [start, start + h)
        exists and, for each sliding-window group of span W (a hybrid model), every key of the blocks vLLM
        leaves non-null for a hit ending at H = (start + h) * bs: those holding positions from H - W + 1 on;
        for each Mamba group ("align" mode), the state key of block start + h - 1 (the state after H
        tokens: vLLM's hit is that one snapshot). A sliding or state key below that never shortens the hit.
        Without sliding or state groups: the longest run every builder holds."""
        bs = self.block_size
        parts = [(s, GroupKind.of(kb.layout), kb.layout.window) for s, kb in enumerate(self.key_builders)]
        # full attention needs every block of the hit: its run is found by one scan, the others' needs
        # (`GroupKind.hit_needs`) are asked of each shorter hit in turn
        full = [s for s, kind, _ in parts if kind is GroupKind.FULL_ATTENTION]
        top = 0
        while top < n and all(rows[s][top] == 1 for s in full):
            top += 1
        rest = [(s, kind, w) for s, kind, w in parts if kind is not GroupKind.FULL_ATTENTION]
        for h in range(top, 0, -1):
            if all(rows[s][i] == 1 for s, kind, w in rest for i in kind.hit_needs(start, h, bs, w)):
                return h
        return 0

    def load_is_async(self, req_id: str, num_external_tokens: int) -> bool:
        """vLLM's ``load_kv_async`` for an external hit of ``num_external_tokens``: False (loaded inside the
        step that schedules the request) up to ``sync_load_max_tokens`` under the "fail" policy, unless the
        req_id still has a load pinned (its reports would race), or while most recent loads failed, or where
        a failed load is not reported by block. See kvledger_connector/scheduler/steps.py's notes for each."""
        return (num_external_tokens > self.sync_load_max_tokens or self.kv_load_failure_policy != "fail"
                or not self.kinds.fails_by_block  # several groups: vLLM takes a failed load per request
                or (self.ledger is not None and self.ledger.has_pinned_load(req_id))
                or self.loads_mostly_fail())

    def loads_mostly_fail(self) -> bool:
        """More than half of the last ``LOAD_OUTCOME_WINDOW`` loads' outcomes were failures."""
        return 2 * sum(self._load_outcomes) > len(self._load_outcomes)
