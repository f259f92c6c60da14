"""Collect and CollectLoad: the ranks' reports released in the ledger, and what a failed load teaches the
lookups.

Store jobs every rank reported free their pins in ascending job id order (`collect`); a load's pins go once
every rank finished it (vLLM's finished_recving for an async load, the ranks' completed_loads for a sync
one), and each released load counts once in the recent outcomes that decide whether short loads still run
inside the step (`loads_mostly_fail`). The failed blocks vLLM is told of (`note_load_errors`: by block, one
full-attention group) or the failed requests (`note_failed_loads`: per request, any other kinds, by
`GroupKinds.fails_by_block`) make the request's later lookups stop short of where its load failed.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from kvledger_connector.scheduler.base import StepsBase


class CollectSteps(StepsBase):
    """The Collect and CollectLoad steps of `SchedulerSteps` (kvledger_connector/scheduler/steps.py)."""

    def collect(self, completed_saves: Mapping[int, int]) -> int:
        """Collect: the ranks' merged reports ``{job: ranks}`` released in ascending job id order (each
        released job frees its blocks with its own free call, so the order is the free queue's)."""
        if not completed_saves:
            return 0
        ledger = self._ledger()
        released = ledger.collect(dict(sorted(completed_saves.items())))
        if self.events is not None:  # jobs every rank reported: BlockStored for what the store holds
            inflight = set(ledger.inflight_jobs())
            self.events.jobs_collected(completed_saves, inflight.__contains__)
        return released

    def note_failed_loads(self, failed_recving: Iterable[str] | None) -> None:
        """Loads vLLM is told failed as a whole (several KV cache groups: no block-level report). Each one's
        request answers its later lookups short of its load's first block, as `note_load_errors` does."""
        ledger = self.ledger
        if not failed_recving or ledger is None:
            return
        for req_id in failed_recving:
            if not ledger.has_pinned_load(req_id):
                continue  # not a load of ours
            self._failed_loads.add(req_id)
            st = self._reqs.get(req_id)
            if st is not None and st.load_dest:
                at = st.load_first
                st.load_failed_at = at if st.load_failed_at is None else min(st.load_failed_at, at)
                st.requeue = self.kv_load_failure_policy == "recompute"

    def note_load_errors(self, invalid_block_ids: Iterable[int] | None) -> None:
        """The blocks vLLM is told failed to load this step (before the loads' pins are collected): each
        one's request answers its later lookups short of the first of them. Under ``recompute`` vLLM sends
        a request whose async load failed back to its queue and asks again; a key that exists but whose
        get keeps failing would be hit, loaded and failed again without end."""
        ledger = self.ledger
        if not invalid_block_ids or ledger is None:
            return
        for b in invalid_block_ids:
            req_id = ledger.load_owner(b)
            if req_id is None:
                continue  # not a block of a pinned load of ours (another connector's)
            self._failed_loads.add(req_id)  # a pinned load's (its request may be gone: "fail" ended it)
            st = self._reqs.get(req_id)
            if st is None or b not in st.load_dest:
                continue  # a load of an earlier request under a reused id
            i = st.load_first + st.load_dest.index(b)
            st.load_failed_at = i if st.load_failed_at is None else min(st.load_failed_at, i)
            st.requeue = self.kv_load_failure_policy == "recompute"

    def _note_load_outcomes(self, req_ids: Iterable[str]) -> None:
        """Each load released by this report counts once in the recent outcomes (`loads_mostly_fail`)."""
        ledger = self._ledger()
        for req_id in req_ids:
            if not ledger.has_pinned_load(req_id):
                self._load_outcomes.append(req_id in self._failed_loads)
                self._failed_loads.discard(req_id)

    def collect_loads(self, finished_recving: Sequence[str] | set[str]) -> int:
        """CollectLoad: vLLM reports a req_id in ``finished_recving`` once every rank finished its load, so
        each counts all ranks at once; its load pins are released."""
        if not finished_recving:
            return 0
        world = self.world_size
        released = self._ledger().collect_loads({req_id: world for req_id in finished_recving})
        self._note_load_outcomes(finished_recving)
        return released

    def collect_sync_loads(self, completed_loads: Mapping[str, int]) -> int:
        """CollectLoad of sync loads: the ranks' merged ``completed_loads`` ``{req_id: ranks}``; a load's pins
        are released once every rank reported it (a rank that reports later releases it then)."""
        if not completed_loads:
            return 0
        released = self._ledger().collect_loads(dict(completed_loads))
        self._note_load_outcomes(completed_loads)
        return released
