"""EmitStore: which blocks of each scheduled (or deferred) request a store job pins and the ranks put, and
what a request's save progress is (`load_done`: loaded blocks count as saved; `emitted_blocks`).

`save_end` and the due partial tail make the job's `StoreRange`, `plan_store` its blocks (each KV cache
group's table read by its kind: null ids nothing to pin, a Mamba group only vLLM's offered states, a sliding
window only the blocks a later hit can use), and the ledger opens it, or DEFERs it at the caps: the save is
retried in later steps, keeping the blocks vLLM may give back meanwhile (`GroupKind.may_give_back`). An
input a save cannot serve costs that request's save only. A held request's retry moves its held state
(kvledger_connector/scheduler/held.py) once the guarded save returned.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from kvledger_connector.metadata import SaveSpec
from kvledger_connector.scheduler.base import StepsBase
from kvledger_connector.scheduler.plan import RequestLike, StoreRange, generation_of, plan_store, save_end, tail_hash
from kvledger_connector.scheduler.requests import _RequestState

#: a request's block tables (one per KV cache group, as vLLM's ``get_block_ids()``) by req_id, or None when
#: the scheduler has none for it now
TableOf = Callable[[str], "Sequence[Sequence[int]] | None"]


class SaveSteps(StepsBase):
    """The EmitStore steps of `SchedulerSteps` (kvledger_connector/scheduler/steps.py), over its state."""

    def _due_tail(self, st: _RequestState, token_len: int, end: int) -> bytes | None:
        """The prompt's partial tail hash when this job should carry it: tails on, not done this generation,
        the prompt computed by the end of this step. Gives the tail up (done) when there is none or decode
        already filled block k (saved whole instead)."""
        request = st.request
        if not self.save_partial_tail or st.tail_done or token_len < request.num_prompt_tokens:
            return None
        k = request.num_prompt_tokens // self.block_size
        tail = tail_hash(request, request.num_prompt_tokens, request.prompt_token_ids, self.block_size)
        if tail is None or end > k:
            st.tail_done = True
            return None
        return tail

    def load_done(self, request: RequestLike) -> None:
        """The load's outcome is applied: vLLM cut the failed blocks off (``kv_load_failure_policy``), so
        ``num_computed_tokens`` counts only the loaded blocks it kept. Those came from keys the store holds:
        they count as saved (no store job re-reads them; the model's HandleLoadErrors: emitted := kept).
        The connector calls it at the request's first save after its load pin was released (vLLM
        applies the outcome in the step that reports the load finished, before it schedules the request
        again); the replay driver where the model handles the load's errors."""
        st = self._reqs.get(request.request_id)
        if st is None or not self._reqs.current(st).load_pending:
            return
        kept = min(st.loaded_blocks, request.num_computed_tokens // self.block_size)
        if st.loaded_tail and request.num_computed_tokens >= request.num_prompt_tokens - 1:
            st.tail_done = st.tail_stored = True  # the tail was loaded whole: nothing to save again
        st.saved_blocks = max(st.saved_blocks, kept)
        st.loaded_blocks, st.loaded_tail, st.load_pending = 0, False, False

    def emitted_blocks(self, req_id: str) -> int:
        """Blocks of the request's current generation in the store or on their way: full blocks, plus the
        partial tail (the model's ``emitted``)."""
        st = self._reqs.get(req_id)
        if st is None:
            return 0
        st = self._reqs.current(st)
        return st.saved_blocks + st.tail_stored

    def emit_stores(self, scheduled: Mapping[str, int], table_of: TableOf,
                    boundary_states: Mapping[str, Sequence[tuple[int, int, int]]] | None = None) -> list[SaveSpec]:
        """EmitStore for this step: first the saves the cap deferred, of requests not scheduled now, then
        every scheduled request (``scheduled``: req_id -> tokens scheduled this step). ``boundary_states``:
        vLLM's Mamba hand-offs of this step, req_id -> [(group, block id, boundary tokens)]
        (``KVConnectorBlockState.boundary_state_offloads``), the only blocks a Mamba group saves from."""
        saves: list[SaveSpec] = []
        if self.save_enabled:
            offers = boundary_states or {}
            for req_id in self._reqs.deferred_ids():
                if req_id not in scheduled:
                    saves += self.emit_request_store(req_id, 0, table_of, offers.get(req_id, ()))
            for req_id, n in scheduled.items():
                saves += self.emit_request_store(req_id, n, table_of, offers.get(req_id, ()))
        ledger = self._ledger()
        self.stats.gauge("pins_in_flight", ledger.num_inflight_jobs)
        self.stats.gauge("pinned_blocks", ledger.num_pinned_blocks)
        return saves

    def emit_request_store(self, req_id: str, num_scheduled: int, table_of: TableOf,
                           boundary_states: Sequence[tuple[int, int, int]] = ()) -> list[SaveSpec]:
        """One request's part of `emit_stores` (the replay drives it alone: the model's EmitStore(r) is one
        request's, whatever else is deferred): its job, if one opened. A held request's retry that is not
        deferred again opened its job (released once that is reported) or has nothing left to save (released
        at the next step): its held state moves here, after the guarded save returned."""
        saves: list[SaveSpec] = []
        held = self._reqs.get(req_id) if self.held.awaits_save(req_id) else None
        defers = held.defers if held is not None else 0
        self._emit_store_guarded(saves, req_id, num_scheduled, table_of, boundary_states)
        if held is not None and held.defers == defers:
            self._reqs.set_deferred(held, False)
            self.held.retried(req_id, saves[-1].store_job_id if saves else None)
        return saves

    def _emit_store_guarded(self, saves: list[SaveSpec], req_id: str, num_scheduled: int, table_of: TableOf,
                            boundary_states: Sequence[tuple[int, int, int]]) -> None:
        """`emit_store`, where an input it cannot serve (a table or hashes vLLM's scheduler would never hand
        over) costs that request's save only: given up and counted, the step's other saves go out. A job,
        once opened, is in ``saves`` before anything else can raise: no pin is left without its report."""
        try:
            self.emit_store(saves, req_id, num_scheduled, table_of, boundary_states)
        except Exception as e:
            self.errors.append(f"save of {req_id!r} given up: {type(e).__name__}: {e}")
            self.stats.add("save_errors")
            st = self._reqs.get(req_id)
            if st is not None:
                self._reqs.set_deferred(st, False)
                st.kept_blocks = {}
                st.prompt_saved = True  # nothing more of this generation: the same input would fail again
            self._give_up_save()

    def _kept_blocks(self, st: _RequestState) -> dict[tuple[int, int], tuple[int, bool]]:
        """The blocks a deferred job of this generation kept (`_keep_blocks`), each with whether vLLM's
        prefix-cache record of it is still the one it had then (the block still holds those bytes)."""
        of = self.block_hash_of
        return {at: (block_id, of is not None and of(block_id) == record)
                for at, (block_id, record) in st.kept_blocks.items()}

    def _reachable_masks(self, request: RequestLike, lo: int, hi: int) -> dict[int, Sequence[bool]]:
        """Each sliding-window group's mask of blocks [lo, hi) that a later hit can use, by vLLM's rule
        (`reachable_blocks`); a group without a mask saves every block."""
        if self.reachable_blocks is None or hi <= lo:
            return {}
        masks: dict[int, Sequence[bool]] = {}
        for k in sorted(self.sliding_groups):
            mask = self.reachable_blocks(request, k, lo, hi)
            if mask is not None:
                masks[k] = mask
        return masks

    def _give_up_save(self) -> None:
        self.stats.add("saves_dropped")

    def _defer(self, st: _RequestState, tables: Sequence[Sequence[int]], end: int) -> None:
        """DEFER: the save is retried in a later step, keeping what vLLM may give back meanwhile."""
        self._reqs.set_deferred(st, True)
        st.defers += 1
        self._keep_blocks(st, tables, st.sent_blocks, end)

    def _keep_blocks(self, st: _RequestState, tables: Sequence[Sequence[int]], lo: int, hi: int) -> None:
        """A deferred job's blocks [lo, hi) of its Mamba and sliding-window groups, kept with vLLM's record of
        each (`block_hash_of`) for its retry; a block the prefix cache does not record is not kept
        (nothing would say its bytes stayed)."""
        kept: dict[tuple[int, int], tuple[int, object]] = {}
        if self.block_hash_of is not None:
            for g in self.kinds.groups(may_give_back=True):
                row = tables[g]
                for p in range(lo, min(hi, len(row))):
                    if row[p] != 0 and (record := self.block_hash_of(row[p])) is not None:
                        kept[(g, p)] = (row[p], record)
        st.kept_blocks = kept

    def emit_store(self, saves: list[SaveSpec], req_id: str, num_scheduled: int, table_of: TableOf,
                   boundary_states: Sequence[tuple[int, int, int]] = ()) -> None:
        """One request's EmitStore: `save_end` and the due tail make the `StoreRange`, `plan_store` the blocks
        its job pins (the tail block as ``tail_block_ids``) and sends, opened by `SchedulerLedger.open_job`; or
        DEFER at the caps (the blocks stay the request's; retried in a later step), or dropped when the job
        could never be admitted (a cache miss)."""
        st = self._reqs.get(req_id)
        if st is None or st.prompt_saved and st.generation == generation_of(st.request):
            return  # decode steps of a saved prompt: nothing to decide
        if self._ledger().has_pinned_load(req_id):
            return  # a sync load (this step's or earlier) not reported yet: its outcome is not known
        request = st.request
        bs = self.block_size
        token_len = request.num_computed_tokens + num_scheduled  # KV that exists after this step
        end = save_end(token_len=token_len, num_prompt_tokens=request.num_prompt_tokens,
                       num_tokens=request.num_tokens, num_hashes=len(request.block_hashes), block_size=bs,
                       save_decode=self.save_decode)
        if st.load_pending:
            self.load_done(request)  # first: a loaded tail is done
        saved = self._reqs.current(st).saved_blocks
        tail = self._due_tail(st, token_len, end)
        if end <= saved and tail is None:
            self._note_prompt_saved(st)
            return
        rng = StoreRange(saved, end, tail, request.num_prompt_tokens % bs if tail is not None else 0)
        found = table_of(req_id)
        if found is None:
            return
        tables = self._tables(found)
        if min(len(t) for t in tables) < rng.reach:
            return
        plan = plan_store(rng, tables, sent_blocks=st.sent_blocks, block_size=bs,
                          one_table=self.kinds.one_table, state_groups=self.state_groups, offers=boundary_states,
                          kept=self._kept_blocks(st),
                          reachable=self._reachable_masks(request, st.sent_blocks, rng.end))
        for at in plan.kept_expired:  # evicted, or its entry moved: that block is not saved
            del st.kept_blocks[at]
            self.stats.add("expired_kept_blocks")
        ledger = self._ledger()
        if ledger.num_load_pinned_blocks and ledger.any_load_destination(plan.pins + plan.tail_pins):
            # another request's sync load of this step writes a block this save reads (a prefix-cache hit
            # on it): its bytes are not known until the ranks report; retried in a later step
            self._defer(st, plan.rows, rng.end)
            return
        if len(plan.pins) + len(plan.tail_pins) > self.max_pinned_blocks:  # never admitted: a cache miss
            self._give_up_save()
            st.saved_blocks, st.tail_done = rng.end, True
            st.kept_blocks = {}
            self._note_prompt_saved(st)
            return
        gen = generation_of(request)
        sent = st.sent_blocks  # the ranks hold the ids and hashes of blocks [0, sent) of this generation
        hashes = tuple(request.block_hashes[sent:rng.end]) + ((rng.tail,) if rng.tail is not None else ())
        job_id = ledger.open_job(req_id, list(plan.pins), list(plan.tail_pins), generation=gen)
        if job_id is None:  # DEFER: the cap is reached; the blocks stay the request's, retry later
            if not st.deferred:
                self.stats.add("deferrals")
            self._defer(st, plan.rows, rng.end)
            return
        # sent at once: a job opened is pinned until every rank reports it, so it must reach the ranks
        saves.append(SaveSpec(req_id, job_id, gen, sent, rng.reach, plan.sent_ids, hashes,
                              tail_tokens=rng.tail_tokens, num_groups=len(plan.rows), null_before=plan.null_before))
        self._reqs.set_deferred(st, False)
        if plan.kept_used:  # this job pins the ones still held; none is kept past it
            self.stats.add("kept_blocks", plan.kept_used)
        st.kept_blocks = {}
        st.sent_blocks = rng.end
        if self.events is not None and rng.end > rng.start:  # routers hear of full blocks only
            self.events.job_opened(job_id, request, rng.start, rng.end)
        st.saved_blocks = rng.end
        if rng.tail is not None:
            st.tail_done = st.tail_stored = True
            self.stats.add("tail_saves")
        self.stats.add("store_jobs")
        self._note_prompt_saved(st)

    def _note_prompt_saved(self, st: _RequestState) -> None:
        """Without save_decode, once the prompt's full blocks are covered and its tail is done (or tails
        are off), no later step of this generation saves anything: the next ones skip the decision."""
        request = st.request
        st.prompt_saved = (not self.save_decode and not st.load_pending
                           and st.saved_blocks >= request.num_prompt_tokens // self.block_size
                           and (st.tail_done or not self.save_partial_tail))
