"""Worker side (one per rank): which store jobs are live, per request generation.

A :class:`StoreRequestState` is one generation of one request on this rank: its live job ids, its saved
offset (tokens persisted by live jobs), its pressure-skip flag and its StoreRequest state
(``open`` / ``closing`` / ``closed``). A preempted ``req_id`` that comes back gets a fresh state; the old
one's leftover jobs are *stale*: they run nothing and change nothing, but are still reported, so the
scheduler releases their pins.

Per job and per notice (the connector holds one lock around every call; no lock inside)::

    start_load_kv ─► drop_generation(req_id, finished=)   DropGeneration  open -> closed | closing
                     (WorkerSide.start_step: a step's notices before its jobs)
    wait_for_save ─► register(req_id, job_id)            Receive   emitted -> queued      (before enqueue)
                     refuse(req_id, job_id)               Receive of a malformed spec's job: stale on
                                                          arrival, in no open generation (then finish)
    store thread ──► begin(job_id) -> RUN|STALE|SKIP      DmaRead   queued -> running|stale|skipped
                     saved_offset(job_id)                 where the put resumes
                     record_saved(job_id, num_tokens)     Put       running -> stored  (offset, if live)
                     record_failed(job_id, pressure=..)   Put/DmaRead -> failed
                     finish(job_id)   (in a finally)      Report    -> reported  (exactly once)
    build_connector_worker_meta ─► take_completed()       {job_id: 1} for the scheduler's collect

Every lifecycle change goes through the compiled StoreJob / StoreRequest tables (:mod:`kvledger.machines`).
Bounds: live jobs plus reported-not-taken jobs <= ``max_live_jobs`` (the scheduler's in-flight cap bounds
them: a job stays pinned there until its report is taken and collected), request states <=
``max_requests``.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any

from .errors import LedgerInputError, LedgerInvariantError, check_positive_int
from .machines import STORE_JOB, STORE_JOB_ALLOWED, STORE_REQUEST, step
from .trace import TraceSink


def put_positions(start: int, end: int, replica: int, replicas: int) -> list[int]:
    """The block positions in ``[start, end)`` of a request that this rank puts.

    Ranks that hold identical KV (MLA's latent, KV heads replicated across TP ranks) share keys, and each
    key is put by exactly one of them: the replica whose index is the position modulo ``replicas``
    (tla/KVLedger.tla ``Owner``, under ``Stripe``). Every replica computes this split from the same
    metadata, so a group puts each key once; every replica still loads every key. ``replicas`` 1: all."""
    check_positive_int("replicas", replicas)
    if replica.__class__ is not int or not 0 <= replica < replicas:
        raise LedgerInputError("replica", replica, f"must be an int in 0..{replicas - 1}")
    if start.__class__ is not int or end.__class__ is not int or start < 0:
        raise LedgerInputError("start", start, f"must be an int >= 0 with an int end (end={end!r})")
    if replicas == 1:
        return list(range(start, end))
    first = start + (replica - start) % replicas
    return list(range(first, end, replicas))


class Verdict(enum.Enum):
    RUN = "running"
    STALE = "stale"
    SKIP = "skipped"


class StoreRequestState:
    """One generation of one request on one rank."""

    __slots__ = ("req_id", "generation", "live", "saved_offset", "pressure_skip", "state")

    def __init__(self, req_id: str, generation: int) -> None:
        self.req_id = req_id
        self.generation = generation
        self.live: set[int] = set()
        self.saved_offset = 0
        self.pressure_skip = False
        self.state = "open"

    def __repr__(self) -> str:
        return (f"StoreRequestState({self.req_id!r}, gen={self.generation}, {self.state}, "
                f"live={sorted(self.live)}, offset={self.saved_offset}, skip={self.pressure_skip})")


class _Job:
    __slots__ = ("job_id", "req", "state")

    def __init__(self, job_id: int, req: StoreRequestState) -> None:
        self.job_id = job_id
        self.req = req
        self.state = "emitted"


def _refuse(job: "_Job", trigger: str, dest: str) -> None:
    """The error path of the inlined table checks: raises the named lifecycle error."""
    step(STORE_JOB, "StoreJob", job.state, trigger, dest, job.job_id)


class WorkerLedger:
    def __init__(self, rank: int, *, max_live_jobs: int, max_requests: int | None = None,
                 trace: TraceSink | None = None) -> None:
        check_positive_int("rank", rank, allow_zero=True)
        check_positive_int("max_live_jobs", max_live_jobs)
        if max_requests is None:
            max_requests = max_live_jobs
        check_positive_int("max_requests", max_requests)
        self.rank = rank
        self._actor = f"w{rank}"
        self._max_jobs = max_live_jobs
        self._max_requests = max_requests
        # req_id -> its open generation. A closing generation leaves this map (the req_id may come back
        # as a new request while the old jobs still save) and lives in _closing until its last report.
        self._requests: dict[str, StoreRequestState] = {}
        self._closing: set[StoreRequestState] = set()
        self._jobs: dict[int, _Job] = {}
        self._completed: dict[int, int] = {}
        # recently reported job ids (insertion-ordered, bounded) to tell a double finish from an unknown id
        self._reported: OrderedDict[int, None] = OrderedDict()
        self._pressure = False
        self._skipped: set[StoreRequestState] = set()
        self._next_generation = 0
        self._trace = trace

    @property
    def max_requests(self) -> int:
        return self._max_requests

    # ---------------------------------------------------------------- Receive
    def register(self, req_id: str, job_id: int, generation: int | None = None) -> None:
        """Receive: put ``job_id`` in the live set of ``req_id``'s open generation. Call before the job is
        enqueued, so a concurrent drop sees it.

        ``generation``: the scheduler's generation of the request (number of admissions), carried in the
        job's metadata. Give it: it is how a rank learns of a preemption nobody announced
        (``reset_prefix_cache(reset_running_requests=True)`` preempts outside ``schedule()``). A job of a
        newer generation closes the open one (its jobs become stale) and opens a fresh state; a job of an
        older generation is registered stale. Without it, the rank numbers generations itself and only
        :meth:`drop_generation` separates them."""
        if job_id.__class__ is not int:
            raise LedgerInputError("job_id", job_id, "must be an int")
        if generation is not None and (generation.__class__ is not int or generation < 0):
            raise LedgerInputError("generation", generation, "must be an int >= 0")
        if self.knows_job(job_id):
            raise LedgerInputError("job_id", job_id, f"already registered on rank {self.rank}")
        if len(self._jobs) + len(self._completed) >= self._max_jobs:
            raise LedgerInvariantError.of(
                "S6", f"rank {self.rank}: {len(self._jobs)} live + {len(self._completed)} reported-not-taken "
                      f"jobs reach max_live_jobs={self._max_jobs}; job {job_id} refused (the scheduler cap "
                      f"must not exceed it)")
        req = self._requests.get(req_id)
        live = True
        superseded: list[int] = []
        if req is None or (generation is not None and generation > req.generation):
            if req is None and len(self._requests) >= self._max_requests:
                raise LedgerInputError("max_requests", self._max_requests,
                                       f"rank {self.rank} holds that many request states; {req_id!r} refused "
                                       f"(a DropGeneration is missing?)")
            if req is not None:  # unannounced preemption: the newer generation supersedes the open one
                superseded = self._close(req, finished=False, generation=generation, emit=False)
            if generation is None:
                generation = self._next_generation
                self._next_generation += 1
            req = StoreRequestState(req_id, generation)
            self._requests[req_id] = req
        elif generation is not None and generation < req.generation:
            # a job of a generation that is already gone: registered (it will be reported) but stale
            req = StoreRequestState(req_id, generation)
            req.state = "closed"
            live = False
        job = _Job(job_id, req)
        if ("emitted", "Receive", "queued") not in STORE_JOB_ALLOWED:
            _refuse(job, "Receive", "queued")
        job.state = "queued"
        self._jobs[job_id] = job
        if live:
            req.live.add(job_id)
        if self._trace is not None:
            self._trace.emit(self._actor, "Receive", {
                "job": job_id, "req_id": req_id, "generation": req.generation, "live": sorted(req.live),
                "stale_on_arrival": not live, "superseded": superseded})

    def refuse(self, req_id: str, job_id: int) -> None:
        """Receive of a job whose spec was refused whole (malformed): registered stale on arrival, in a
        generation of its own that is already closed, so it joins no open generation, changes no request's
        state and runs nothing. Report it next (`finish`): the scheduler releases its pins on the report.
        Refused like `register` if ``job_id`` is not an int or is known here (its report would count twice)."""
        if job_id.__class__ is not int:
            raise LedgerInputError("job_id", job_id, "must be an int")
        if self.knows_job(job_id):
            raise LedgerInputError("job_id", job_id, f"already registered on rank {self.rank}")
        if len(self._jobs) + len(self._completed) >= self._max_jobs:
            raise LedgerInvariantError.of(
                "S6", f"rank {self.rank}: {len(self._jobs)} live + {len(self._completed)} reported-not-taken "
                      f"jobs reach max_live_jobs={self._max_jobs}; refused job {job_id} not registered")
        open_ = self._requests.get(req_id)
        req = StoreRequestState(req_id, open_.generation if open_ is not None else 0)
        req.state = "closed"
        job = _Job(job_id, req)
        if ("emitted", "Receive", "queued") not in STORE_JOB_ALLOWED:
            _refuse(job, "Receive", "queued")
        job.state = "queued"
        self._jobs[job_id] = job
        if self._trace is not None:
            self._trace.emit(self._actor, "Receive", {
                "job": job_id, "req_id": req_id, "generation": req.generation, "live": [],
                "stale_on_arrival": True, "superseded": []})

    def knows_job(self, job_id: int) -> bool:
        """Registered and not yet reported, or reported recently (a second Receive of it is refused)."""
        return job_id in self._jobs or job_id in self._reported or job_id in self._completed

    def _job(self, job_id: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            if job_id in self._reported or job_id in self._completed:
                raise LedgerInvariantError.of("S5", f"rank {self.rank}: job {job_id} was already reported")
            raise LedgerInputError("job_id", job_id, f"not registered on rank {self.rank}")
        return job

    # ---------------------------------------------------------------- DmaRead
    def begin(self, job_id: int) -> Verdict:
        """DmaRead: RUN if the job is live and its request not pressure-skipped, STALE if its generation was
        dropped, SKIP under store pressure. Only RUN may read blocks and put."""
        job = self._job(job_id)
        req = job.req
        if job_id not in req.live:
            verdict = Verdict.STALE
        elif self._pressure and req.pressure_skip:
            verdict = Verdict.SKIP
        else:
            verdict = Verdict.RUN
        dest = verdict.value
        if (job.state, "DmaRead", dest) not in STORE_JOB_ALLOWED:
            _refuse(job, "DmaRead", dest)
        job.state = dest
        if self._trace is not None:
            self._emit_job("DmaRead", job, {"dest": job.state, "offset": req.saved_offset})
        return verdict

    def saved_offset(self, job_id: int) -> int:
        """Tokens already persisted by the job's generation on this rank (the put resumes there)."""
        return self._job(job_id).req.saved_offset

    # ---------------------------------------------------------------- Put
    def record_saved(self, job_id: int, num_tokens: int) -> bool:
        """Put ok: every key up to ``num_tokens`` is in the store. Moves the saved offset forward (never
        back) and clears store pressure, only if the job is still live (a drop can race the put).
        Returns whether it had an effect."""
        if num_tokens.__class__ is not int or num_tokens < 0:
            raise LedgerInputError("num_tokens", num_tokens, "must be an int >= 0")
        job = self._job(job_id)
        if (job.state, "Put", "stored") not in STORE_JOB_ALLOWED:
            _refuse(job, "Put", "stored")
        job.state = "stored"
        req = job.req
        live = job_id in req.live
        if live:
            if num_tokens > req.saved_offset:
                req.saved_offset = num_tokens
            if self._pressure or self._skipped:
                self.clear_pressure()
        if self._trace is not None:
            self._emit_job("Put", job, {"dest": "stored", "num_tokens": num_tokens, "pressure": False,
                                        "live": live, "offset": req.saved_offset})
        return live

    def record_failed(self, job_id: int, *, pressure: bool = False) -> None:
        """The job failed: before the read (``DmaRead -> failed``, from ``queued``) or at the put
        (``Put -> failed``, from ``running``). ``pressure``: the store had no space; the store is marked under
        pressure and, if the job is live, its request is skipped until a later put succeeds."""
        job = self._job(job_id)
        trigger = "DmaRead" if job.state == "queued" else "Put"
        if (job.state, trigger, "failed") not in STORE_JOB_ALLOWED:
            _refuse(job, trigger, "failed")
        job.state = "failed"
        req = job.req
        live = job_id in req.live
        if pressure:
            self._pressure = True
            if live:
                req.pressure_skip = True
                self._skipped.add(req)
        if self._trace is not None:
            self._emit_job(trigger, job, {"dest": "failed", "num_tokens": 0, "pressure": pressure,
                                          "live": live, "offset": req.saved_offset})

    def clear_pressure(self) -> None:
        """The store accepted a put again: no request is skipped any more."""
        self._pressure = False
        for req in self._skipped:
            req.pressure_skip = False
        self._skipped.clear()

    @property
    def under_pressure(self) -> bool:
        return self._pressure

    # ---------------------------------------------------------------- Report
    def finish(self, job_id: int) -> None:
        """Report: the job leaves the live set and is counted for :meth:`take_completed`. Exactly once per
        job, on every exit path (call it in a ``finally``); a job still ``queued`` or ``running`` (the handler
        raised) is first moved to ``failed``. A second call raises S5 ReportedOnce."""
        job = self._job(job_id)
        state = job.state
        if state == "queued" or state == "running":  # the handler raised: the job failed
            trigger = "DmaRead" if state == "queued" else "Put"
            if (state, trigger, "failed") not in STORE_JOB_ALLOWED:
                _refuse(job, trigger, "failed")
            state = job.state = "failed"
        if (state, "Report", "reported") not in STORE_JOB_ALLOWED:
            _refuse(job, "Report", "reported")
        job.state = "reported"
        del self._jobs[job_id]
        req = job.req
        req.live.discard(job_id)
        self._completed[job_id] = 1
        reported = self._reported
        reported[job_id] = None
        if len(reported) > self._max_jobs:
            reported.popitem(last=False)  # OrderedDict: O(1) (a dict's next(iter()) degrades)
        closed = False
        if req.state == "closing" and not req.live:
            req.state = step(STORE_REQUEST, "StoreRequest", "closing", "Report", "closed", req.req_id)
            self._forget(req)
            closed = True
        if self._trace is not None:
            self._emit_job("Report", job, {"from": state, "live": sorted(req.live), "closed": closed})

    def take_completed(self) -> dict[int, int]:
        """Get and clear the jobs reported since the last call: ``{job_id: 1}``."""
        done = self._completed
        self._completed = {}
        return done

    # ---------------------------------------------------------------- DropGeneration
    def drop_generation(self, req_id: str, *, finished: bool, generation: int | None = None) -> str | None:
        """DropGeneration: the scheduler preempted (``finished=False``) or finished ``req_id``
        (``generation``: which generation, as in :meth:`register`).

        Preemption closes the open generation at once: its live jobs become stale. A finish with live jobs
        moves it to ``closing`` (the jobs still save: their blocks are pinned) and detaches it from
        ``req_id``; it closes when its last job reports. Returns the new StoreRequest state, or None when
        there is nothing to drop: no open generation (never saved on this rank, already closed, or
        closing), or a late notice about an older generation than the open one."""
        if generation is not None and (generation.__class__ is not int or generation < 0):
            raise LedgerInputError("generation", generation, "must be an int >= 0")
        req = self._requests.get(req_id)
        if req is None or (generation is not None and generation < req.generation):
            if self._trace is not None:  # the notice was consumed: logged, so a trace checker sees it
                self._trace.emit(self._actor, "DropGeneration", {
                    "req_id": req_id, "generation": None, "finished": finished, "dest": "none",
                    "live": [], "stale": [], "notice_generation": generation})
            return None
        return self._close(req, finished=finished, generation=generation)

    def _close(self, req: StoreRequestState, *, finished: bool, generation: int | None,
               emit: bool = True) -> Any:
        """DropGeneration on an open generation. Returns the new state; with ``emit=False`` (a newer
        generation's Receive supersedes it: part of that Receive, as in the model) the stale job ids."""
        stale: list[int] = []
        dest = "closing" if finished and req.live and (generation is None or generation == req.generation) \
            else "closed"
        req.state = step(STORE_REQUEST, "StoreRequest", req.state, "DropGeneration", dest, req.req_id)
        if dest == "closed":
            stale = sorted(req.live)
            req.live.clear()
            self._forget(req)
        else:
            del self._requests[req.req_id]
            self._closing.add(req)
        if not emit:
            return stale
        if self._trace is not None:
            self._trace.emit(self._actor, "DropGeneration", {
                "req_id": req.req_id, "generation": req.generation, "finished": finished, "dest": dest,
                "live": sorted(req.live), "stale": stale,
                "notice_generation": generation if generation is not None else req.generation})
        return dest

    def _forget(self, req: StoreRequestState) -> None:
        if self._requests.get(req.req_id) is req:
            del self._requests[req.req_id]
        self._closing.discard(req)
        if req.pressure_skip:
            req.pressure_skip = False
            self._skipped.discard(req)

    # ---------------------------------------------------------------- queries
    def request(self, req_id: str) -> StoreRequestState | None:
        """The open generation of ``req_id`` on this rank."""
        return self._requests.get(req_id)

    def job_request(self, job_id: int) -> StoreRequestState:
        """The generation a job belongs to (open, closing or closed)."""
        return self._job(job_id).req

    @property
    def num_closing(self) -> int:
        return len(self._closing)

    def job_state(self, job_id: int) -> str:
        """StoreJob state of a job this rank still holds (``reported`` once finished and remembered)."""
        job = self._jobs.get(job_id)
        if job is not None:
            return job.state
        if job_id in self._reported:
            return "reported"
        raise LedgerInputError("job_id", job_id, f"not known on rank {self.rank}")

    def is_live(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job_id in job.req.live

    @property
    def num_live_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_requests(self) -> int:
        """Open generations."""
        return len(self._requests)

    def has_pending_work(self) -> bool:
        """Jobs registered and not reported, or reports not yet taken."""
        return bool(self._jobs or self._completed)

    def _emit_job(self, action: str, job: _Job, extra: dict[str, Any]) -> None:
        trace = self._trace
        if trace is not None:
            trace.emit(self._actor, action, {
                "job": job.job_id, "req_id": job.req.req_id, "generation": job.req.generation, **extra})
