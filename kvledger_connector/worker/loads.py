"""The worker's load steps (EmitLoad, a load's sub-batches, HandleLoadErrors) over one rank's `LoadLedger`:
`LoadSteps`, a half of `WorkerSteps` (kvledger_connector/worker/steps.py, which says how they are driven).
No threads, no I/O, no lock: a load's batch gets are yielded as `StoreCall`s, its integrity checks as
`DeviceCall`s (kvledger_connector/worker/effects.py), and the caller serializes."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from kvledger import codes
from kvledger.errors import LedgerError, LedgerInputError, LedgerInvariantError
from kvledger.load import LoadResult, load_order
from kvledger_connector.metadata import LoadSpec, check_load_spec, check_req_id, reportable_blocks
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.io import StoreCall, StoreIO
from kvledger_connector.worker.base import JobAction, StepsBase, logger
from kvledger_connector.worker.effects import DeviceCall, JobEdge, Stepped

_T = TypeVar("_T")

# objects that failed their integrity tag, waiting for the store's own thread to remove them (bounded: one
# left out fails its next load again and is queued then)
MAX_PENDING_REMOVALS = 256

# a load's generator: its model steps, and the calls it needs made (each answered by ``send(answer)``)
LoadCalls = Generator["LoadStep | StoreCall | DeviceCall", Any, None]
Verified = Generator[DeviceCall, Any, list[int]]  # a get's codes once its objects' tags are checked


@dataclass(frozen=True)
class LoadStep:
    """Where a load's generator stopped: the action just done."""
    action: JobAction
    load_id: int
    failed: tuple[tuple[int, int], ...] = ()  # LOAD: (block id, code) of each block of the sub-batch not loaded
    result: LoadResult | None = None  # set on the step that finished the load (then the generator ends)


class LoadSteps(StepsBase):
    """A rank's load steps; the ledger calls are the model's (the table in kvledger_connector/worker/steps.py)."""

    def admit_load(self, spec: LoadSpec) -> bool:
        """EmitLoad's input, checked whole before anything runs (`check_load_spec`, against this rank's KV
        cache). True: the load may run (`run_load`). Otherwise it is over here, nothing read: a malformed
        spec, or one the scheduler refused (`LoadSpec.refused`), has every block it names reported failed
        and is finished (its request never waits, vLLM's policy acts on the blocks); a spec without a req_id
        names no request to report and is only kept in ``errors``."""
        try:
            check_load_spec(spec, num_blocks=self.num_blocks, num_groups=self.num_groups)
        except LedgerInputError as e:
            self.stats.add("refused_specs")
            req_id: Any = getattr(spec, "req_id", None)
            try:
                check_req_id("LoadSpec", req_id)
            except LedgerInputError:
                self.note_error(f"refused, not reported (no request to report): {e}")
                return False
            self.note_error(f"refused: {e}")
            ids = reportable_blocks(getattr(spec, "block_ids", ()), self.num_blocks)
            self.reject_load(req_id, ids, f"malformed: {e}", sync=bool(getattr(spec, "sync", False)))
            return False
        if spec.refused:
            self.reject_load(spec.req_id, spec.block_ids, f"refused by the scheduler: {spec.refused}",
                             sync=bool(spec.sync))
            return False
        return True

    def begin_load(self, req_id: str, block_ids: Sequence[int]) -> int:
        # a block is loaded once all its keys are (several in the TP-shared layout)
        load_id = self.loads.begin_load(req_id, block_ids, keys_per_block=self.keys_per_block)
        self.stats.add("loads")
        return load_id

    def load_batch(self, load_id: int, keys: Sequence[str], block_ids: Sequence[int],
                   parts: Sequence[int] | None = None
                   ) -> Generator[StoreCall | DeviceCall, Any, list[tuple[int, int]]]:
        """Load: one batch get of ``keys`` into the blocks ``block_ids`` (one per key; ``parts``: each key's
        part of a block, default part 0), classified by :mod:`kvledger.codes`. Yields the get (and, integrity
        on, the tags' check); returns (block id, code) of each block not loaded (already reported)."""
        if len(keys) != len(block_ids):
            raise LedgerInputError("block_ids", len(block_ids), f"one block per key ({len(keys)} keys)")
        parts = [0] * len(keys) if parts is None else list(parts)
        if len(parts) != len(keys):
            raise LedgerInputError("parts", len(parts), f"one part per key ({len(keys)} keys)")
        ptrs, sizes = self.buffers(list(block_ids), parts)
        if self.seal is None:
            res = yield StoreCall("batch_get", tuple(keys), tuple(ptrs), tuple(sizes))
        else:
            with self.seal.slot(len(keys)) as slot:
                tails = self.seal.trailer_ptrs(slot, len(keys))
                res = yield StoreCall("batch_get", tuple(keys), tuple(p + [t] for p, t in zip(ptrs, tails)),
                                      tuple(s + [self.seal.trailer_bytes] for s in sizes))
                res = yield from self._verified(slot, keys, block_ids, res, parts)
        bad = self.loads.record_results(load_id, block_ids, res, self.key_bytes)
        for _, c in bad:
            self.stats.fail_code(c if c < 0 else int(StoreCode.INVALID_PARAMS))
        self.stats.add("get_bytes", self.key_bytes * (len(keys) - len(bad)))
        return bad

    def _verified(self, slot: int, keys: Sequence[str], block_ids: Sequence[int], res: list[int],
                  parts: Sequence[int] | None = None) -> Verified:
        """The get's codes with every object read whole but failing its tag turned into INTEGRITY_MISMATCH
        (a load error: vLLM's policy acts, the bytes are never used); the tags are checked by a yielded
        `DeviceCall`. Such an object is removed from the
        store: it would fail every later load of its key, and while it exists no save replaces it."""
        if len(res) != len(keys):
            return res  # record_results names the broken store
        whole = [i for i, c in enumerate(res) if codes.is_loaded(c, self.key_bytes)]
        if not whole:
            return res
        ok = yield DeviceCall("verify", self.seal, (slot, [keys[i] for i in whole], [block_ids[i] for i in whole],
                                                     None if parts is None else [parts[i] for i in whole], whole))
        out = list(res)
        for i, good in zip(whole, ok):
            if not good:
                out[i] = int(StoreCode.INTEGRITY_MISMATCH)
                self.stats.add("integrity_mismatches")
                logger.warning("kvledger worker r%d: %s does not match its integrity tag: not loaded, removed",
                               self.tp_rank, keys[i])
                self.queue_removal(keys[i])
        return out

    def queue_removal(self, key: str) -> None:
        """``key``'s object failed its tag: queued for `take_removals` (the store's own thread), each key
        once; past the bound it is left (counted): its next load fails the tag again and queues it then."""
        if key not in self.removals and len(self.removals) >= MAX_PENDING_REMOVALS:
            self.stats.add("integrity_removals_dropped")
            return
        self.removals[key] = None

    def take_removals(self) -> list[str]:
        """The keys of every queued object that failed its tag, each once, for removal by force (a reader's
        lease must not keep it: while it exists no save replaces it) on the store's own threads (the
        worker's store and load threads, `StoreIO.remove`), never the model runner's. Best effort: the load
        error stood already."""
        keys, self.removals = list(self.removals), {}
        return keys

    def finish_load(self, load_id: int, reason: str, sync: bool = False) -> LoadResult:
        """Errors first, then finished, in one step: a request is never seen finished without its failed
        blocks (S8 LoadErrorsReported; `WorkerSteps.take_report` takes both at once). A sync load is
        reported in the worker metadata (`take_finished_sync_loads`), an async one in finished_recving."""
        self.loads.fail_pending(load_id, reason)
        result = self.loads.finish_load(load_id)
        (self.finished_sync_loads if sync else self.finished_loads).append(result.req_id)
        if result.failed and not sync and not self.kinds.fails_by_block:  # taken each step with finished ones
            self.failed_loads.append(result.req_id)
        if result.failed:
            self.stats.add("load_errors_reported", len(result.failed))
        return result

    def reject_load(self, req_id: str, block_ids: Sequence[int], reason: str, sync: bool = False) -> LoadResult:
        """A load that is never tried (a full queue): every block reported failed, vLLM recomputes."""
        self.stats.add("rejected_loads")
        return self.finish_load(self.begin_load(req_id, block_ids), reason, sync)

    def load_steps(self, io: StoreIO | JobEdge, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any],
                   sync: bool = False, groups: Sequence[int] = ()) -> Stepped[LoadStep]:
        """One load as an iterator of its model steps, its store and device calls made by ``io`` (the caller's
        `StoreIO`, or a `JobEdge` with the caller's lock: `Stepped`); not started: nothing is owed before the
        first ``next()``. Each ``next()`` does the next model action and returns its `LoadStep`:

            EMIT_LOAD  LoadLedger.begin_load; the keys in this rank's load order (`load_pairs`: rotated by
                       tp_rank, each block id travelling with its key); oversized keys reported. A load with
                       nothing to try (no keys, every key too long, a bad input) is finished here.
            LOAD       one sub-batch of at most ``load_sub_batch_keys`` keys; every sub-batch is tried. The
                       last one's step also finishes the load: every block still pending is reported
                       failed, then finish_load (``result`` set). Then the generator ends.

        An exception raised in a sub-batch, or thrown in before the load finished, stops it: every block not
        loaded is reported failed and the load finished (the step returned, or ``throw``'s, has ``result``).
        ``close()`` (or the generator's collection) before the load finished does the same inside
        ``close()`` (S8). ``sync``: the load is reported as a sync one (`finish_load`). ``groups``: each
        block's KV cache group (`LoadSpec.groups`)."""
        return Stepped(self._load_job(req_id, block_ids, block_hashes, sync, groups), io)

    def _load_job(self, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any], sync: bool,
                  groups: Sequence[int]) -> LoadCalls:
        load_id = self.begin_load(req_id, block_ids)
        reason = "not attempted"
        result: LoadResult | None = None
        try:
            subs: list[list[tuple[str, int, int]]] = []
            try:
                subs = self._sub_batches(load_id, req_id, block_ids, block_hashes, groups)
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                self.note_error(f"load {req_id}: {reason}")
            if not subs:  # nothing to load: still reported finished (upstream divides by zero here)
                result = self.finish_load(load_id, reason, sync)
            yield LoadStep(JobAction.EMIT_LOAD, load_id, result=result)
            for i, sub in enumerate(subs):
                bad: list[tuple[int, int]] = []
                try:
                    bad = yield from self.load_batch(load_id, [k for k, _, _ in sub], [b for _, b, _ in sub],
                                          [p for _, _, p in sub])
                except LedgerInputError as e:  # e.g. a block id outside the cache: this sub-batch fails
                    reason = str(e)  # its blocks stay pending: reported when the load finishes
                    self.note_error(f"load {req_id}: {e}")
                if i == len(subs) - 1:
                    result = self.finish_load(load_id, reason, sync)
                yield LoadStep(JobAction.LOAD, load_id, tuple(bad), result)
        except Exception as e:  # raised or thrown in: the rest is not tried, every block not loaded reported
            reason = f"{type(e).__name__}: {e}"
            self.note_error(f"load {req_id}: {reason}")
            if result is None:
                result = self.finish_load(load_id, reason, sync)
                yield LoadStep(JobAction.LOAD, load_id, (), result)
        finally:
            if result is None:  # closed (abandoned) or an interrupt: S8 all the same
                try:
                    self.finish_load(load_id, "load abandoned", sync)
                except LedgerError as e:
                    self.note_error(f"finish load {load_id} of {req_id!r}: {e}")

    def _sub_batches(self, load_id: int, req_id: str, block_ids: Sequence[int],
                     block_hashes: Sequence[Any], groups: Sequence[int] = ()) -> list[list[tuple[str, int, int]]]:
        """The (key, block id, part) sub-batches of a load in this rank's order: a key per part of each
        block's KV cache group (``groups``, default group 0), each its part's builder's, which also reports
        it if it is too long."""
        shape = self.block_shape()
        n = len(block_ids)
        if n != len(block_hashes):
            raise LedgerInputError("LoadSpec.block_hashes", len(block_hashes), f"{n} block ids for {req_id!r}")
        if groups and (len(set(block_ids)), len(groups)) != (n, n):
            raise LedgerInputError("LoadSpec.groups", len(groups), f"one per block id, ids unique ({n} ids)")
        if groups and not all(g.__class__ is int and 0 <= g < shape.num_groups for g in groups):
            raise LedgerInputError("LoadSpec.groups", sorted(set(groups)),
                                   f"KV cache groups of this rank are 0..{shape.num_groups - 1}")
        entries = [(shape.parts[p].builder.key(h), b, p) for b, h, g in zip(block_ids, block_hashes, groups or [0] * n)
                   for p in shape.parts_of(g)]
        # rotated by tp_rank: the ranks start on different keys of the store
        order = [(k, b, p) for k, (b, p) in load_pairs([k for k, _, _ in entries], [(b, p) for _, b, p in entries],
                                                       self.tp_rank)]
        too_long = [j for j, (k, _, p) in enumerate(order) if not shape.parts[p].builder.fits(k)]
        if too_long:
            cap = shape.parts[order[too_long[0]][2]].builder.max_key_bytes
            self.stats.fail_code(int(StoreCode.KEY_TOO_LONG), len(too_long))
            self.loads.record_failed(load_id, [order[j][1] for j in too_long],
                                     f"key longer than max_key_bytes={cap}")
            drop = set(too_long)
            order = [o for j, o in enumerate(order) if j not in drop]
        return [order[lo:lo + self.sub_batch] for lo in range(0, len(order), self.sub_batch)]

    def run_load(self, io: StoreIO | JobEdge, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[Any],
                 sync: bool = False, groups: Sequence[int] = ()) -> LoadResult:
        """One load, as a load thread (or, ``sync``, the model runner thread) runs it: `load_steps` drained."""
        result: LoadResult | None = None
        for step in self.load_steps(io, req_id, block_ids, block_hashes, sync, groups):
            result = step.result or result
        if result is None:  # load_steps ends only after its finishing step
            raise LedgerInvariantError.of("S8", f"rank {self.tp_rank}: load of {req_id!r} ended unfinished")
        return result

    def take_finished_loads(self) -> set[str]:
        """The req_ids whose load finished since the last call, each once: vLLM's finished_recving is a set,
        so a second finished load of the same req_id waits for the next step (one report per load: the
        scheduler releases one load pin per report, oldest first)."""
        done, self.finished_loads = self._once_each(self.finished_loads)
        return set(done)

    @staticmethod
    def _once_each(finished: list[str]) -> tuple[list[str], list[str]]:
        """(each req_id once, in order; the repeats, left for a later step)."""
        done: dict[str, None] = {}
        later: list[str] = []
        for req_id in finished:
            if req_id in done:
                later.append(req_id)
            else:
                done[req_id] = None
        return list(done), later

    def take_finished_sync_loads(self) -> dict[str, int]:
        """This rank's part of the step's ``completed_loads``: ``{req_id: 1}`` for each req_id whose sync load
        finished since the last call (the engine sums the ranks' parts). As in `take_finished_loads`, a
        second load of the same req_id waits for the next call: a count is per rank, per load."""
        done = self._once_each(self.finished_sync_loads)
        self.finished_sync_loads = done[1]
        return dict.fromkeys(done[0], 1)

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()  # HandleLoadErrors

    def take_failed_loads(self, finished: set[str]) -> set[str]:
        """Of the req_ids just reported finished (`take_finished_loads`), those whose load failed a block,
        each once; the block-level errors are taken with them (HandleLoadErrors: vLLM is told per request)."""
        self.loads.take_errors()
        out: set[str] = set()
        keep: list[str] = []
        for req_id in self.failed_loads:
            (out.add if req_id in finished and req_id not in out else keep.append)(req_id)
        self.failed_loads = keep
        return out


def load_pairs(keys: Sequence[str], block_ids: Sequence[_T], tp_rank: int) -> list[tuple[str, _T]]:
    """(key, block id) in rank ``tp_rank``'s load order (kvledger.load.load_order): each block id (with its
    part, where a block is several keys) travels with its key, so a failure is reported on the block the key
    was loading into."""
    return [(keys[i], block_ids[i]) for i in load_order(len(keys), tp_rank)]
