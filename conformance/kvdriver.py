"""The replay/fuzz driver of tla/KVLedger.tla (fixed design) on the real parts.

The driver brings the schedule (TLC's behaviour: which action, which request, rank and fault) and the store
(a loopback Mooncake master); every decision of the connector is the connector's own code: the scheduler
side's steps (kvledger_connector/scheduler/steps.py, `SchedulerSteps`: what `SchedulerSide` runs in vLLM's
scheduler thread) and each rank's job generators (kvledger_connector/worker/steps.py, `WorkerSteps.save_steps` /
`load_steps`: what `run_save` / `run_load` drain on the connector's store and load threads), over the
connector's `MooncakeStore` with faults injected below it.

Model action              -> real system
Admit/Compute/Preempt/Finish  vLLM's Scheduler's part, played here: requests in plain values
                              (`DriverRequest`: chunk c = block c of BS tokens), vLLM's real BlockPool
                              (allocation from the free queue head; each free_blocks call prepends the
                              blocks it frees, LIFO, a table tail first) and a KV cache from vLLM's
                              allocator (one block = one row): Compute writes chunk <<r, c>>'s code into
                              the block's row. Preempt/Finish then take the connector's notices
                              (`SchedulerSteps.notices`, `request_finished`) -- not on the
                              reset_prefix_cache path (PreemptNotices FALSE), where vLLM tells it nothing
Lookup(r)                 -> SchedulerSteps.ask/answer via scheduler.ask_store(req, 0) (batch_is_exist through the wrapper)
EmitLoad(r)               -> BlockPool allocation, SchedulerSteps.emit_load (pins) + take_loads, and on every
                             rank the load generator's first step (LoadLedger.begin_load)
EmitStore(r)              -> SchedulerSteps.emit_request_store(r, 0, table): the blocks the job pins, its SaveSpec
Collect                   -> every rank's WorkerSteps.take_reports(), merged by KVLedgerWorkerMetadata's
                             aggregate (as vLLM's executor) -> SchedulerSteps.collect
Receive(w)                -> WorkerSteps.receive(spec.req_id, job, spec.generation) (WorkerSide.end_step's call)
DropGeneration(w, r, g)   -> WorkerSteps.drop_generation(req_id, finished=, generation=g) (start_step's call)
DmaRead(w)                -> the job's save generator, created from its SaveSpec, one step: the verdict and
                             plan; the driver's DMA copies the plan's rows into registered staging rows (the
                             put reads them); outcome "failed" = an exception thrown into the generator
Put(w)                    -> one step: batch_is_exist, batch_put of the missing keys, the outcome recorded;
                             "fail" / "pressure" are codes (-800 / -200) the client under the wrapper
                             answers for this job's calls
Report(w)                 -> one step: WorkerLedger.finish
Load(w, r)                -> one step of the rank's load generator: one sub-batch's batch_get into the block
                             rows (a transfer failure "xfail" is -800 for those keys below the wrapper); the
                             last one finishes the load
CollectLoad(r)            -> SchedulerSteps.collect_loads([r]) (vLLM's finished_recving), or for a sync load
                             collect_sync_loads of the ranks' merged worker metadata
HandleLoadErrors(r)       -> WorkerSteps.take_load_errors of every rank; vLLM's recompute policy keeps the
                             prefix before the first failed block; SchedulerSteps.load_done
Evict(k)                  -> Mooncake remove(key, force=True) on the real client
StoreFail / StoreRestart  -> the client under the wrapper answers every call -900 (the wrapper backs off) /
                             every key of this behaviour removed, the fault lifted, the wrapper's clock moved
                             past its backoff

Abstract state compared after every step (field: model -> impl):
  status gen ncomp emitted table     the request bookkeeping (table = block ids)
  ref free                           ref counts and free-queue order of vLLM's BlockPool
  content                            the KV tensor rows, decoded
  nextJob pins                       SchedulerLedger: next id, {job: [pinned block ids, ranks_left]}
  jp                                 per rank, per emitted job: StoreJob state as the ledgers give it
  ws                                 per rank, per request: open/closing generation's live set, saved
                                     offset (in chunks), pressure skip, phase
  buf store                          the staged DMA rows, decoded; the Mooncake keys, read back
  ld                                 per request: load phase, keys, blocks reported invalid
  lpins                              SchedulerLedger's load pins: {req: destination blocks} while pinned
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.core.block_pool import BlockPool

from conformance.engine.replay import Refused
from kvledger.errors import LedgerError, LedgerInvariantError
from kvledger.load import LoadLedger
from kvledger.scheduler import SchedulerLedger
from kvledger.trace import TraceSink
from kvledger.worker import WorkerLedger, put_positions
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.store.io import StoreIO
from kvledger_connector.worker.base import JobAction
from kvledger_connector.worker.cache import RegisteredCache
from kvledger_connector.worker.saves import SaveJob
from kvledger_connector.worker.steps import WorkerSteps
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.metadata import KVLedgerWorkerMetadata, LoadSpec, SaveSpec
from kvledger_connector.config import ConnectorConfig, StoreConfig
from kvledger_connector.scheduler.side import ask_store
from kvledger_connector.scheduler.plan import tail_hash
from kvledger_connector.scheduler.steps import SchedulerSteps
from testbed.faults import BATCH_OPS, FaultyMooncakeClient, ManualClock, RawFault, faulty_mooncake_store
from testbed.kvcache import allocate, attention_specs, build_kv_cache_config

ROW = 16  # float32 elements per block row: one code repeated (a torn copy would show as mixed values)
BS = 4  # tokens per block: a chunk of the model is one block; 4 leaves room for a partial tail of 2 tokens
# loads of one chunk are sync ones (reported in the ranks' worker metadata), longer ones async (vLLM's
# finished_recving): the model's load is the same action sequence for both, so each replay drives both paths
SYNC_LOAD_MAX_TOKENS = BS
CODE_NO_CONTENT = 0.0
STORE_DOWN = -900


class _Sink:
    """The trace the ledgers write to: off while a finished behaviour's jobs are abandoned."""

    def __init__(self, trace: Any) -> None:
        self.trace, self.on = trace, True

    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None:
        if self.on:
            self.trace.emit(actor, action, fields)


@contextlib.contextmanager
def _quiet_jobs() -> Iterator[None]:
    """The job steps' error log off, for failures the driver injects or abandons on purpose."""
    log = logging.getLogger("kvledger_connector.worker.steps")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


class InjectedHandlerError(RuntimeError):
    """The model's DmaRead outcome "failed": the store handler raised (thrown into the save generator)."""


XFER_FAIL = -800
NO_SPACE = -200


@dataclass
class Consts:
    req: list[str]
    ranks: list[str]
    num_blocks: int
    num_chunks: int
    max_jobs: int
    pin_cap: int

    @classmethod
    def from_init(cls, init: dict[str, Any]) -> "Consts":
        req = sorted(init["status"])
        ranks = sorted(init["ws"])
        jobs = init["jobs"]
        return cls(req, ranks, len(init["ref"]), 0, len(jobs) if isinstance(jobs, list) else len(jobs), 0)


@dataclass
class DriverRequest:
    """A request as vLLM's Scheduler would hold it, in plain values (`scheduler.plan.RequestLike`): the
    model's NumChunks chunks are its blocks. The prompt has BS * NumChunks + 1 tokens (a lookup never
    hits the whole prompt, so one extra token lets it hit every chunk), or with PartialTail
    BS * (NumChunks - 1) + 2 (chunk NumChunks is the 2-token partial tail). ``num_preemptions`` counts
    from 1, as the model's generations do (the connector only compares generations)."""

    request_id: str
    num_prompt_tokens: int
    prompt_token_ids: list[int]
    block_hashes: list[bytes]
    num_preemptions: int = 1
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


class MooncakeBackend:
    """The driver's store: the connector's own `MooncakeStore` wrapper over a `FaultyMooncakeClient` (a
    labelled test double, testbed/faults.py) over a real client of a loopback Mooncake master, the wrapper's
    master-down backoff on a `ManualClock` (the replay moves time, not the machine). The model's store
    faults are injected below the wrapper, so its code classification, backoff and skipped calls are
    replayed; the driver reads, evicts and wipes keys through the real client underneath (``raw``)."""

    def __init__(self, store: Any, client: FaultyMooncakeClient, clock: ManualClock) -> None:
        self.store, self.client, self.clock = store, client, clock
        self.raw = client.inner
        self.scratch = torch.zeros(ROW, dtype=torch.float32)
        self._registered: set[int] = set()
        self._memory: dict[tuple[Any, ...], torch.Tensor] = {}
        self.register(self.scratch)

    @classmethod
    @contextlib.contextmanager
    def on_master(cls, embedded: Any) -> Iterator["MooncakeBackend"]:
        """A backend on the master of ``embedded`` (an EmbeddedMooncake or testbed's mooncake_servers)."""
        clock = ManualClock()
        cfg = StoreConfig(global_segment_size=64 << 20, local_buffer_size=4 << 20, rpc_timeout_ms=2000)
        store, client = faulty_mooncake_store(cfg, embedded=embedded, clock=clock)
        # the replay opens and closes the breaker in every StoreFail behaviour: its warnings are noise here
        store_log = logging.getLogger("kvledger_connector.store.breaker")
        level = store_log.level
        store_log.setLevel(logging.ERROR)
        try:
            yield cls(store, client, clock)
        finally:
            store_log.setLevel(level)
            store.close()

    def register(self, t: torch.Tensor) -> None:
        """Register a tensor's memory with the client once (the connector registers its KV cache so)."""
        if t.data_ptr() not in self._registered:
            self.store.register_buffer(t.data_ptr(), t.numel() * t.element_size())
            self._registered.add(t.data_ptr())

    def memory(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Memory the drivers on this backend share, made once per key and registered: it lives as long as
        the client (a freed registered region would be re-registered overlapping, which Mooncake refuses)."""
        t = self._memory.get(key)
        if t is None:
            t = self._memory[key] = make()
            if t.device.type == "cpu":
                self.register(t)
        return t

    def exists(self, key: str) -> bool:
        return self.raw.batch_is_exist([key])[0] == 1

    def read(self, key: str, out: torch.Tensor) -> int:
        self.scratch.zero_()
        code = self.raw.batch_get_into_multi_buffers([key], [[self.scratch.data_ptr()]], [[ROW_BYTES]])[0]
        if code >= 0:
            out.copy_(self.scratch)
        return code

    def remove(self, key: str) -> None:
        self.raw.remove(key, True)

    def settle(self) -> None:
        """A new behaviour: no standing fault, and the wrapper past any backoff a last one left."""
        self.client.clear()
        self.pass_backoff()

    def pass_backoff(self) -> None:
        """Time passes past the wrapper's wait and its probe finds the master answering (the probe the
        store's own thread sends in a connector: this backend's clock is manual, so it is sent here)."""
        self.clock.advance(self.backoff_s)
        if not self.store.probe():
            raise RuntimeError(f"the store's breaker probe went unanswered (last exception "
                               f"{self.store.last_exception!r})")

    @property
    def backoff_s(self) -> float:
        """What is left of the wrapper's wait before its next probe (its own rule: `MooncakeStore.backoff_s`)."""
        return self.store.skip_remaining_s


ROW_BYTES = ROW * 4


_behaviour_ids = itertools.count()


class KVDriver:
    """See the module doc. `backend`: a MooncakeBackend (`MooncakeBackend.on_master`).

    `consts`: the config's CONSTANTS (`conformance.engine.export.cfg_constants`); the bounds the model puts on
    a behaviour (MaxGen, MaxJobs, PinCap, SubBatch) come from there. `trace`: a TraceSink shared by
    the ledgers (their own events) and this driver, which logs what vLLM's Scheduler and the store do
    (Admit, Compute, Preempt, Finish, Lookup, EmitLoad, HandleLoadErrors; Evict, StoreFail,
    StoreRestart), so a log of one behaviour is complete for `conformance.kvtrace`."""

    def __init__(self, backend: Any, consts: dict[str, Any] | None = None, *,
                 trace: TraceSink | None = None, device: str = "cpu") -> None:
        self.backend = backend
        consts = dict(consts or {})
        self.max_gen = int(consts.get("MaxGen", 2))
        self.pin_cap = int(consts.get("PinCap", 1))
        # finished requests held for a save the cap deferred (the connector's max_held_requests)
        self.max_held = int(consts.get("MaxHeld", 0))
        self.sub_batch = int(consts.get("SubBatch", 1))
        self.cfg_max_jobs = consts.get("MaxJobs")
        self.late_notices = bool(consts.get("LateNotices", False))
        # TRUE: the last chunk is the prompt's partial tail, pinned through open_job's tail_block_ids
        self.partial_tail = bool(consts.get("PartialTail", False))
        # TRUE: each chunk's key is put by its Owner only (the model's ranks in order: replica i of len(ranks))
        self.stripe = bool(consts.get("Stripe", False))
        # FALSE: the reset_prefix_cache(reset_running_requests=True) path, no preemption notice
        self.preempt_notices = bool(consts.get("PreemptNotices", True))
        # the fault injector's budget and kinds (the model's MaxFaults, FaultKinds)
        self.max_faults = int(consts.get("MaxFaults", 1 << 30))
        self.fault_kinds = set(consts.get("FaultKinds", ["evict", "fail", "put", "pressure", "dma", "load"]))
        self.trace = trace
        self.device = torch.device(device)

    # ------------------------------------------------------------------ set-up
    def _kv_rows(self, num_blocks: int) -> torch.Tensor:
        """The KV cache from vLLM's own allocator (testbed.kvcache), built once per pool size and device (and
        registered with the client, as the connector registers its KV cache): one layer, one head, one
        token per block, C = ROW float32 (K|V), so block b's page is row b."""
        def make() -> torch.Tensor:
            vc = VllmConfig(cache_config=CacheConfig(block_size=1), device_config=DeviceConfig("cpu"))
            specs = attention_specs(1, block_size=1, num_kv_heads=1, head_size=ROW // 2)
            cfg = build_kv_cache_config(vc, specs, num_blocks, "LBNHC")
            (view,) = allocate(cfg, "LBNHC", device=self.device).values()
            return view.view(num_blocks, ROW)
        return self.backend.memory(("kv", num_blocks, str(self.device)), make)

    def _stage(self, w: str) -> torch.Tensor:
        """Rank w's staging rows (host memory): the DMA read copies into them."""
        return self.backend.memory(("stage", w, self.num_chunks),
                                   lambda: torch.zeros(self.num_chunks, ROW, dtype=torch.float32))

    def _buffers(self, ids: list[int], parts: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(ptrs, sizes) of blocks, as the connector's copy plan gives them: a block's KV row, or while a
        put runs the DMA's copy of it."""
        rows = [self.read_from.get(b, self.kv[b]) for b in ids]
        return [[r.data_ptr()] for r in rows], [[ROW_BYTES]] * len(ids)

    def reset(self, init: dict[str, Any]) -> None:
        self.req = sorted(init["status"])
        self.ranks = sorted(init["ws"])
        self.num_blocks = len(init["ref"])
        self.keys = sorted(init["store"])  # model keys as JSON strings of <<r, c>>
        self.num_chunks = max(int(_key(k)[1]) for k in self.keys)
        self.max_jobs = len(init["jobs"])
        if self.cfg_max_jobs is not None and int(self.cfg_max_jobs) != self.max_jobs:
            raise ValueError(f"MaxJobs={self.cfg_max_jobs} in the config, but the model state has "
                             f"{self.max_jobs} job slots: constants of another config?")
        self.backend.settle()
        self.pool = BlockPool(num_gpu_blocks=self.num_blocks + 1, enable_caching=False, hash_block_size=16)
        self.kv = self._kv_rows(self.num_blocks + 1)
        self.kv.zero_()
        # the ledger's cap is the model's PinCap (jobs; blocks: every job may pin the whole pool)
        self._abandon()
        self._sink = _Sink(self.trace)
        tr = self._sink if self.trace is not None else None
        self.sched = SchedulerLedger(self.pool, world_size=len(self.ranks), max_inflight_jobs=self.pin_cap,
                                     max_pinned_blocks=self.pin_cap * self.num_blocks, first_job_id=1,
                                     trace=tr)
        # the model's store has one key per chunk that every rank writes (first writer wins): every rank
        # and the scheduler's lookup share one key layout (a tp_size 1 layout)
        # (a namespace per behaviour: each starts on an empty store)
        self.kb = KeyBuilder(KeyLayout(model="kvdriver", tp_rank=0, tp_size=1, block_size=BS,
                                       dtype="torch.float32", kv_layout="LBNHC", num_layers=1, num_kv_heads=1,
                                       head_size=ROW // 2), namespace=f"b{next(_behaviour_ids)}")
        self.requests = {r: self._request(r) for r in self.req}
        self.workers = {w: WorkerLedger(i, max_live_jobs=self.max_jobs + 1, trace=tr)
                        for i, w in enumerate(self.ranks)}
        self.loads = {w: LoadLedger(i, max_inflight_loads=len(self.req), trace=tr)
                      for i, w in enumerate(self.ranks)}
        # the connector's own per-job steps, one per rank, over this driver's store. tp_rank 0 on every rank:
        # the model loads a rank's keys in index order; the rotation by tp_rank is a load-balancing order
        # (probe rotated_load_reports_the_right_block, mutant load_ids_not_rotated). With Stripe, rank i of
        # the sorted ranks is replica i: the model's Owner (RankList is TLC's first ordering, w1 before w2)
        self.store = self.backend.store  # the connector's MooncakeStore
        self.stage = {w: self._stage(w) for w in self.ranks}
        self.read_from: dict[int, torch.Tensor] = {}  # block id -> the row a put reads (the DMA's copy)
        # the ranks' connector config, checked as the connector's is (its block and load sub-batch)
        self.worker_config = ConnectorConfig(store=StoreConfig(load_sub_batch_keys=self.sub_batch), block_size=BS)
        self.steps = {w: WorkerSteps(self.worker_config, RegisteredCache(self._buffers, None, key_bytes=ROW_BYTES),
                                     ledger=self.workers[w], loads=self.loads[w], tp_rank=0,
                                     shape=BlockShape.of_keys([self.kb]),
                                     stripe=(i, len(self.ranks)) if self.stripe else (0, 1))
                      for i, w in enumerate(self.ranks)}
        # each rank's edge: the one wrapper its store calls go through, as `WorkerSide.io`
        self.io = {w: StoreIO(self.store, self.steps[w].stats) for w in self.ranks}
        # the connector's scheduler-side steps (what SchedulerSide runs in vLLM's scheduler thread)
        self.ss = SchedulerSteps(ConnectorConfig(store=StoreConfig(), block_size=BS, world_size=len(self.ranks),
                                                 max_pinned_blocks=self.pin_cap * self.num_blocks,
                                                 save_partial_tail=self.partial_tail,
                                                 sync_load_max_tokens=SYNC_LOAD_MAX_TOKENS,
                                                 max_held_requests=self.max_held),
                                 key_builders=[self.kb], trace=tr)
        self.ss.bind_ledger(self.sched)
        self.specs: dict[int, SaveSpec] = {}  # the SaveSpec of each emitted job
        # each rank's received job, its blocks resolved by the rank (WorkerSteps.receive_save)
        self.received: dict[str, dict[int, SaveJob]] = {w: {} for w in self.ranks}
        self.emitted_at_finish: dict[str, int] = {}
        self.status = {r: "waiting" for r in self.req}
        self.gen = {r: 0 for r in self.req}
        self.table: dict[str, list[Any]] = {r: [] for r in self.req}
        self.ncomp = {r: 0 for r in self.req}
        self.jobs: dict[int, tuple[str, int, list[int], int, int]] = {}  # j -> (r, g, blocks, lo, hi)
        self.inbox: dict[str, list[int]] = {w: [] for w in self.ranks}  # emitted, not yet received
        self.queue: dict[str, list[int]] = {w: [] for w in self.ranks}  # received, not yet read
        self.notice: dict[str, set[tuple[str, int, str]]] = {w: set() for w in self.ranks}
        self.busy: dict[str, int | None] = {w: None for w in self.ranks}  # job on the store thread
        self.gens: dict[str, Any] = {w: None for w in self.ranks}  # its save generator (WorkerSteps.save_steps)
        self.buf: dict[str, dict[int, torch.Tensor]] = {w: {} for w in self.ranks}
        self.up = True
        self.ld: dict[str, dict[str, Any]] = {r: self._ld_idle() for r in self.req}
        self.uncollected: set[tuple[str, int]] = set()  # (rank, job) reported, not yet collected
        self.faults = 0

    def _fault(self, kind: str) -> None:
        """An injected fault: refused beyond the budget or of a kind the config does not inject."""
        if self.faults >= self.max_faults or kind not in self.fault_kinds:
            raise Refused(f"fault {kind!r} not injectable ({self.faults}/{self.max_faults} used, "
                          f"kinds {sorted(self.fault_kinds)})")
        self.faults += 1

    def _emit(self, actor: str, action: str, **fields: Any) -> None:
        if self.trace is not None:
            self.trace.emit(actor, action, fields)

    @staticmethod
    def _ld_idle() -> dict[str, Any]:
        return {"ph": "idle", "n": 0, "bad": set(), "gens": {}, "blocks": [], "pin": False}

    def close(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        """End the jobs and loads a finished behaviour left under way, with no event and no log: closing a
        generator fails and reports its job (S5, S8) into ledgers that are about to be dropped. Before the
        next behaviour or the log file closes, never at garbage collection."""
        gens = [g for g in getattr(self, "gens", {}).values() if g is not None]
        gens += [g for ld in getattr(self, "ld", {}).values() for g in ld["gens"].values()]
        if not gens:
            return
        self._sink.on = False
        try:
            with _quiet_jobs():
                for g in gens:
                    g.close()
        finally:
            self._sink.on = True
        self.gens = {w: None for w in self.gens}
        for ld in self.ld.values():
            ld["gens"] = {}

    # ------------------------------------------------------------------ helpers
    def code(self, r: str, c: int) -> float:
        return float(1000 * (self.req.index(r) + 1) + c)

    def decode(self, row: torch.Tensor) -> Any:
        v = float(row[0])
        if not bool((row == row[0]).all()):
            return ["torn", v]
        if v == CODE_NO_CONTENT:
            return ["NoReq", 0]
        return [self.req[int(v) // 1000 - 1], int(v) % 1000]

    def _request(self, r: str) -> DriverRequest:
        n = self.num_chunks
        length = BS * (n - 1) + 2 if self.partial_tail else BS * n + 1
        base = 1000 * (self.req.index(r) + 1)
        return DriverRequest(r, length, [base + t for t in range(length)],
                             [f"{r}/{c}".encode() for c in range(1, length // BS + 1)])

    def tokens(self, r: str, c: int) -> int:
        """Tokens of r's first c chunks: the last chunk holds the rest of the prompt."""
        return self.requests[r].num_prompt_tokens if c == self.num_chunks else c * BS

    def skey(self, r: str, c: int) -> str:
        """The store key of chunk c of r: its block's key, or with PartialTail the last chunk's tail key
        (both as the connector builds them)."""
        req = self.requests[r]
        if self.partial_tail and c == self.num_chunks:
            th = tail_hash(req, req.num_prompt_tokens, req.prompt_token_ids, BS)
            if th is None:
                raise ValueError(f"{r}: the prompt has no partial tail")
            return self.kb.key(th)
        return self.kb.key(req.block_hashes[c - 1])

    # ------------------------------------------------------------------ actions
    def apply(self, a: dict[str, Any], pre: dict[str, Any], post: dict[str, Any]) -> None:
        fn = getattr(self, "do_" + a["name"], None)
        if fn is None:
            raise Refused(f"no mapping for action {a['name']}")
        try:
            fn(a)
        except LedgerInvariantError:
            raise
        except LedgerError as e:
            raise Refused(str(e)) from e

    def _engine_synced(self) -> None:
        """vLLM's engine step: schedule() runs only after every rank bound the last step's metadata
        (Receive), the ranks' completed-save reports were merged (Collect) and, unless notices may
        lag, every DropGeneration notice was handed over (the model's EngineSynced)."""
        if any(self.inbox.values()):
            raise Refused("engine not synced: an emitted job is not received yet")
        if self.uncollected:
            raise Refused("engine not synced: a completed-save report is not collected yet")
        if not self.late_notices and any(self.notice.values()):
            raise Refused("engine not synced: a DropGeneration notice is not delivered yet")

    def do_Admit(self, a: dict[str, Any]) -> None:
        r = a["r"]
        self._engine_synced()
        if self.status[r] not in ("waiting", "preempted") or self.gen[r] >= self.max_gen:
            raise Refused(f"{r} is {self.status[r]} (generation {self.gen[r]} of {self.max_gen})")
        self.status[r] = "running"
        self.gen[r] += 1
        self.ld[r] = self._ld_idle()
        if self.gen[r] == 1:  # vLLM's add_request
            self.ss.on_new_request(self.requests[r])
        self._emit("sched", "Admit", req_id=r, generation=self.gen[r])

    def _running_done(self, r: str) -> None:
        self._engine_synced()
        if self.status[r] != "running" or self.ld[r]["ph"] != "done":
            raise Refused(f"{r} is not running with its load done")

    def do_Compute(self, a: dict[str, Any]) -> None:
        r = a["r"]
        self._running_done(r)
        c = self.ncomp[r] + 1
        if c > self.num_chunks:
            raise Refused(f"{r} has computed every chunk")
        if c <= len(self.table[r]):
            blk = self.table[r][c - 1]
        else:
            if self.pool.get_num_free_blocks() == 0:
                raise Refused("no free block")
            (blk,) = self.pool.get_new_blocks(1)
            self.table[r].append(blk)
        self.kv[blk.block_id].fill_(self.code(r, c))
        self.ncomp[r] = c
        self.requests[r].num_computed_tokens = self.tokens(r, c)
        self._emit("sched", "Compute", req_id=r, chunk=c, block=blk.block_id)

    def _table_of(self, q: str) -> list[list[int]]:
        return [[b.block_id for b in self.table[q]]]  # one KV cache group

    def do_EmitStore(self, a: dict[str, Any]) -> None:
        """vLLM's build_connector_meta with r scheduled (or r held: its deferred save retried): the
        connector's EmitStore step decides the job."""
        r = a["r"]
        if self.status[r] == "held":
            self._engine_synced()
        else:
            self._running_done(r)
        if self.sched.next_job_id > self.max_jobs:
            raise Refused(f"the model has only {self.max_jobs} job ids")
        lo = self.ss.emitted_blocks(r) + 1  # the model's emitted[r] + 1
        saves = self.ss.emit_request_store(r, 0, self._table_of)  # r's EmitStore alone, as the model's
        if len(saves) != 1:
            raise Refused(f"the connector's EmitStore step opened {len(saves)} jobs for {r}")
        (spec,) = saves
        j = spec.store_job_id
        self.specs[j] = spec
        ids = [b.block_id for b in self.table[r][:spec.end_block]]  # what the job may read
        self.jobs[j] = (r, self.gen[r], ids, lo, spec.end_block)
        for w in self.ranks:
            self.inbox[w].append(j)

    def _free_table(self, r: str) -> None:
        self.pool.free_blocks(reversed(self.table[r]))
        self.table[r] = []

    def do_Preempt(self, a: dict[str, Any]) -> None:
        r = a["r"]
        self._running_done(r)
        if self.gen[r] >= self.max_gen:
            raise Refused(f"the model bounds generations (MaxGen={self.max_gen})")
        self._free_table(r)
        self.status[r] = "preempted"
        self.ncomp[r] = 0
        req = self.requests[r]
        req.num_computed_tokens = 0
        req.num_preemptions += 1  # vLLM counts the preemption at once
        if self.preempt_notices:  # the connector's notice (and its Preempt event)
            (nt,) = self.ss.notices([], [r])
            for w in self.ranks:
                self.notice[w].add((r, nt.generation, "preempt"))
        else:  # reset_prefix_cache(reset_running_requests=True): the connector is not told
            self._emit("sched", "Preempt", req_id=r, generation=self.gen[r])

    def do_Finish(self, a: dict[str, Any]) -> None:
        r = a["r"]
        ld = self.ld[r]
        if self.status[r] == "running" and (ld["ph"] == "loading" or ld["ph"] == "loaded" and ld["pin"]):
            self._engine_synced()  # an abort during the async load: the load's pins keep its blocks
        else:
            self._running_done(r)
            if self.ncomp[r] != self.num_chunks:
                raise Refused(f"{r} has chunks left to compute")
            if self.ss.emitted_blocks(r) != self.ncomp[r] and self.sched.next_job_id <= self.max_jobs:
                # a save left: only one the cap defers (the model's ~CapOK), as the connector's step this
                # step found it (deferred); the request is then held, or its save given up past MaxHeld
                if self.sched.num_inflight_jobs < self.pin_cap:
                    raise Refused(f"{r} has a save left that the cap does not defer")
                if self.ss.emit_request_store(r, 0, self._table_of):
                    raise Refused(f"the connector opened a job for {r} at the cap")
        emitted = self.ss.emitted_blocks(r)
        if self.ss.request_finished(self.requests[r]):  # held: vLLM keeps the blocks, no notice yet
            self.status[r] = "held"
            return
        self._free_table(r)
        self.status[r] = "finished"
        self.emitted_at_finish[r] = emitted  # the model keeps it; vLLM forgets the request
        (nt,) = self.ss.notices([r], [])  # the connector's notice (and its Finish event)
        for w in self.ranks:
            self.notice[w].add((r, nt.generation, "finish"))

    def do_ReleaseHeld(self, a: dict[str, Any]) -> None:
        """The held request's save is stored (every rank reported its job): its notice goes out with
        ``release``; every rank answers finished_sending and vLLM frees the blocks it kept."""
        r = a["r"]
        self._engine_synced()
        if self.status[r] != "held":
            raise Refused(f"{r} is {self.status[r]}, not held")
        if r not in self.ss.held_release_due() and self.sched.next_job_id > self.max_jobs:
            self.ss.give_up_held(r)  # the model ran out of job ids: its save can never open
        if r not in self.ss.held_release_due():
            raise Refused(f"{r} is held, its save not done")
        self._emit("sched", "ReleaseHeld", req_id=r, generation=self.gen[r])
        self.emitted_at_finish[r] = self.ss.emitted_blocks(r)
        nt = self.ss.release_held(r)
        self._free_table(r)
        self.status[r] = "finished"
        self.ss.note_freed([r])  # the ranks' finished_sending, merged by vLLM, then vLLM's free
        for w in self.ranks:
            self.notice[w].add((r, nt.generation, "finish"))

    def do_Collect(self, a: dict[str, Any]) -> None:
        # each rank's worker metadata, merged as vLLM's executor does (KVLedgerWorkerMetadata.aggregate)
        meta = KVLedgerWorkerMetadata()
        for w in self.ranks:
            meta.aggregate(KVLedgerWorkerMetadata(self.steps[w].take_reports()))
        merged = meta.completed_saves
        if not merged:
            raise Refused("no report to collect")
        self.uncollected.clear()
        self.ss.collect(merged)  # vLLM's update_connector_output

    def do_Receive(self, a: dict[str, Any]) -> None:
        w = a["w"]
        if not self.inbox[w]:
            raise Refused(f"{w} has no emitted job")
        j = self.inbox[w].pop(0)
        job = self.steps[w].receive_save(self.specs[j])
        # S2: the blocks the rank resolved (the spec's, after those earlier specs sent) are the job's table
        if job is None or list(job.block_ids) != self.jobs[j][2]:
            raise LedgerInvariantError.of("S2", f"{w} resolved job {j}'s blocks as "
                                                f"{None if job is None else list(job.block_ids)}, pinned "
                                                f"{self.jobs[j][2]} {self.steps[w].errors[-1:]}")
        self.received[w][j] = job
        self.queue[w].append(j)

    def do_DropGeneration(self, a: dict[str, Any]) -> None:
        w, r, g, kind = a["w"], a["r"], a["g"], a["kind"]
        nt = (r, g, kind)
        if nt not in self.notice[w] or any(self.jobs[j][:2] == (r, g) for j in self.inbox[w]):
            raise Refused(f"no deliverable notice {nt} for {w}")
        self.notice[w].discard(nt)
        self.steps[w].drop_generation(r, finished=(kind == "finish"), generation=g)

    def do_DmaRead(self, a: dict[str, Any]) -> None:
        """The store thread takes the job: the connector's save generator (`WorkerSteps.save_steps`, what
        `run_save` drains) does DmaRead; the driver's DMA copies the rows of the plan's blocks now (the
        put then reads that copy: the model's read happens here, the write at Put)."""
        w = a["w"]
        if self.busy[w] is not None or not self.queue[w]:
            raise Refused(f"{w}: store thread busy or queue empty")
        failed = a.get("outcome") == "failed"  # injected: the handler raised before the read
        if failed:
            self._fault("dma")  # before anything moves: a refused fault leaves every part as it was
        j = self.queue[w].pop(0)
        job = self.received[w].pop(j)
        self.busy[w] = j
        gen = self.steps[w].save_steps(self.io[w], job.req_id, j, job.end_block, job.block_ids, job.block_hashes,
                                       full_end_block=job.full_end_block)
        self.gens[w] = gen
        if failed:
            with _quiet_jobs():  # the job's error log is the point of the injection, not news
                step = gen.throw(InjectedHandlerError(f"injected: DmaRead of job {j} raised"))
            self._expect_step(step, JobAction.DMA_READ, j)
            return
        step = next(gen)
        self._expect_step(step, JobAction.DMA_READ, j)
        if step.plan is not None and step.plan.run:
            rows = {p: self.kv[job.block_ids[p]] for p in step.plan.positions}  # position p is chunk p + 1
            if self.device.type == "cuda":  # as the connector: async device->host copies, then an event
                staged = {p: row.to("cpu", non_blocking=True) for p, row in rows.items()}
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            else:
                stage = self.stage[w]
                for p, row in rows.items():
                    stage[p].copy_(row)
                staged = {p: stage[p] for p in rows}
            self.buf[w] = {p + 1: row for p, row in staged.items()}

    @staticmethod
    def _expect_step(step: Any, action: JobAction, job: int) -> None:
        if step.action is not action:
            raise Refused(f"job {job}: the connector's job steps did {step.action.value}, the model {action.value}")

    def _busy(self, w: str, *phases: str) -> int:
        j = self.busy[w]
        if j is None or self.workers[w].job_state(j) not in phases:
            raise Refused(f"{w}: no job in {phases}")
        return j

    def do_Put(self, a: dict[str, Any]) -> None:
        w, outcome = a["w"], a["outcome"]
        j = self._busy(w, "running")
        ids = self.jobs[j][2]
        # the chunks this rank puts itself (Stripe: its share, the connector's rule); with none there is no
        # store call, and a down store cannot fail it
        mine = [c for c in self.buf[w] if put_positions(c - 1, c, *self.steps[w].stripe)]
        if outcome == "ok" and not self.up and mine:
            raise Refused("the store is down: a put cannot succeed")
        if outcome == "pressure" and not self.up:
            raise Refused("the store is down: it answers no pressure")
        if outcome != "ok" and self.up:
            self._fault("put" if outcome == "fail" else "pressure")
        staged, self.buf[w] = self.buf[w], {}
        self.read_from = {ids[c - 1]: row for c, row in staged.items()}  # what the DMA read
        # the injected outcome: the client under the wrapper answers every exist/put of this job with it
        code = None if outcome == "ok" or not self.up else NO_SPACE if outcome == "pressure" else XFER_FAIL
        fault = self.backend.client.during(("exist", "put"), RawFault(code=code)) if code is not None \
            else contextlib.nullcontext()
        try:
            with fault:
                step = next(self.gens[w])
        finally:
            self.read_from = {}
        self._expect_step(step, JobAction.PUT, j)

    def do_Report(self, a: dict[str, Any]) -> None:
        w = a["w"]
        j = self._busy(w, "stored", "failed", "stale", "skipped")
        step = next(self.gens[w])
        self._expect_step(step, JobAction.REPORT, j)
        self.gens[w] = None  # the generator has nothing left but its end
        self.busy[w] = None
        self.uncollected.add((w, j))

    def do_Evict(self, a: dict[str, Any]) -> None:
        r, c = a["k"]
        if not self.backend.exists(self.skey(r, c)):
            raise Refused("nothing to evict")
        self._fault("evict")
        self.backend.remove(self.skey(r, c))
        self._emit("store", "Evict", key=[r, c])

    def do_StoreFail(self, a: dict[str, Any]) -> None:
        if not self.up:
            raise Refused("already down")
        self._fault("fail")
        self.up = False
        self.backend.client.always(BATCH_OPS, RawFault(code=STORE_DOWN))  # the master is gone
        self._emit("store", "StoreFail")

    def do_StoreRestart(self, a: dict[str, Any]) -> None:
        if self.up:
            raise Refused("store is up")
        for r in self.req:
            for c in range(1, self.num_chunks + 1):
                self.backend.remove(self.skey(r, c))
        self.backend.client.always(BATCH_OPS, None)
        self.backend.pass_backoff()  # time passes: the breaker's probe is answered, the wrapper calls the store
        self.up = True
        self._emit("store", "StoreRestart")

    def do_Lookup(self, a: dict[str, Any]) -> None:
        r = a["r"]
        self._engine_synced()
        if self.status[r] != "running" or self.ld[r]["ph"] != "idle":
            raise Refused(f"{r}: no lookup now")
        ext = ask_store(self.ss, self.store, self.requests[r], 0)  # vLLM's get_num_new_matched_tokens(req, 0)
        h = -(-ext // BS)  # chunks: the tail's tokens round up to its block
        self.ld[r].update(ph="done" if h == 0 else "looked", n=h, bad=set(), ext=ext)
        self._emit("sched", "Lookup", req_id=r, hits=h)

    def do_EmitLoad(self, a: dict[str, Any]) -> None:
        r = a["r"]
        ld = self.ld[r]
        self._engine_synced()
        if self.status[r] != "running" or ld["ph"] != "looked":
            raise Refused(f"{r}: no load to emit")
        if self.pool.get_num_free_blocks() < ld["n"]:
            raise Refused("not enough free blocks")
        self.table[r] = self.pool.get_new_blocks(ld["n"])
        ids = [b.block_id for b in self.table[r]]
        # vLLM's update_state_after_alloc, then build_connector_meta hands the pinned load to the ranks
        self.ss.emit_load(self.requests[r], [ids], ld["ext"])
        (spec,) = self.ss.take_loads()
        ld["spec"] = spec
        ld["blocks"], ld["pin"] = list(spec.block_ids), True
        # every rank's load thread takes it: the connector's load generator does EmitLoad (begin_load)
        ld["gens"] = {w: self.steps[w].load_steps(self.io[w], spec.req_id, spec.block_ids, spec.block_hashes, spec.sync)
                      for w in self.ranks}
        for w in self.ranks:
            self._expect_step(next(ld["gens"][w]), JobAction.EMIT_LOAD, 0)
        ld["done"] = {w: 0 for w in self.ranks}
        ld["ph"] = "loading"

    def do_Load(self, a: dict[str, Any]) -> None:
        """One sub-batch of the rank's load generator (`WorkerSteps.load_steps`, what `run_load` drains);
        the last one finishes the load. A transfer failure is injected on the model's failing keys."""
        w, r = a["w"], a["r"]
        ld = self.ld[r]
        if ld["ph"] != "loading" or ld["done"][w] >= ld["n"]:
            raise Refused(f"{w}: no pending key of {r}")
        i0 = ld["done"][w] + 1
        batch = list(range(i0, min(i0 + self.sub_batch - 1, ld["n"]) + 1))
        model_failed = set(a.get("failed", []))
        if self.up and any(i in model_failed and self.backend.exists(self.skey(r, i)) for i in batch):
            self._fault("load")  # a transfer failure of a key the store has
        keys = self.kb.keys([ld["spec"].block_hashes[i - 1] for i in batch])
        xfail = {k: XFER_FAIL for i, k in zip(batch, keys) if i in model_failed and self.backend.exists(k)}
        fault = self.backend.client.during(("get",), RawFault(keys=xfail)) if xfail and self.up \
            else contextlib.nullcontext()
        with fault:
            step = next(ld["gens"][w])
        self._expect_step(step, JobAction.LOAD, 0)
        ids = ld["blocks"]
        ld["bad"] |= {ids.index(b) + 1 for b, _code in step.failed}
        ld["done"][w] = batch[-1]
        if step.result is not None and not ld["spec"].sync:  # the async load finished on this rank
            self.steps[w].take_finished_loads()  # the driver's engine reads the load's end from ld, not this set
        if all(ld["done"][v] >= ld["n"] for v in self.ranks):
            ld["ph"] = "loaded"

    def do_CollectLoad(self, a: dict[str, Any]) -> None:
        """vLLM's finished_recving: every rank finished r's load; the ledger drops the load's pins."""
        r = a["r"]
        ld = self.ld[r]
        if ld["ph"] != "loaded" or not ld["pin"]:
            raise Refused(f"{r}: no finished load holding pins")
        if ld["spec"].sync:  # each rank's worker metadata, merged as vLLM's KVOutputAggregator does
            merged = KVLedgerWorkerMetadata(None, self.steps[self.ranks[0]].take_finished_sync_loads())
            for w in self.ranks[1:]:
                merged = merged.aggregate(KVLedgerWorkerMetadata(None, self.steps[w].take_finished_sync_loads()))
            if merged.completed_loads != {r: len(self.ranks)}:
                raise LedgerInvariantError.of("S9", f"{r}'s sync load reported as {merged.completed_loads}")
            self.ss.collect_sync_loads(merged.completed_loads)
        else:
            self.ss.collect_loads([r])  # vLLM's finished_recving (every rank finished it)
        ld["pin"] = False
        if self.status[r] == "finished":  # aborted during the load: its bookkeeping ends here
            self.ld[r] = {**self._ld_idle(), "ph": "done"}

    def do_HandleLoadErrors(self, a: dict[str, Any]) -> None:
        r = a["r"]
        ld = self.ld[r]
        self._engine_synced()
        if self.status[r] != "running" or ld["ph"] != "loaded" or ld["pin"]:
            raise Refused(f"{r}: no finished and collected load")
        errors: set[int] = set()
        for w in self.ranks:
            errors |= self.steps[w].take_load_errors()
        ids = [b.block_id for b in self.table[r]]
        bad_chunks = {ids.index(b) + 1 for b in errors if b in ids}
        keep = min(bad_chunks) - 1 if bad_chunks else ld["n"]
        self.ncomp[r] = keep  # vLLM's recompute policy: the kept prefix counts as computed
        self.requests[r].num_computed_tokens = self.tokens(r, keep)
        self.ss.load_done(self.requests[r])
        # the load is over: its bookkeeping is cleared (as the model does)
        self.ld[r] = {**self._ld_idle(), "ph": "done"}
        self._emit("sched", "HandleLoadErrors", req_id=r, bad=sorted(bad_chunks), keep=keep)

    # ------------------------------------------------------------------ abstract state
    def observe(self) -> dict[str, Any]:
        blocks = self.pool.blocks
        pinned = {}
        for j in self.sched.inflight_jobs():
            pinned[str(j)] = [self.sched.pinned_block_ids(j), self.sched.ranks_left(j)]
        jp = {}
        for w, wl in self.workers.items():
            row = {}
            for j in range(1, self.sched.next_job_id):
                if str(j) not in pinned:
                    row[str(j)] = "released"
                elif j in self.inbox[w]:
                    row[str(j)] = "emitted"
                else:
                    row[str(j)] = wl.job_state(j)
            jp[w] = row
        ws = {}
        for w, wl in self.workers.items():
            row = {}
            for r in self.req:
                s = wl.request(r) or self._closing(wl, r)
                row[r] = ({"phase": "closed"} if s is None else
                          {"phase": s.state, "live": sorted(s.live), "off": s.saved_offset // BS,
                           "skip": s.pressure_skip and wl.under_pressure})
            ws[w] = row
        store = {}
        for k in self.keys:
            r, c = _key(k)
            out = torch.zeros(ROW)
            code = self.backend.read(self.skey(r, c), out)
            store[k] = self.decode(out) if code >= 0 else ["NoReq", 0]
        return {
            "status": dict(self.status), "gen": dict(self.gen), "ncomp": dict(self.ncomp),
            "emitted": {r: self.emitted_at_finish[r] if r in self.emitted_at_finish else self.ss.emitted_blocks(r)
                        for r in self.req},
            "table": {r: [b.block_id for b in t] for r, t in self.table.items()},
            "ref": [blocks[b].ref_cnt for b in range(1, self.num_blocks + 1)],
            "free": [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()],
            "content": [self.decode(self.kv[b]) for b in range(1, self.num_blocks + 1)],
            "nextJob": self.sched.next_job_id, "pins": pinned, "jp": jp, "ws": ws,
            "buf": {w: sorted([c, self.decode(row)] for c, row in b.items()) for w, b in self.buf.items()},
            "store": store, "up": self.up,
            "ld": {r: {"ph": v["ph"], "n": v["n"], "bad": sorted(v["bad"])} for r, v in self.ld.items()},
            # load pins as the scheduler ledger holds them (EmitLoad .. CollectLoad)
            "lpins": {r: (self.sched.load_pinned_block_ids(r) if r in self.sched.pinned_loads() else [])
                      for r in self.req},
        }

    def _closing(self, wl: WorkerLedger, r: str) -> Any:
        # a finished generation with live jobs is detached from its req_id; reach it through a job
        for j, (jr, *_rest) in self.jobs.items():
            if jr == r and wl.is_live(j):
                s = wl.job_request(j)
                if s.state == "closing":
                    return s
        return None

    def expect(self, s: dict[str, Any]) -> dict[str, Any]:
        next_job = s["nextJob"]
        jobs = s["jobs"]
        pins = {}
        for j in range(1, next_job):
            jb = jobs[j - 1] if isinstance(jobs, list) else jobs[str(j)]
            if jb["left"] > 0:
                tail = [jb["tail"]] if jb.get("tail", 0) else []  # pinned after the job's blocks
                pins[str(j)] = [list(jb["blocks"]) + tail, jb["left"]]
        jp = {w: {str(j): (row[j - 1] if isinstance(row, list) else row[str(j)])
                  for j in range(1, next_job)} for w, row in s["jp"].items()}
        ws = {}
        for w, row in s["ws"].items():
            ws[w] = {r: ({"phase": "closed"} if st["phase"] == "closed" else
                         {"phase": st["phase"], "live": sorted(st["live"]), "off": st["off"],
                          "skip": st["skip"]})
                     for r, st in row.items()}
        return {
            "status": s["status"], "gen": s["gen"], "ncomp": s["ncomp"], "emitted": s["emitted"],
            "table": {r: list(t) for r, t in s["table"].items()},
            "ref": _seq(s["ref"]), "free": list(s["free"]),
            "content": [list(c) for c in _seq(s["content"])],
            "nextJob": next_job, "pins": pins, "jp": jp, "ws": ws,
            "buf": {w: sorted([p[0], list(p[1])] for p in b) for w, b in s["buf"].items()},
            "store": {k: list(v) for k, v in s["store"].items()}, "up": s["up"],
            "ld": {r: {"ph": v["ph"], "n": v["n"], "bad": sorted(v["bad"])} for r, v in s["ld"].items()},
            "lpins": {r: (_seq(v["dst"]) if v["pin"] else []) for r, v in s["ld"].items()},
        }

    # ------------------------------------------------------------------ fuzz hooks
    OUTPUT_PARAMS = {"job", "g", "lo", "hi", "from", "blocks", "hits", "bad", "keep", "released",
                     "freed", "keys", "r_", "held"}

    def inputs(self, a: dict[str, Any]) -> Any:
        """What a caller chooses: the action, its request/rank/key, and injected fault outcomes."""
        out = {k: v for k, v in a.items() if k not in self.OUTPUT_PARAMS}
        if a["name"] == "DmaRead":
            out["outcome"] = "failed" if a["outcome"] == "failed" else "-"
        if a["name"] == "Receive":
            out.pop("r", None)
        if a["name"] == "Load":
            out["xfail"] = bool(a.get("failed"))
            out.pop("failed", None)
        return out

    def check_invariants(self) -> None:
        """S1-S3, S5-S8 on the real parts, independent of the model (S4 NoStaleEffect is a property of
        steps: the oracle compares every rank's live sets, offsets and skip flags after each step)."""
        obs = self.observe()
        for k, v in obs["store"].items():
            if v != ["NoReq", 0] and v != list(_key(k)):
                raise LedgerInvariantError.of("S1", f"store key {k} holds {v}")
        inflight = set(self.sched.inflight_jobs())
        for w, j in self.busy.items():
            if j is None or self.workers[w].job_state(j) != "running":
                continue
            r, _g, ids, _lo, _hi = self.jobs[j]
            if j not in inflight:
                raise LedgerInvariantError.of("S2", f"{w} reads job {j} whose pins are released")
            for c, row in self.buf[w].items():
                if self.decode(row) != [r, c] or self.decode(self.kv[ids[c - 1]]) != [r, c]:
                    raise LedgerInvariantError.of("S2", f"{w} job {j} chunk {c}: read {self.decode(row)}")
        for j in inflight:
            open_ranks = sum(1 for w in self.ranks if j in self.inbox[w]
                             or self.workers[w].job_state(j) != "reported")
            if self.sched.ranks_left(j) < open_ranks:
                raise LedgerInvariantError.of("S5", f"job {j}: ranks_left {self.sched.ranks_left(j)} < "
                                                    f"{open_ranks} ranks still to report")
        for r in self.req:
            if self.status[r] == "running":
                for i in range(1, self.ncomp[r] + 1):
                    got = self.decode(self.kv[self.table[r][i - 1].block_id])
                    if got != [r, i]:
                        raise LedgerInvariantError.of("S7", f"{r} counts chunk {i} computed, block holds {got}")
            ld = self.ld[r]
            if ld["ph"] == "loading" and any(ld["done"][w] < ld["n"] for w in self.ranks):
                # S9: a rank still writes into these blocks: the load must hold its pin on them
                held = self.sched.load_pinned_block_ids(r) if r in self.sched.pinned_loads() else []
                others = {x.block_id for q, t in self.table.items() if q != r for x in t}
                free = {x.block_id for x in self.pool.free_block_queue.get_all_free_blocks()}
                if held != ld["blocks"] or free & set(held) or others & set(ld["blocks"]):
                    raise LedgerInvariantError.of("S9", f"{r}'s load writes {ld['blocks']}; pinned {held}")
            if ld["ph"] == "loaded":
                for i in range(1, ld["n"] + 1):
                    got = self.decode(self.kv[ld["blocks"][i - 1]])
                    if got != [r, i] and i not in ld["bad"]:
                        raise LedgerInvariantError.of("S8", f"{r} key {i} not loaded ({got}) and not reported")
        for b in range(1, self.num_blocks + 1):
            holders = sum(b in [x.block_id for x in t] for t in self.table.values())
            holders += sum(b in blocks for blocks, _ in obs["pins"].values())
            holders += sum(b in blocks for blocks in obs["lpins"].values())
            if obs["ref"][b - 1] != holders:
                raise LedgerInvariantError.of("S3", f"block {b}: ref {obs['ref'][b - 1]} != {holders} holders")
        if len(obs["pins"]) > self.pin_cap:
            raise LedgerInvariantError.of("S6", f"{len(obs['pins'])} pinned jobs > cap {self.pin_cap}")


def _seq(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v[str(i)] for i in range(1, len(v) + 1)]


def _key(k: str) -> tuple[str, int]:
    import json

    r, c = json.loads(k)
    return r, int(c)
