"""The worker's save steps (Receive, DropGeneration, Collect; a store job's DmaRead, Put, Report) over one
rank's `WorkerLedger`: `SaveSteps`, a half of `WorkerSteps` (kvledger_connector/worker/steps.py, which says
how they are driven). No threads, no I/O, no lock: a job's store calls are yielded as `StoreCall`s, its wait
for the forward's writes as a `DeviceCall` (kvledger_connector/worker/effects.py), and the caller serializes."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Sequence

from kvledger import codes
from kvledger.errors import LedgerError, LedgerInputError
from kvledger.worker import Verdict, put_positions
from kvledger_connector.metadata import (DropNotice, SaveSpec, check_drop_notice, check_job_id, check_req_id,
                                         check_save_spec)
from kvledger_connector.store.io import StoreCall, StoreIO
from kvledger_connector.worker.base import JobAction, StepsBase
from kvledger_connector.worker.effects import DeviceCall, JobEdge, Stepped

# a job's generator: its model steps, and the calls it needs made (each answered by ``send(answer)``)
SaveCalls = Generator["SaveStep | StoreCall | DeviceCall", Any, None]
Codes = Generator["StoreCall | DeviceCall", Any, list[int]]  # one store call's part of a job: its codes


@dataclass(frozen=True)
class SavePlan:
    """What DmaRead decided for one store job: its verdict and the block positions to put."""
    job_id: int
    verdict: Verdict
    start: int  # first block position of the request to put (from the rank's saved offset)
    end: int  # one past the last

    @property
    def run(self) -> bool:
        return self.verdict is Verdict.RUN

    @property
    def positions(self) -> range:
        return range(self.start, self.end) if self.run else range(0)


@dataclass(frozen=True)
class SaveStep:
    """Where a save job's generator stopped: the action just done and what it decided."""
    action: JobAction
    job_id: int
    verdict: Verdict | None = None  # from DMA_READ on (None if the job failed before the verdict)
    plan: SavePlan | None = None  # DMA_READ: the block positions the put reads
    outcome: codes.PutOutcome | None = None  # PUT: the put's classified outcome
    error: str | None = None  # the job failed in this action: the handler raised (or an exception was thrown in)


@dataclass(frozen=True)
class SaveJob:
    """A received store job, its blocks [0, end_block) resolved (`SentBlocks.resolve`): what the store
    thread runs (`WorkerSteps.run_save`)."""
    req_id: str
    job_id: int
    end_block: int
    full_end_block: int
    block_ids: tuple[int, ...]  # an id per KV cache group of a block, block major (SaveSpec.num_groups)
    block_hashes: tuple[Any, ...]


class SaveSteps(StepsBase):
    """A rank's save steps; the ledger calls are the model's (the table in kvledger_connector/worker/steps.py)."""

    def receive(self, req_id: str, job_id: int, generation: int | None) -> None:
        """Receive: the job joins its generation's live set (before it is queued, so a drop sees it)."""
        self.ledger.register(req_id, job_id, generation)

    def receive_save(self, spec: SaveSpec) -> SaveJob | None:
        """Receive of one SaveSpec, checked whole first (`check_save_spec`: against this rank's KV cache; a
        job id no job of this rank has), then `receive`, then the job's blocks resolved from what earlier
        specs of its generation sent (`SentBlocks`). A malformed spec, or one that does not continue them,
        is bad input: nothing runs and None is returned; its job is reported at once (its pins are
        released; a cache miss), unless its id is not a job id or another job's (that report would count
        twice: the spec is dropped, kept in ``errors``)."""
        try:
            check_save_spec(spec, num_blocks=self.num_blocks, null_ok=not self.kinds.one_table)
            if spec.num_groups != self.num_groups:
                raise LedgerInputError(f"SaveSpec job {spec.store_job_id} num_groups", spec.num_groups,
                                       f"this rank's blocks are of {self.num_groups} KV cache group(s)")
            if self.ledger.knows_job(spec.store_job_id):
                raise LedgerInputError(f"SaveSpec job {spec.store_job_id} store_job_id", spec.store_job_id,
                                       "another job of this rank has it")
            # a job its request cannot join (this rank holds `max_requests` request states): refused alike
            self.receive(spec.req_id, spec.store_job_id, spec.generation)
        except LedgerInputError as e:
            self._refuse_save(spec, e)
            return None
        try:
            ids, hashes = self.sent.resolve(spec)
        except LedgerInputError as e:
            self.note_error(f"refused: {e}")
            self.reject_save(spec.store_job_id)
            return None
        return SaveJob(spec.req_id, spec.store_job_id, spec.end_block, spec.full_end_block, ids, hashes)

    def _refuse_save(self, spec: Any, err: LedgerInputError) -> None:
        """A malformed SaveSpec: its job, where its id can be reported, registered in no generation and
        reported at once (`WorkerLedger.refuse`); no block is read, nothing is put."""
        self.stats.add("refused_specs")
        job_id: Any = getattr(spec, "store_job_id", None)
        req_id: Any = getattr(spec, "req_id", None)
        try:
            check_job_id("SaveSpec", job_id)
            self.ledger.refuse(req_id if req_id.__class__ is str else repr(req_id), job_id)
        except LedgerError as e:  # no job to report: its id is not one, or another job's
            self.note_error(f"refused, not reported ({e}): {err}")
            return
        self.note_error(f"refused: {err}")
        self.reject_save(job_id)

    def receive_drop(self, notice: DropNotice) -> bool:
        """DropGeneration of one DropNotice, checked whole first (`check_drop_notice`). Returns whether the
        notice releases a held request (the rank answers it in finished_sending). A malformed notice with a
        req_id closes that req_id's open generation, whichever it is (its queued jobs go stale: a cache miss
        at worst, never a stale job's effect) and still releases a held request, so it never waits for
        ever; the error is kept in ``errors``."""
        try:
            check_drop_notice(notice)
        except LedgerInputError as e:
            self.stats.add("refused_specs")
            self.note_error(f"malformed, applied as a preemption of whatever generation is open: {e}")
            req_id: Any = getattr(notice, "req_id", None)
            try:
                check_req_id("DropNotice", req_id)
            except LedgerInputError:
                return False
            self.drop_generation(req_id, finished=False, generation=None)
            return getattr(notice, "release", False) is True
        self.drop_generation(notice.req_id, finished=notice.finished, generation=notice.generation)
        return notice.release

    def drop_generation(self, req_id: str, *, finished: bool, generation: int | None) -> None:
        """DropGeneration: the scheduler preempted or finished ``req_id`` (its generation's jobs go stale,
        or it closes when its last job reports); the blocks its specs sent are forgotten."""
        self.ledger.drop_generation(req_id, finished=finished, generation=generation)
        self.sent.drop(req_id, generation)

    def take_reports(self) -> dict[int, int]:
        """The jobs reported since the last call, ``{job: 1}``: this rank's part of the step's
        ``completed_saves`` (the engine sums the ranks' parts)."""
        return self.ledger.take_completed()

    def begin_save(self, job_id: int, end_block: int) -> SavePlan:
        """DmaRead: the ledger's verdict; a running job puts from the rank's saved offset to ``end_block``."""
        verdict = self.ledger.begin(job_id)
        offset = self.ledger.saved_offset(job_id)
        self.stats.add({Verdict.RUN: "run_jobs", Verdict.STALE: "stale_jobs", Verdict.SKIP: "skipped_jobs"}[verdict])
        return SavePlan(job_id, verdict, min(offset // self.block_size, end_block), end_block)

    def put(self, keys: Sequence[str], ids: Sequence[int], ready: Any = None, tails: Sequence[int] = (),
            parts: Sequence[int] | None = None) -> Codes:
        """Put: the keys not in the store yet are put from ``buffers(ids, parts)`` (``ready``: the forward's
        event, waited for first, a `DeviceCall`); ``tails``: the indices of a partial tail block's keys (one per
        part of the block), whose later slots decode may still write; ``parts``: each key's part of a block
        (default part 0). Yields its store and device calls; returns one code per key (0 for a key already present)."""
        keys = list(keys)
        if len(ids) != len(keys):
            raise LedgerInputError("ids", len(ids), f"one buffer id per key ({len(keys)} keys)")
        parts = [0] * len(keys) if parts is None else list(parts)
        if len(parts) != len(keys):
            raise LedgerInputError("parts", len(parts), f"one part per key ({len(keys)} keys)")
        if not keys:
            return []
        exist = yield StoreCall("batch_is_exist", tuple(keys))
        todo = codes.missing(exist, len(keys))
        out = [int(codes.STORED)] * len(keys)
        if not todo:
            return out
        if ready is not None:
            yield DeviceCall("wait", ready)
        put_keys, put_ids = [keys[j] for j in todo], [ids[j] for j in todo]
        put_parts = [parts[j] for j in todo]
        ptrs, sizes = self.buffers(put_ids, put_parts)
        if self.seal is None:
            res = yield from self._put_until_room(put_keys, ptrs, sizes)
        else:  # each object ends in its trailer (kvledger_connector/shape/integrity.py), tagged from the blocks read
            with self.seal.slot(len(todo)) as slot:
                stages = [j for j, i in enumerate(todo) if i in tails]
                trailers, staged = yield DeviceCall("seal", self.seal, (slot, put_keys, put_ids, stages, put_parts))
                for j, ptr in zip(stages, staged):  # a tail is sent from the copy its tag was computed over
                    ptrs[j], sizes[j] = [ptr], [self.seal.block_bytes]
                res = yield from self._put_until_room(put_keys, [p + [t] for p, t in zip(ptrs, trailers)],
                                                      [s + [self.seal.trailer_bytes] for s in sizes])
        for j, c in zip(todo, res):
            out[j] = c
        self.stats.add("put_bytes", self.key_bytes * sum(1 for c in res if c == codes.STORED))
        return out

    def _put_until_room(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> Codes:
        """The batch put of ``keys``; the keys the store had no room for (NO_AVAILABLE_HANDLE) put again after
        a wait, up to ``full_retries`` times (the disk tier frees memory as it writes objects out). Returns
        each key's last code."""
        res = yield StoreCall("batch_put", tuple(keys), tuple(ptrs), tuple(sizes))
        codes.check_count("batch_put codes", res, len(keys))
        out = list(res)
        for _ in range(self.full_retries):
            full = [j for j, c in enumerate(out) if c == codes.NO_AVAILABLE_HANDLE]
            if not full:
                break
            self.stats.add("full_put_retries")
            self.stats.add("full_put_retried_keys", len(full))
            yield StoreCall("wait", (), wait_s=self.full_retry_s)
            res = yield StoreCall("batch_put", tuple(keys[j] for j in full), tuple(ptrs[j] for j in full),
                                  tuple(sizes[j] for j in full))
            codes.check_count("batch_put codes", res, len(full))
            for j, c in zip(full, res):
                out[j] = c
        return out

    def record_put(self, job_id: int, put_codes: Sequence[int], num_keys: int, saved_tokens: int
                   ) -> codes.PutOutcome:
        """The put's outcome into the ledger: stored (the offset moves to ``saved_tokens``) only if every
        key is stored; otherwise failed, under pressure if the store had no space."""
        out = codes.classify_put(put_codes, num_keys)
        if not out.stored:
            self.stats.add("failed_jobs")
            self.stats.add("put_failed_keys", len(out.failed_codes))
            for c in out.failed_codes:
                self.stats.fail_code(c)
        if out.stored:
            self.ledger.record_saved(job_id, saved_tokens)
        else:
            self.ledger.record_failed(job_id, pressure=out.pressure)
        return out

    def fail_save(self, job_id: int) -> bool:
        """The handler raised: the job fails where it is (DmaRead from queued, Put from running). Returns
        whether it failed the job (False: it had already an outcome)."""
        if self.ledger.job_state(job_id) not in ("queued", "running"):
            return False
        self.ledger.record_failed(job_id)
        self.stats.add("failed_jobs")
        return True

    def report_save(self, job_id: int) -> None:
        """Report: exactly once per job, on every exit path."""
        self.ledger.finish(job_id)

    def reject_save(self, job_id: int) -> None:
        """A received job that is never run (a full queue, or shut down): reported at once, its pins are
        released and the save becomes a future cache miss."""
        self.stats.add("rejected_jobs")
        self.report_save(job_id)

    def save_steps(self, io: StoreIO | JobEdge, req_id: str, job_id: int, end_block: int,
                   block_ids: Sequence[int], block_hashes: Sequence[Any], ready: Any = None,
                   full_end_block: int | None = None) -> Stepped[SaveStep]:
        """One store job as an iterator of its model steps, its store and device calls made by ``io`` (the
        caller's `StoreIO`, or a `JobEdge` with the caller's lock: `Stepped`), already started: it stands at
        START (nothing done). Each ``next()`` does the next model action and returns its `SaveStep`:

            DMA_READ  the ledger's verdict (RUN, STALE, SKIP); a job that does not run goes to REPORT next
            PUT       the missing keys put from ``buffers`` (``ready``: the forward's event, waited for
                      first) and the outcome recorded
            REPORT    WorkerLedger.finish, in a ``finally``; then the generator ends (StopIteration)

        ``gen.throw(exc)`` (an ``Exception``) is the handler raising in the action it stands before: the job
        fails where it is (thrown at START: ``DmaRead -> failed``; before PUT: ``Put -> failed``), is kept in
        ``errors``, and ``throw`` returns that action's step with ``error`` set; REPORT follows. One thrown
        after the outcome is recorded changes no outcome: ``throw`` returns REPORT. The same holds for an
        exception raised inside an action. ``gen.close()`` (or the generator's collection) before REPORT
        abandons the job: it fails where it is and is reported, inside ``close()``; a BaseException thrown in
        does the same and propagates. Every path reports exactly once (S5).

        It starts here so that a throw or close always finds the job's ``try``: those on an unstarted
        generator would run none of it, and the job would never be reported.
        ``full_end_block`` (default ``end_block``): where the saved offset moves on success — before a
        partial tail block, which is stored under its own key and saved whole later if decode fills it.
        ``block_ids``: an id per KV cache group of each block (`SaveSpec`); a block is saved only when every
        part's key of it is (a null id has nothing to put)."""
        gen = Stepped(self._save_job(req_id, job_id, end_block, block_ids, block_hashes, ready, full_end_block),
                      io)
        next(gen)  # START
        return gen

    def _save_job(self, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                  block_hashes: Sequence[Any], ready: Any, full_end_block: int | None) -> SaveCalls:
        nxt = JobAction.DMA_READ  # the action under way or next: the one a failure ends
        verdict: Verdict | None = None
        try:
            try:
                yield SaveStep(JobAction.START, job_id)
                plan = self.begin_save(job_id, end_block)
                verdict = plan.verdict
                nxt = JobAction.PUT if plan.run else JobAction.REPORT
                yield SaveStep(JobAction.DMA_READ, job_id, verdict, plan)
                if plan.run:  # this rank's share of the job's keys (all of them unless ranks share keys)
                    pos = put_positions(plan.start, plan.end, *self.stripe)
                    partial = full_end_block is not None and full_end_block < end_block  # the last is a tail
                    keys, ids, parts, at = self._entries(pos, block_ids, block_hashes)
                    # a partial tail is a key per part of its block, each staged
                    tails = [j for j, i in enumerate(at) if partial and i == end_block - 1]
                    res = yield from self.put(keys, ids, ready, tails, parts)
                    saved_to = end_block if full_end_block is None else full_end_block
                    out = self.record_put(job_id, res, len(keys), saved_to * self.block_size)
                    nxt = JobAction.REPORT
                    yield SaveStep(JobAction.PUT, job_id, verdict, outcome=out)
            except Exception as e:  # the job fails; it is reported below all the same
                msg = f"{type(e).__name__}: {e}"
                self._fail(job_id, f"save job {job_id} ({req_id}): {msg}")
                if nxt is not JobAction.REPORT:
                    yield SaveStep(nxt, job_id, verdict, error=msg)
        except BaseException as e:  # GeneratorExit (closed, abandoned) or an interrupt: fail, report, re-raise
            self._fail(job_id, f"save job {job_id} ({req_id}) abandoned at {nxt.value}: {type(e).__name__}")
            raise
        finally:
            try:
                self.report_save(job_id)
            except LedgerError as e:
                self.note_error(f"report job {job_id}: {e}")
        yield SaveStep(JobAction.REPORT, job_id, verdict)

    def _fail(self, job_id: int, msg: str) -> None:
        self.note_error(msg)
        try:
            self.fail_save(job_id)
        except LedgerError as e:
            self.note_error(f"fail job {job_id}: {e}")

    def run_save(self, io: StoreIO | JobEdge, req_id: str, job_id: int, end_block: int, block_ids: Sequence[int],
                 block_hashes: Sequence[Any], ready: Any = None, full_end_block: int | None = None) -> None:
        """One store job, as the store thread runs it: `save_steps` drained."""
        for _ in self.save_steps(io, req_id, job_id, end_block, block_ids, block_hashes, ready, full_end_block):
            pass

    def _entries(self, pos: Sequence[int], block_ids: Sequence[int], block_hashes: Sequence[Any]
                 ) -> tuple[list[str], list[int], list[int], list[int]]:
        """(keys, block ids, parts, positions) of blocks ``pos``, part by part, each key its part's builder's.
        A table that may hold vLLM's null block (`GroupKinds.one_table` false) has nothing to put there; in one
        table read as it comes a null id is an error the buffers report."""
        shape = self.block_shape()
        stride, sparse = shape.num_groups, not shape.kinds.one_table
        if len(block_ids) < len(block_hashes) * stride:
            raise LedgerInputError("block_ids", len(block_ids), f"an id per KV cache group ({stride}) of each of "
                                   f"{len(block_hashes)} blocks")
        keys: list[str] = []
        ids: list[int] = []
        parts: list[int] = []
        positions: list[int] = []
        for p, part in enumerate(shape.parts):
            at = [i for i in pos if not (sparse and block_ids[i * stride + part.group] == 0)]
            keys += part.builder.keys([block_hashes[i] for i in at])
            ids += [block_ids[i * stride + part.group] for i in at]
            parts += [p] * len(at)
            positions += at
        return keys, ids, parts, positions

