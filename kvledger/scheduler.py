"""Scheduler side: store job ids, block pins, the in-flight cap, and the release of pins on reports.

One :class:`SchedulerLedger` per engine, owned by the scheduler-side connector and called from the
scheduler thread only (no lock inside). Per engine step::

    build_connector_meta ──► open_job(req_id, block_ids[, tail_block_ids]) ──► job id | None (DEFER)
                                 pins: pool.touch(blocks)   record job -> [blocks, ranks_left=world_size]
    update_connector_output ► collect({job_id: count})       merged over ranks by metadata.aggregate
                                 ranks_left -= count; at 0: pool.free_blocks(reversed(blocks))  (tail first)
    update_state_after_alloc ► pin_load(req_id, block_ids)    EmitLoad: pool.touch(destination blocks)
    update_connector_output ► collect_loads({req_id: ranks})  finished_recving: at 0 ranks left, free them
    Scheduler.has_requests ─► has_pending_work()             True while any pin is held

Lifecycle: a job is in StoreJob ``emitted`` from :meth:`open_job` until its ``ranks_left`` reaches 0; the
workers drive its per-rank states (``queued`` .. ``reported``, see :mod:`kvledger.worker`); reaching 0
means every rank is in ``reported`` and this ledger performs ``Collect -> released``. The per-job hot path
therefore needs no table lookup here: the only transition the scheduler makes is implied by the count.

Costs, per job: one ``min()`` scan, one ``set()`` for the duplicate check, one C-level ``map`` to block
objects, the pool calls; the block objects are kept so the release does not index the pool again.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar

from .counts import Counter, Counts
from .errors import LedgerInputError, LedgerInvariantError, check_positive_int
from .trace import TraceSink

#: vLLM's null block id (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``; a test checks they agree).
#: Real block ids are >= 1, so one ``min(ids) <= 0`` finds both the null block and negative ids.
NULL_BLOCK_ID = 0

B = TypeVar("B")


class BlockPoolLike(Protocol[B]):
    """What the ledger needs of vLLM's ``BlockPool`` (0.32.0): ``blocks`` indexed by block id, and the two
    reference-count calls."""

    blocks: Sequence[B]

    def touch(self, blocks: Sequence[B]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[B]) -> None: ...


class SchedulerLedger:
    """Job ids, pins and the cap. ``max_pinned_blocks`` counts block pins (a block pinned by two jobs
    counts twice): an upper bound on distinct pinned blocks, so the cap on it bounds them too.

    Counted into ``counts`` (the connector's recorder, or the ledger's own `Counts`): jobs_released,
    unknown_reports, loads_pinned, loads_released. A deferred `open_job` is not counted here: its caller
    sees the None and counts the deferred save."""

    def __init__(self, block_pool: BlockPoolLike[Any], *, world_size: int, max_inflight_jobs: int,
                 max_pinned_blocks: int, first_job_id: int = 0, trace: TraceSink | None = None,
                 counts: Counter | None = None) -> None:
        check_positive_int("world_size", world_size)
        check_positive_int("max_inflight_jobs", max_inflight_jobs)
        check_positive_int("max_pinned_blocks", max_pinned_blocks)
        check_positive_int("first_job_id", first_job_id, allow_zero=True)
        for attr in ("blocks", "touch", "free_blocks"):
            if not hasattr(block_pool, attr):
                raise LedgerInputError("block_pool", type(block_pool).__name__, f"has no {attr!r}")
        self._pool = block_pool
        self._blocks = block_pool.blocks
        self._get_block = block_pool.blocks.__getitem__
        self._touch = block_pool.touch
        self._first_job_id = first_job_id
        self._world_size = world_size
        self._max_jobs = max_inflight_jobs
        self._max_pins = max_pinned_blocks
        self._next_job_id = first_job_id
        # job id -> [block objects in pin order, ranks_left]; a list so the count updates in place.
        self._pinned: dict[int, list[Any]] = {}
        self._num_pins = 0
        self._trace = trace
        # Load pins (EmitLoad .. CollectLoad): req_id -> FIFO of [block objects, ranks_left], one per async
        # load (a FIFO: a reused req_id may start a load before its old one's ranks all finished), and
        # block id -> req_id of the load writing into it. Bound: a block is the destination of at most
        # one pinned load (S9 LoadsPinned, checked), so load-pinned blocks <= the pool's blocks.
        self._loads: dict[str, list[list[Any]]] = {}
        self._load_dest: dict[int, str] = {}
        self.peak_load_pinned_blocks = 0
        self.counts: Counter = counts if counts is not None else Counts()
        self.peak_pinned_blocks = 0
        self.peak_inflight_jobs = 0

    # ---------------------------------------------------------------- EmitStore
    def open_job(self, req_id: str, block_ids: Sequence[int],
                 tail_block_ids: Sequence[int] = (), *, generation: int | None = None) -> int | None:
        """EmitStore: a new store job id, with every block of ``block_ids`` then of ``tail_block_ids``
        (copy-on-write tail blocks outside the table) pinned, deduplicated in order.

        Returns None (DEFER) when the cap on in-flight jobs or pinned blocks would be exceeded: nothing was
        pinned and no id was used; the caller keeps the save and asks again in a later step. Raises
        :class:`LedgerInputError` for the null block (the caller drops null positions: nothing to pin), a
        block id outside the pool, or a job that needs more pins than ``max_pinned_blocks`` (it could never
        be admitted). ``generation`` (the request's, as the ranks get it in the job's metadata) is only
        written to the trace."""
        try:
            fast = not tail_block_ids and (not block_ids or min(block_ids) > NULL_BLOCK_ID)
        except TypeError:  # a non-int id: the slow path names it
            fast = False
        if fast:
            ids = block_ids
            if len(set(ids)) != len(ids):
                ids = list(dict.fromkeys(ids))
        else:
            ids = self._checked_ids(block_ids, tail_block_ids)
        n = len(ids)
        pinned = self._pinned
        njobs = len(pinned)
        pins = self._num_pins + n
        if njobs >= self._max_jobs or pins > self._max_pins:
            if n > self._max_pins:
                raise LedgerInputError("block_ids", f"{n} blocks for {req_id!r}",
                                       f"more than max_pinned_blocks={self._max_pins}: never admissible")
            return None
        try:
            blocks = list(map(self._get_block, ids))
        except (IndexError, TypeError):
            bad = [b for b in ids if b.__class__ is not int or not 0 < b < len(self._blocks)]
            raise LedgerInputError("block_ids", bad, f"not block ids of this pool "
                                   f"(1..{len(self._blocks) - 1}) for {req_id!r}") from None
        job_id = self._next_job_id
        self._next_job_id = job_id + 1
        self._touch(blocks)
        pinned[job_id] = [blocks, self._world_size]
        self._num_pins = pins
        if pins > self.peak_pinned_blocks:
            self.peak_pinned_blocks = pins
        if njobs >= self.peak_inflight_jobs:
            self.peak_inflight_jobs = njobs + 1
        if self._trace is not None:
            # tail: the pinned ids that came from tail_block_ids only (ids is deduplicated, tail last)
            tail: list[int] = []
            if tail_block_ids:
                full = set(block_ids)
                tail = [b for b in ids if b not in full]
            self._trace.emit("sched", "EmitStore", {
                "job": job_id, "req_id": req_id, "generation": generation, "blocks": list(ids),
                "tail": tail,
                "ranks_left": self._world_size,
                "pinned_jobs": len(self._pinned), "pinned_blocks": pins})
        return job_id

    @staticmethod
    def _checked_ids(block_ids: Sequence[int], tail_block_ids: Sequence[int]) -> list[int]:
        ids = [*block_ids, *tail_block_ids]
        bad = [b for b in ids if b.__class__ is not int or b <= NULL_BLOCK_ID]
        if bad:
            raise LedgerInputError("block_ids", bad, "block ids must be ints > 0 (the null block is never pinned: "
                                   "its positions are dropped before)")
        return list(dict.fromkeys(ids))

    # ---------------------------------------------------------------- Collect
    def collect(self, completed: Mapping[int, int]) -> int:
        """Collect: consume merged worker reports ``{job_id: number of ranks that finished it}``.

        An unknown job id is ignored and counted (``unknown_reports``). When a job's ``ranks_left``
        reaches 0 its blocks are freed in reverse pin order (tail first). Returns the number of jobs released.

        A count that would take ``ranks_left`` below 0 raises ``LedgerInvariantError`` (S5 ReportedOnce) and
        a count that is not a positive int raises ``LedgerInputError``, each after every other entry was
        applied; the offending job keeps its pins (holding a pin too long is safe, freeing early is not)."""
        pinned = self._pinned
        free = self._pool.free_blocks
        released = 0
        bad: list[tuple[int, Any]] | None = None
        trace = self._trace
        rel_ids: list[int] | None = [] if trace is not None else None
        unknown: list[Any] | None = [] if trace is not None else None
        for job_id, n in completed.items():
            rec = pinned.get(job_id)
            if rec is None:
                self.counts.add("unknown_reports")
                if unknown is not None:
                    unknown.append(job_id)
                continue
            if n.__class__ is not int or n <= 0:
                if bad is None:
                    bad = []
                bad.append((job_id, n))
                continue
            left = rec[1] - n
            if left > 0:
                rec[1] = left
                continue
            if left < 0:
                if bad is None:
                    bad = []
                bad.append((job_id, n))
                continue
            del pinned[job_id]
            blocks = rec[0]
            self._num_pins -= len(blocks)
            free(reversed(blocks))
            released += 1
            if rel_ids is not None:
                rel_ids.append(job_id)
        if released:
            self.counts.add("jobs_released", released)
        if trace is not None:
            trace.emit("sched", "Collect", {
                "completed": {str(k): v for k, v in completed.items()},
                "released": rel_ids,
                "ranks_left": {str(j): pinned[j][1] for j in completed if j in pinned},
                "unknown": unknown, "pinned_jobs": len(pinned), "pinned_blocks": self._num_pins})
        if bad is not None:
            self._raise_bad(bad)
        return released

    def _raise_bad(self, bad: list[tuple[int, Any]]) -> None:
        over = [(j, n) for j, n in bad if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if over:
            detail = ", ".join(f"job {j}: count {n} > ranks_left {self._pinned[j][1]}" for j, n in over)
            raise LedgerInvariantError.of("S5", f"over-report ({detail}); pins kept")
        j, n = bad[0]
        raise LedgerInputError(f"completed[{j}]", n, "a report count must be a positive int")

    # ---------------------------------------------------------------- EmitLoad / CollectLoad
    def pin_load(self, req_id: str, block_ids: Sequence[int]) -> None:
        """EmitLoad: pin the destination blocks of ``req_id``'s async load (vLLM allocated them to the
        request) until every rank reported the load finished (:meth:`collect_loads`). The request may be
        aborted meanwhile (its blocks are freed at once): the pin keeps them out of the free queue while a
        rank's load thread may still write into them (S9 LoadsPinned).

        Raises :class:`LedgerInputError` for an empty load, the null block or an id outside the pool, and
        :class:`LedgerInvariantError` (S9) for a block that is already the destination of a pinned load
        (two loads writing one block; it also bounds the load pins by the pool). Nothing is pinned then."""
        ids = list(block_ids)
        if not ids:
            raise LedgerInputError("block_ids", ids, f"a load of no blocks for {req_id!r}")
        if len(set(ids)) != len(ids):
            raise LedgerInputError("block_ids", ids, f"a load writes a block twice for {req_id!r}")
        bad = [b for b in ids if b.__class__ is not int or not NULL_BLOCK_ID < b < len(self._blocks)]
        if bad:
            raise LedgerInputError("block_ids", bad, f"not block ids of this pool "
                                   f"(1..{len(self._blocks) - 1}) for the load of {req_id!r}")
        taken = [b for b in ids if b in self._load_dest]
        if taken:
            raise LedgerInvariantError.of("S9", f"blocks {taken} of the load of {req_id!r} are the destination "
                                                f"of the pinned load of {self._load_dest[taken[0]]!r}")
        blocks = list(map(self._get_block, ids))
        self._touch(blocks)
        self._loads.setdefault(req_id, []).append([blocks, self._world_size])
        for b in ids:
            self._load_dest[b] = req_id
        self.counts.add("loads_pinned")
        n = len(self._load_dest)
        if n > self.peak_load_pinned_blocks:
            self.peak_load_pinned_blocks = n
        if self._trace is not None:
            self._trace.emit("sched", "EmitLoad", {
                "req_id": req_id, "blocks": ids, "ranks_left": self._world_size,
                "pinned_loads": self.num_pinned_loads, "load_pinned_blocks": n})

    def collect_loads(self, completed: Mapping[str, int]) -> int:
        """CollectLoad: ``{req_id: number of ranks that finished its load}`` (the connector passes vLLM's
        ``finished_recving``, which vLLM reports once every rank finished: count = world size). A load whose
        ``ranks_left`` reaches 0 drops its pins (tail first). A report applies to the oldest pinned load of
        the req_id. Returns the number of loads released.

        After applying every other entry: a req_id with no pinned load raises :class:`LedgerInputError`
        (a report of a load that was never emitted or was already released), a count that is not a
        positive int likewise, and a count above ``ranks_left`` raises :class:`LedgerInvariantError` (S9:
        releasing early would let a rank still loading write into a block the pool can reuse); the
        offending load keeps its pins."""
        free = self._pool.free_blocks
        released: list[str] = []
        bad: list[tuple[str, Any, str]] = []
        for req_id, n in completed.items():
            fifo = self._loads.get(req_id)
            if not fifo:
                bad.append((req_id, n, "unknown"))
                continue
            if n.__class__ is not int or n <= 0:
                bad.append((req_id, n, "count"))
                continue
            rec = fifo[0]
            left = rec[1] - n
            if left < 0:
                bad.append((req_id, n, "over"))
                continue
            rec[1] = left
            if left:
                continue
            fifo.pop(0)
            if not fifo:
                del self._loads[req_id]
            for blk in rec[0]:
                del self._load_dest[blk.block_id]
            free(reversed(rec[0]))
            released.append(req_id)
        if released:
            self.counts.add("loads_released", len(released))
        if self._trace is not None:
            self._trace.emit("sched", "CollectLoad", {
                "completed": dict(completed), "released": released,
                "ranks_left": {r: self._loads[r][0][1] for r in completed if r in self._loads},
                "unknown": [r for r, _, why in bad if why == "unknown"],
                "pinned_loads": self.num_pinned_loads, "load_pinned_blocks": len(self._load_dest)})
        for req_id, n, why in bad:
            if why == "over":
                raise LedgerInvariantError.of("S9", f"load of {req_id!r} reported by {n} ranks, "
                                                    f"{self._loads[req_id][0][1]} left; pins kept")
        for req_id, n, why in bad:
            if why == "unknown":
                raise LedgerInputError("completed", req_id, "no pinned load of this request "
                                       "(never emitted, or every rank already reported it)")
            raise LedgerInputError(f"completed[{req_id!r}]", n, "a report count must be a positive int")
        return len(released)

    @property
    def num_pinned_loads(self) -> int:
        return sum(map(len, self._loads.values()))

    @property
    def num_load_pinned_blocks(self) -> int:
        return len(self._load_dest)

    def has_pinned_load(self, req_id: str) -> bool:
        return req_id in self._loads

    def load_owner(self, block_id: int) -> str | None:
        """The req_id whose pinned load writes ``block_id`` (None: no pinned load does)."""
        return self._load_dest.get(block_id)

    def any_load_destination(self, block_ids: Sequence[int]) -> bool:
        """Whether a pinned load may still write one of ``block_ids`` (its bytes are not known yet)."""
        dest = self._load_dest
        return any(b in dest for b in block_ids)

    def load_pinned_block_ids(self, req_id: str) -> list[int]:
        """Destination blocks of the oldest pinned load of ``req_id``, in order (introspection)."""
        fifo = self._loads.get(req_id)
        if not fifo:
            raise LedgerInputError("req_id", req_id, "has no pinned load")
        return [b.block_id for b in fifo[0][0]]

    def load_ranks_left(self, req_id: str) -> int:
        fifo = self._loads.get(req_id)
        if not fifo:
            raise LedgerInputError("req_id", req_id, "has no pinned load")
        return fifo[0][1]

    def pinned_loads(self) -> list[str]:
        """req_ids with a pinned load (oldest first per req_id)."""
        return list(self._loads)

    # ---------------------------------------------------------------- queries
    def has_pending_work(self) -> bool:
        """True while any job or load holds pins (vLLM's ``has_pending_push_work``)."""
        return bool(self._pinned) or bool(self._loads)

    @property
    def num_inflight_jobs(self) -> int:
        return len(self._pinned)

    @property
    def num_pinned_blocks(self) -> int:
        """Block pins held (with multiplicity)."""
        return self._num_pins

    @property
    def num_jobs_opened(self) -> int:
        return self._next_job_id - self._first_job_id

    @property
    def next_job_id(self) -> int:
        return self._next_job_id

    def pinned_block_ids(self, job_id: int) -> list[int]:
        """Block ids pinned by a job, in pin order (introspection; not on the hot path)."""
        rec = self._pinned.get(job_id)
        if rec is None:
            raise LedgerInputError("job_id", job_id, "not an in-flight store job")
        return [b.block_id for b in rec[0]]

    def ranks_left(self, job_id: int) -> int:
        rec = self._pinned.get(job_id)
        if rec is None:
            raise LedgerInputError("job_id", job_id, "not an in-flight store job")
        return rec[1]

    def inflight_jobs(self) -> list[int]:
        return list(self._pinned)

    def is_job_pinned(self, job_id: int) -> bool:
        """The job still holds its pins: some rank has not reported it."""
        return job_id in self._pinned

    def stats(self) -> dict[str, int]:
        """The live sizes and peaks, and the counters' totals as ``counts`` holds them (a shared recorder's
        totals are those of every ledger counting into it)."""
        total = self.counts.total
        return {
            "inflight_jobs": len(self._pinned), "pinned_blocks": self._num_pins,
            "jobs_opened": self.num_jobs_opened, "jobs_released": int(total("jobs_released")),
            "unknown_reports": int(total("unknown_reports")),
            "peak_pinned_blocks": self.peak_pinned_blocks, "peak_inflight_jobs": self.peak_inflight_jobs,
            "pinned_loads": self.num_pinned_loads, "load_pinned_blocks": len(self._load_dest),
            "loads_pinned": int(total("loads_pinned")), "loads_released": int(total("loads_released")),
        }

    def release_all(self) -> int:
        """Free every pin now (engine shutdown, after the workers stopped: no DMA can read and no load
        can write any more), load pins included. Returns the number of store jobs released."""
        loads = 0
        for fifo in self._loads.values():
            for blocks, _ in fifo:
                self._pool.free_blocks(reversed(blocks))
                loads += 1
        if loads:
            self.counts.add("loads_released", loads)
        self._loads.clear()
        self._load_dest.clear()
        n = 0
        for job_id in list(self._pinned):
            blocks, _ = self._pinned.pop(job_id)
            self._num_pins -= len(blocks)
            self._pool.free_blocks(reversed(blocks))
            n += 1
        if n:
            self.counts.add("jobs_released", n)
        return n
