"""Scheduler-side probes and mutants: small deterministic scenarios on the connector's own scheduler steps
(kvledger_connector/scheduler/steps.py, the functions SchedulerSide runs in vLLM's scheduler thread), for
what the replay's small configs cannot show (two shards, a second job of one generation, a deferral, two
jobs released in one step, a req_id reused in the step its old request's finish is reported).

Each probe raises :class:`ProbeFailed` naming what it saw; `PROBES` runs in the mutant table
(conformance/mutants.py) and, unmutated, in tests/unit/test_sched_probes.py. `MUTANTS` are the seeded bugs
of the scheduler side (each patches a function on the shipped path) and `SHOWS` the direct observation
that each changes what its name says. Requests here are plain values (`Req`), as the steps take them;
BlockPool is vLLM's own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from vllm.v1.core.block_pool import BlockPool

from conformance.kvdriver import DriverRequest
from conformance.kvprobes import ProbeFailed, ProbeStore, check
from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger_connector.config import model as connector_config
from kvledger_connector.scheduler import plan as scheduler_plan
from kvledger_connector.config import ConnectorConfig, StoreConfig, max_job_blocks
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.metadata import DropNotice, SaveSpec
from kvledger_connector.scheduler.side import ask_store
from kvledger_connector.scheduler.collect import CollectSteps
from kvledger_connector.scheduler.held import HeldState
from kvledger_connector.scheduler.lookup import LookupSteps
from kvledger_connector.scheduler.plan import generation_of
from kvledger_connector.scheduler.requests import _RequestTable
from kvledger_connector.scheduler.saves import SaveSteps
from kvledger_connector.scheduler.steps import SchedulerSteps
from kvledger_connector.shape.group_kind import GroupKind, GroupKinds

BS = 4  # tokens per block


def Req(request_id: str, num_prompt_tokens: int) -> DriverRequest:
    """A request in plain values (`scheduler.plan.RequestLike`), as vLLM counts generations (from 0);
    blocks hashed by their index."""
    return DriverRequest(request_id, num_prompt_tokens, [7 + t for t in range(num_prompt_tokens)],
                         [f"{request_id}:{i}".encode() for i in range(num_prompt_tokens // BS)], num_preemptions=0)


def _kb(tp_rank: int = 0, tp_size: int = 1) -> KeyBuilder:
    return KeyBuilder(KeyLayout(model="probe", tp_rank=tp_rank, tp_size=tp_size, block_size=BS,
                                dtype="torch.float32", kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=8))


@dataclass
class Sched:
    steps: SchedulerSteps
    ledger: SchedulerLedger
    pool: Any  # vLLM's BlockPool
    store: ProbeStore
    table: dict[str, list[int]]  # req_id -> block ids, allocated by vLLM's BlockPool

    def alloc(self, req_id: str, n: int) -> list[int]:
        t = self.table.setdefault(req_id, [])
        if len(t) < n:
            t.extend(b.block_id for b in self.pool.get_new_blocks(n - len(t)))
        return t

    def tables_of(self, req_id: str) -> list[list[int]] | None:
        """The request's block tables as vLLM hands them: one per KV cache group (one here)."""
        t = self.table.get(req_id)
        return None if t is None else [t]

    def step(self, scheduled: dict[str, int]) -> list[SaveSpec]:
        return self.steps.emit_stores(scheduled, self.tables_of)

    def stored(self, req: DriverRequest, n: int, shards: Sequence[int] = (0,)) -> None:
        """Blocks [0, n) of ``req`` in the store, for the given shards."""
        for s in shards:
            for k in self.steps.key_builders[s].keys(req.block_hashes[:n]):
                self.store.data[k] = 1


def sched_config(**settings: Any) -> ConnectorConfig:
    """A probe's connector config, checked as the connector's is: block size BS, one rank, ``settings``."""
    return ConnectorConfig(store=StoreConfig(), block_size=BS, **settings)


def sched(*, shards: int = 1, jobs_cap: int = 4, pins: int = 32, partial_tail: bool = False,
          sync_load_max_tokens: int = 0, policy: str = "fail", held: int = 0) -> Sched:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=16)
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=jobs_cap, max_pinned_blocks=pins, first_job_id=1)
    store = ProbeStore()
    steps = SchedulerSteps(sched_config(max_pinned_blocks=pins, save_partial_tail=partial_tail,
                                        sync_load_max_tokens=sync_load_max_tokens, kv_load_failure_policy=policy,
                                        max_held_requests=held),
                           key_builders=[_kb(s, shards) for s in range(shards)])
    steps.bind_ledger(led)
    return Sched(steps, led, pool, store, {})


def _hybrid(second: str, jobs_cap: int = 4, pins: int = 32) -> Sched:
    """Two KV cache groups: 0 full attention and 1 ``second`` ("state": a Mamba group in align mode;
    "sliding": a 2-block window); the tables are one list per group, as vLLM hands a hybrid's."""
    extra = {"state": (("group", "1"), ("window", "0"), ("state", "align")),
             "sliding": (("group", "1"), ("window", str(2 * BS)))}[second]
    kbs = [_kb(), KeyBuilder(KeyLayout(model="probe", tp_rank=0, tp_size=1, block_size=BS, dtype="torch.float32",
                                       kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=8, extra=extra))]
    pool = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=16)
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=jobs_cap, max_pinned_blocks=pins, first_job_id=1)
    steps = SchedulerSteps(sched_config(max_pinned_blocks=pins, num_groups=2, sync_load_max_tokens=0,
                                        max_held_requests=0), key_builders=kbs)
    steps.bind_ledger(led)
    return Sched(steps, led, pool, ProbeStore(), {})


def _hybrid_tables(s: Sched, n: int) -> tuple[list[int], list[int]]:
    """Both groups' tables of n blocks, from vLLM's BlockPool (one pool, distinct ids)."""
    ids = [b.block_id for b in s.pool.get_new_blocks(2 * n)]
    return ids[:n], ids[n:]


def _run(s: Sched, req: DriverRequest, tokens: int) -> list[SaveSpec]:
    """One engine step computing ``tokens`` more tokens of ``req`` (blocks allocated first)."""
    s.alloc(req.request_id, -(-(req.num_computed_tokens + tokens) // BS))
    saves = s.step({req.request_id: tokens})
    req.num_computed_tokens += tokens
    return saves


# ---------------------------------------------------------------- probes (they kill)
def probe_second_job_pins_from_block_0() -> None:
    """A request's second store job pins every block from block 0 (a rank whose put failed resumes from its
    own saved offset, which lags), not only the blocks new since the first job; it sends only those (the
    ranks hold the first job's)."""
    s = sched()
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    (j1,) = _run(s, req, 2 * BS)
    (j2,) = _run(s, req, BS + 1)
    want = s.table["a"][:3]
    check(s.ledger.pinned_block_ids(j2.store_job_id) == want and list(j2.block_ids) == want[2:],
          f"the second job pins {s.ledger.pinned_block_ids(j2.store_job_id)}, sends {list(j2.block_ids)}; "
          f"the table's first 3 blocks are {want}")
    check(j1.end_block == 2 and j2.start_block == 2 and j2.end_block == 3,
          f"job ranges [{j1.start_block}, {j1.end_block}) and [{j2.start_block}, {j2.end_block})")


def probe_tail_only_once_the_prompt_is_computed() -> None:
    """The partial tail rides on the job that computes the prompt's end, never earlier (its last slots
    would not be written yet), and it is pinned as the job's tail."""
    s = sched(partial_tail=True)
    req = Req("a", 2 * BS + 2)
    s.steps.on_new_request(req)
    s.alloc("a", 3)  # the prompt's blocks, all allocated up front
    (j1,) = _run(s, req, BS)
    check(j1.tail_tokens == 0 and j1.end_block == 1, f"the first job (1 block computed) carries a tail: {j1}")
    (j2,) = _run(s, req, BS + 2)
    t = s.table["a"]
    check(j2.tail_tokens == 2 and j2.start_block == 1 and list(j2.block_ids) == t[1:3],
          f"the prompt-completing job: {j2}")
    check(s.ledger.pinned_block_ids(j2.store_job_id) == t[:3], "the tail block is not pinned")


def probe_deferred_save_is_retried() -> None:
    """At the job cap a save is deferred (nothing pinned); once a pin is released the next step opens it,
    even when the request is not scheduled then."""
    s = sched(jobs_cap=1)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)
    (ja,) = _run(s, a, BS + 1)
    check(_run(s, b, BS + 1) == [], "a job over the cap of 1 was opened")
    check(s.steps.num_deferred == 1, f"{s.steps.num_deferred} saves deferred, expected 1")
    s.steps.collect({ja.store_job_id: 1})
    saves = s.step({})
    check([x.req_id for x in saves] == ["b"], f"after the release the next step opened {saves}")


def probe_collect_frees_in_job_order() -> None:
    """Two jobs released in one step free their blocks in ascending job id order, whatever the order of the
    merged reports (the free queue's order is the model's)."""
    order = []
    for reports in ((1, 2), (2, 1)):
        s = sched()
        reqs = [Req("a", BS + 1), Req("b", BS + 1)]
        for r in reqs:
            s.steps.on_new_request(r)
        jobs = [_run(s, r, BS + 1)[0].store_job_id for r in reqs]
        for r in reqs:  # the requests finish: only the pins hold their blocks
            s.steps.request_finished(r)
            s.pool.free_blocks(s.pool.blocks[x] for x in s.table[r.request_id])
        s.steps.collect({jobs[i - 1]: 1 for i in reports})
        order.append([b.block_id for b in s.pool.free_block_queue.get_all_free_blocks()])
    check(order[0] == order[1], f"the free queue depends on the reports' order: {order[0]} vs {order[1]}")


def probe_finish_notice_keeps_a_reused_id() -> None:
    """vLLM reports a finish in the step that may already admit the id's next request: the notice closes the
    old generation and leaves the new request's lookup, load and saves alone."""
    s = sched()
    old = Req("a", 2 * BS + 1)
    s.steps.on_new_request(old)
    _run(s, old, 2 * BS + 1)
    s.steps.request_finished(old)
    new = Req("a", 2 * BS + 1)
    s.stored(new, 2)
    s.steps.on_new_request(new)
    ext = ask_store(s.steps, s.store, new, 0)
    check(ext == 2 * BS, f"the new request's lookup hit {ext} tokens, expected {2 * BS}")
    s.steps.emit_load(new, [s.alloc("a (new)", 3)], ext)
    drops = s.steps.notices(["a"], [])
    check(drops == [DropNotice("a", 0, True)], f"the finish notice closes {drops}")
    loads = s.steps.take_loads()
    check(len(loads) == 1 and s.steps.num_live_requests == 1,
          f"after the notice: {len(loads)} loads to send, {s.steps.num_live_requests} live requests")


def probe_unannounced_preemption_saves_from_block_0() -> None:
    """A preemption the connector is not told of (reset_prefix_cache(reset_running_requests=True)) still
    starts a new generation: its first job covers the blocks from 0 again."""
    s = sched()
    req = Req("a", 2 * BS + 1)
    s.steps.on_new_request(req)
    _run(s, req, 2 * BS)
    req.num_preemptions += 1  # vLLM preempted it outside schedule(): no notice reaches the connector
    req.num_computed_tokens = 0
    saves = _run(s, req, 2 * BS)
    check(len(saves) == 1 and saves[0].start_block == 0 and saves[0].generation == 1,
          f"the new generation's first step opened {saves}")


def probe_failed_load_blocks_are_saved() -> None:
    """Blocks whose load failed are recomputed and saved: only the loaded blocks vLLM kept count as saved."""
    s = sched()
    req = Req("a", 2 * BS + 1)
    s.stored(req, 2)
    s.steps.on_new_request(req)
    ext = ask_store(s.steps, s.store, req, 0)
    s.steps.emit_load(req, [s.alloc("a", 3)], ext)
    s.steps.take_loads()
    s.steps.collect_loads(["a"])
    # the policy kept block 0 only (block 1 failed): vLLM recomputes from there
    req.num_computed_tokens = BS
    saves = _run(s, req, BS + 1)
    check(len(saves) == 1 and (saves[0].start_block, saves[0].end_block) == (0, 2)
          and s.ledger.pinned_block_ids(saves[0].store_job_id) == s.table["a"][:2],
          f"after a load that kept 1 of 2 blocks the next step opened {saves}")


def probe_lookup_needs_every_shard() -> None:
    """A block is a hit only when every tensor-parallel shard's key exists."""
    s = sched(shards=2)
    req = Req("a", 2 * BS + 1)
    s.stored(req, 2, shards=(0,))
    s.steps.on_new_request(req)
    ext = ask_store(s.steps, s.store, req, 0)
    check(ext == 0, f"a lookup hit {ext} tokens with shard 1's keys missing")


def probe_preempt_notice_names_the_ended_generation() -> None:
    """The preemption notice closes the generation that just ended (vLLM counted the preemption already)."""
    s = sched()
    req = Req("a", BS + 1)
    s.steps.on_new_request(req)
    _run(s, req, BS)
    req.num_preemptions += 1
    drops = s.steps.notices([], ["a"])
    check(drops == [DropNotice("a", 0, False)], f"the preemption notice closes {drops}, expected generation 0")


def _sync_loaded(sync_load_max_tokens: int, policy: str = "fail") -> tuple[Sched, DriverRequest, int]:
    """A request whose first 2 of 3 full blocks are stored and looked up, its blocks allocated."""
    s = sched(sync_load_max_tokens=sync_load_max_tokens, policy=policy)
    req = Req("a", 3 * BS + 1)
    s.stored(req, 2)
    s.steps.on_new_request(req)
    ext = ask_store(s.steps, s.store, req, 0)
    s.alloc("a", 4)
    return s, req, ext


def probe_save_waits_for_the_sync_load() -> None:
    """A sync load is scheduled with its request in one step: no store job of the request opens until the
    ranks reported the load (a failed block would make the blocks computed after it wrong; the model's
    EmitStore needs the load done). Then the job covers every block from 0."""
    s, req, ext = _sync_loaded(1 << 10)
    spec = s.steps.emit_load(req, [s.table["a"]], ext)
    check(spec is not None and spec.sync, f"a load of {ext} tokens under a limit of 1024 is not sync: {spec}")
    req.num_computed_tokens = ext
    early = s.step({"a": req.num_prompt_tokens - ext})
    check(early == [], f"the step of the sync load opened {early} before the load was reported")
    req.num_computed_tokens = req.num_prompt_tokens
    s.steps.collect_sync_loads({"a": 1})
    later = s.step({"a": 1})
    check(len(later) == 1 and s.ledger.pinned_block_ids(later[0].store_job_id) == s.table["a"][:3],
          f"after the report the next step opened {later}")


def probe_reused_id_with_a_pinned_load_loads_async() -> None:
    """A req_id whose earlier load is still pinned (an aborted request, not reported yet) loads async: a
    report releases the oldest pinned load of its req_id, so a sync report must never meet an older one."""
    s, req, ext = _sync_loaded(1 << 10)
    s.ledger.pin_load("a", s.alloc("old", 1))
    spec = s.steps.emit_load(req, [s.table["a"]], ext)
    check(spec is not None and not spec.sync, f"a load of a req_id with a pinned load is sync: {spec}")


def probe_failed_sync_load_block_is_saved_once_recomputed() -> None:
    """A sync load of 2 blocks whose second fails: nothing is decided in the load's step (not even which
    blocks it kept: vLLM cuts them off only when the ranks report), so once vLLM recomputed block 1 the
    request's job saves it (the model's HandleLoadErrors: emitted := kept)."""
    s = sched(sync_load_max_tokens=1 << 10)
    req = Req("a", 2 * BS + 1)
    s.stored(req, 2)
    s.steps.on_new_request(req)
    ext = ask_store(s.steps, s.store, req, 0)
    s.alloc("a", 3)
    s.steps.emit_load(req, [s.table["a"]], ext)
    req.num_computed_tokens = ext
    early = s.step({"a": 1})
    check(early == [], f"the step of the sync load opened {early} before the load was reported")
    req.num_computed_tokens = BS  # vLLM cut the failed block 1 off and recomputes it
    s.steps.collect_sync_loads({"a": 1})
    later = s.step({"a": BS + 1})
    check(len(later) == 1 and later[0].block_ids[-1] == s.table["a"][1],
          f"after a load that kept 1 of 2 blocks and the recompute of block 1 the step opened {later}")


def probe_recompute_policy_loads_async() -> None:
    """Under kv_load_failure_policy "recompute" no load is sync, however short: vLLM would keep a failed sync
    load's blocks in its prefix cache (evicted only under "fail"), for a later hit to read."""
    s, req, ext = _sync_loaded(1 << 10, policy="recompute")
    spec = s.steps.emit_load(req, [s.table["a"]], ext)
    check(spec is not None and not spec.sync, f"a load under the recompute policy is sync: {spec}")


def probe_save_waits_for_a_shared_block_of_a_sync_load() -> None:
    """A request whose table shares a block with another's unreported sync load (a prefix-cache hit on it in
    the same schedule()) opens no store job until that load is reported: the block's bytes are not known."""
    s, req, ext = _sync_loaded(1 << 10)
    s.steps.emit_load(req, [s.table["a"]], ext)
    other = Req("b", 3 * BS + 1)
    s.steps.on_new_request(other)
    s.table["b"] = s.table["a"][:2] + [b.block_id for b in s.pool.get_new_blocks(2)]
    other.num_computed_tokens = 2 * BS
    early = s.step({"b": BS + 1})
    check(early == [], f"a save reading blocks a sync load still writes opened: {early}")
    other.num_computed_tokens = 3 * BS + 1
    s.steps.collect_sync_loads({"a": 1})
    later = s.step({})
    check([j.req_id for j in later] == ["b"], f"after the report the retried save is {later}")


def probe_mamba_state_saved_only_from_the_offered_block() -> None:
    """A Mamba group's job pins and sends only the state block vLLM offered in this step for a boundary
    (`boundary_state_offloads`), never the other ids its align-mode row holds by position (running states,
    blocks vLLM gives back after the step)."""
    s = _hybrid("state")
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    full, state = _hybrid_tables(s, 4)
    (job,) = s.steps.emit_stores({"a": 3 * BS + 1}, {"a": (full, state)}.get, {"a": [(1, state[2], 3 * BS)]})
    pinned = s.ledger.pinned_block_ids(job.store_job_id)
    check(sorted(pinned) == sorted(full[:3] + [state[2]]), f"the job pins {pinned}; full {full[:3]}, offered "
          f"state {state[2]} (row {state})")
    check(list(job.block_ids) == [full[0], 0, full[1], 0, full[2], state[2]], f"the job sends {job.block_ids}")


def _deferred_behind_a_job(second: str) -> tuple[Sched, DriverRequest, list[int], list[int], int]:
    """A two-group scheduler at a cap of 1 job whose one job (request "x") is open, request "a" (3 full
    blocks and a token) with its tables of 4 blocks per group (`tables`), and x's job id to collect."""
    s = _hybrid(second, jobs_cap=1)
    x, a = Req("x", BS + 1), Req("a", 3 * BS + 1)
    for r in (x, a):
        s.steps.on_new_request(r)
    xfull, xsecond = _hybrid_tables(s, 2)
    full, other = _hybrid_tables(s, 4)
    (jx,) = s.steps.emit_stores({"x": BS + 1}, {"x": (xfull, xsecond)}.get)
    return s, a, full, other, jx.store_job_id


def probe_a_deferred_job_saves_a_kept_state_offer_only_while_vllm_caches_it() -> None:
    """A job deferred at the cap keeps its step's Mamba state offer; its retry in a later step (no offer
    then) pins and sends the offered block while vLLM's prefix-cache record of it is unchanged, and sends
    nothing for the state once the record changed (the block was evicted: its bytes may be another's).
    The record is a dict here (a test double for ``KVCacheBlock.block_hash``: the probe evicts by hand)."""
    for evicted in (False, True):
        s, a, full, state, jx = _deferred_behind_a_job("state")
        records: dict[int, object] = {state[2]: b"a:2"}
        s.steps.block_hash_of = records.get
        tables = {"a": (full, state)}
        check(s.steps.emit_stores({"a": 3 * BS + 1}, tables.get, {"a": [(1, state[2], 3 * BS)]}) == [],
              "a job over the cap of 1 was opened")
        a.num_computed_tokens = 3 * BS + 1
        s.steps.collect({jx: 1})
        if evicted:
            records[state[2]] = b"other"
        jobs = s.steps.emit_stores({}, tables.get)
        check(len(jobs) == 1, f"after the release the deferred save opened {jobs}")  # a check, not an unpack crash
        job = jobs[0]
        want = 0 if evicted else state[2]
        check(list(job.block_ids) == [full[0], 0, full[1], 0, full[2], want],
              f"the retried job sends {list(job.block_ids)}; offered state {state[2]}, record "
              f"{'changed' if evicted else 'unchanged'}")
        pinned = s.ledger.pinned_block_ids(job.store_job_id)
        check((state[2] in pinned) == (not evicted), f"the retried job pins {pinned}")


def probe_a_deferred_job_saves_a_freed_window_block_only_while_vllm_caches_it() -> None:
    """A sliding-window block that vLLM frees (out of the window: null in the request's table) while its
    job is deferred is still pinned and sent by the retry while vLLM's prefix-cache record of it is
    unchanged, and not once the record changed. The record is a dict (a test double, as above)."""
    for evicted in (False, True):
        s, a, full, win, jx = _deferred_behind_a_job("sliding")
        records: dict[int, object] = {b: f"w{b}".encode() for b in win}
        s.steps.block_hash_of = records.get
        tables = {"a": (full, list(win))}
        check(s.steps.emit_stores({"a": 3 * BS + 1}, tables.get) == [], "a job over the cap of 1 was opened")
        a.num_computed_tokens = 3 * BS + 1
        tables["a"][1][0] = 0  # vLLM frees the block that left the window
        s.steps.collect({jx: 1})
        if evicted:
            records[win[0]] = b"other"
        jobs = s.steps.emit_stores({}, tables.get)
        check(len(jobs) == 1, f"after the release the deferred save opened {jobs}")  # a check, not an unpack crash
        job = jobs[0]
        want = 0 if evicted else win[0]
        check(list(job.block_ids) == [full[0], want, full[1], win[1], full[2], win[2]],
              f"the retried job sends {list(job.block_ids)}; freed window block {win[0]}, record "
              f"{'changed' if evicted else 'unchanged'}")


def _lookup(s: Sched, req: DriverRequest, num_computed_tokens: int) -> int:
    """``lookup``, an exception in it a check failure: a mutated hit rule may index past the store's answers."""
    try:
        return ask_store(s.steps, s.store, req, num_computed_tokens)
    except Exception as e:  # noqa: BLE001 - what the probe saw
        raise ProbeFailed(f"the lookup raised {type(e).__name__}: {e}") from e


def probe_a_mamba_hit_needs_only_the_state_at_its_end() -> None:
    """A lookup over a Mamba hybrid hits at H when every full-attention key before H and the state key at H
    exist (vLLM's Mamba hit is that one snapshot); states at earlier boundaries are not needed."""
    s = _hybrid("state")
    req = Req("a", 3 * BS + 1)
    full, state = s.steps.key_builders
    for k in full.keys(req.block_hashes[:3]) + state.keys(req.block_hashes[2:3]):
        s.store.data[k] = 1
    got = _lookup(s, req, 0)
    check(got == 3 * BS, f"the lookup answered {got} tokens, the store holds a hit of {3 * BS}")


def probe_sliding_window_saves_only_reachable_blocks() -> None:
    """A sliding-window group's job pins and sends only the blocks vLLM's rule says a later hit can read
    (`reachable_blocks`; here a stand-in rule keeping blocks 1 and 2 of a 3-block prompt); the full
    group's every block."""
    s = _hybrid("sliding")
    s.steps.reachable_blocks = lambda request, group, lo, hi: [i >= 1 for i in range(lo, hi)]
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    full, sliding = _hybrid_tables(s, 4)
    (job,) = s.steps.emit_stores({"a": 3 * BS + 1}, {"a": (full, sliding)}.get)
    pinned = s.ledger.pinned_block_ids(job.store_job_id)
    check(sorted(pinned) == sorted(full[:3] + sliding[1:3]), f"the job pins {pinned}")
    check(list(job.block_ids) == [full[0], 0, full[1], sliding[1], full[2], sliding[2]],
          f"the job sends {job.block_ids}")


def _lone_sliding() -> Sched:
    """One KV cache group with a 2-block sliding window (a Mistral-like model): its table holds vLLM's null
    block below the window, as a hybrid's sliding group's does."""
    kb = KeyBuilder(KeyLayout(model="probe", tp_rank=0, tp_size=1, block_size=BS, dtype="torch.float32",
                              kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=8,
                              extra=(("group", "0"), ("window", str(2 * BS)))))
    pool = BlockPool(num_gpu_blocks=16, enable_caching=False, hash_block_size=16)
    led = SchedulerLedger(pool, world_size=1, max_inflight_jobs=4, max_pinned_blocks=32, first_job_id=1)
    steps = SchedulerSteps(sched_config(max_pinned_blocks=32, sync_load_max_tokens=0, max_held_requests=0),
                           key_builders=[kb])
    steps.bind_ledger(led)
    return Sched(steps, led, pool, ProbeStore(), {})


def probe_a_lone_sliding_group_never_pins_or_loads_the_null_block() -> None:
    """A sliding-window group alone is served by a hybrid's sliding-group rules: a hit's load fills only the
    blocks vLLM allocated in the window (its table's null blocks are nothing to pin or load), asynchronously
    (a failed one is reported per request)."""
    s = _lone_sliding()
    req = Req("a", 4 * BS + 1)
    s.steps.on_new_request(req)
    s.stored(req, 4)
    n = ask_store(s.steps, s.store, req, 0)
    check(n == 4 * BS, f"the lookup answered {n} tokens, the store holds a hit of {4 * BS}")
    table = [0, 0] + [b.block_id for b in s.pool.get_new_blocks(3)]  # vLLM: null below the window
    try:
        spec = s.steps.emit_load(req, [table], n)
    except LedgerInputError as e:
        check(False, f"the load of a lone sliding group's hit was refused: {e}")
        return
    check(spec is not None and 0 not in spec.block_ids and list(spec.block_ids) == table[2:4],
          f"the load writes {spec and spec.block_ids} of the table {table}")
    check(spec is not None and not spec.sync, "a lone sliding group's load ran sync (failed by block)")


def probe_a_failed_load_is_requeued_once_under_recompute() -> None:
    """Under "recompute" a request whose async load failed answers its next lookup "not yet" once (vLLM then
    moves it out of the head of its queue of KV-holding requests, where it would stall the loads parked
    behind it); under "fail" never (vLLM ends the request)."""
    for policy in ("recompute", "fail"):
        s = sched(policy=policy)
        req = Req("a", 3 * BS + 1)
        s.steps.on_new_request(req)
        s.stored(req, 2)
        n = ask_store(s.steps, s.store, req, 0)
        spec = s.steps.emit_load(req, [s.alloc("a", 4)], n)
        check(spec is not None, "no load for a stored hit")
        s.steps.note_load_errors({spec.block_ids[0]} if spec is not None else set())
        want = policy == "recompute"
        got = [s.steps.requeue_after_failed_load(req), s.steps.requeue_after_failed_load(req)]
        check(got == [want, False], f"under {policy!r} the next two lookups requeued {got}")


def probe_a_load_that_cannot_be_planned_is_pinned_and_reported_failed() -> None:
    """A load `emit_load` could not plan is pinned on the hit's blocks and sent refused: every rank reports it
    failed (its request neither waits for ever nor computes on blocks never loaded)."""
    s = sched()
    req = Req("a", 3 * BS + 1)
    s.steps.on_new_request(req)
    s.stored(req, 2)
    n = ask_store(s.steps, s.store, req, 0)
    table = s.alloc("a", 4)
    spec = s.steps.refuse_load(req, [table], n, "a table vLLM would not hand over")
    check(spec is not None and bool(spec.refused) and list(spec.block_ids) == table[:2],
          f"the refused load is {spec}")
    check(s.ledger.has_pinned_load("a"), "the refused load holds no pin (its report would find none)")
    check([x.req_id for x in s.steps.take_loads()] == ["a"], "the refused load never reaches the ranks")


# ---------------------------------------------------------------- outboxes, counters, Mamba hits and loads, pin cap
def probe_a_finish_notice_is_sent_once() -> None:
    """A finished request's DropNotice goes out in the next step's metadata only: the outbox of finishes is
    cleared at each step, so a later step's notices name that step's finishes alone (re-sent, the metadata
    would grow by every request the engine ever finished)."""
    s = sched()
    for rid in ("a", "b"):
        r = Req(rid, BS + 1)
        s.steps.on_new_request(r)
        _run(s, r, BS + 1)
        s.steps.request_finished(r)
        drops = s.steps.notices([rid], [])
        check(drops == [DropNotice(rid, 0, True)], f"the step after {rid!r} finished sends the notices {drops}")
    again = s.steps.notices([], [])
    check(again == [], f"a step with no finish re-sends the notices {again}")


def probe_the_outboxes_drain_each_step() -> None:
    """A bound on the metadata per step: after a run of requests (saves, a load, finishes), steps with no new
    finish or load send no notice and no load, and the outboxes hold nothing (an outbox that only grows is a
    leak: `_finished_out` is read directly, nothing else shows it)."""
    s = sched()
    reqs = [Req(f"r{i}", 2 * BS + 1) for i in range(3)]
    s.stored(reqs[0], 2)
    sizes = []
    for r in reqs:
        s.steps.on_new_request(r)
        n = ask_store(s.steps, s.store, r, 0)
        if n:
            s.steps.emit_load(r, [s.alloc(r.request_id, 3)], n)
        loads = s.steps.take_loads()
        jobs = _run(s, r, 2 * BS + 1 - n) if not n else []
        if n:
            s.steps.collect_loads([r.request_id])
        s.steps.request_finished(r)
        drops = s.steps.notices([r.request_id], [])
        sizes.append((len(drops), len(loads)))
        s.steps.collect({j.store_job_id: 1 for j in jobs})
    check(sizes == [(1, 1), (1, 0), (1, 0)], f"the steps sent (notices, loads) {sizes}; expected one notice each "
          f"and the first request's one load")
    for step in range(8):
        drops, loads, saves = s.steps.notices([], []), s.steps.take_loads(), s.step({})
        check(drops == [] and loads == [] and saves == [],
              f"idle step {step} sends {len(drops)} notices, {len(loads)} loads, {len(saves)} saves")
    left = len(getattr(s.steps, "_finished_out", {}))
    check(left == 0, f"the outbox of finish notices holds {left} entries after every notice went out")
    check(s.steps.num_tracked == 0, f"{s.steps.num_tracked} request states tracked after every request finished")


def probe_a_save_given_up_is_counted_only_for_a_deferred_finish() -> None:
    """``saves_dropped`` counts a save given up: a request that finishes while its
    save is deferred adds exactly 1; one that finishes with its save done (its job still pinned), a deferral
    itself, and steps after it add nothing."""
    s = sched(jobs_cap=1)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)

    def dropped() -> float:
        return s.steps.stats.total("saves_dropped")

    (ja,) = _run(s, a, BS + 1)
    check(_run(s, b, BS + 1) == [] and s.steps.num_deferred == 1, "b's save was not deferred at the cap of 1")
    check(dropped() == 0, f"a deferral counted as a save given up: {dropped()}")
    s.steps.request_finished(a)  # its save done: a job, still pinned
    check(dropped() == 0, f"a request finishing with its save done counted a save given up: {dropped()}")
    s.steps.request_finished(b)  # deferred: its save is given up
    check(dropped() == 1, f"a request finishing while deferred counted {dropped()}, expected 1")
    s.steps.notices(["a", "b"], [])
    s.steps.collect({ja.store_job_id: 1})
    check(s.step({}) == [] and s.steps.num_deferred == 0, "the finished request's deferred save was retried")
    check(dropped() == 1, f"the steps after the finishes moved the count to {dropped()}")


def probe_a_deferred_save_holds_its_finished_request_until_it_is_stored() -> None:
    """A request that finishes while the cap defers its save is held: `request_finished` asks vLLM to keep its
    blocks, no finish notice goes out (the ranks must take its job), the save is opened once the cap admits
    it, and only after every rank reported that job does its notice go out, with ``release`` (the ranks
    answer finished_sending); the steps keep vLLM stepping until vLLM reports the blocks freed."""
    s = sched(jobs_cap=1, held=2)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)
    (ja,) = _run(s, a, BS + 1)
    check(_run(s, b, BS + 1) == [] and s.steps.num_deferred == 1, "b's save was not deferred at the cap of 1")
    check(s.steps.request_finished(b) is True, "a request finishing while its save is deferred is not held")
    check(s.steps.notices(["b"], []) == [], "a held request's finish notice went out before its save")
    check(s.step({}) == [], "a held request's save was opened past the cap")
    s.steps.collect({ja.store_job_id: 1})
    (jb,) = s.step({})
    check(jb.req_id == "b" and list(jb.block_ids) == s.table["b"][:1], f"the held save opened {jb}")
    check(s.steps.held_release_due() == [], "a held request is due for release while its save's job is pinned")
    check(s.steps.releases() == [], "a held request was released while its save's job is pinned")
    s.steps.collect({jb.store_job_id: 1})
    drops = s.steps.notices([], []) + s.steps.releases()
    check([(d.req_id, d.finished, d.release) for d in drops] == [("b", True, True)],
          f"after its save was stored the held request's notices are {drops}")
    check(s.steps.has_pending_push_work(), "vLLM may stop stepping before it freed the held request's blocks")
    s.steps.note_freed(["b"])
    check(not s.steps.has_pending_push_work() and s.steps.num_held_requests == 0,
          "the held request is still counted after vLLM freed its blocks")
    check(s.steps.stats.total("saves_dropped") == 0 and s.steps.releases() == [],
          "a held save was given up or re-sent")


def probe_held_requests_are_bounded() -> None:
    """At most ``max_held_requests`` are held (deferred, or released and not yet freed by vLLM); a request
    finishing while deferred past that gives its save up (counted) and is freed at once."""
    s = sched(jobs_cap=1, held=1)
    reqs = [Req(n, BS + 1) for n in "abc"]
    for r in reqs:
        s.steps.on_new_request(r)
    for r in reqs:
        _run(s, r, BS + 1)  # a opens the one job; b and c are deferred
    held = [s.steps.request_finished(r) for r in reqs[1:]]
    check(held == [True, False], f"with max_held_requests 1 the deferred finishes were held {held}")
    check(s.steps.num_held_requests == 1 and s.steps.stats.total("saves_dropped") == 1,
          f"{s.steps.num_held_requests} held, {s.steps.stats.total('saves_dropped')} given up; expected 1 and 1")


def probe_a_request_ended_by_an_error_is_never_held() -> None:
    """A request vLLM ends with an error (``may_hold`` False: e.g. its blocks' load failed under "fail") is
    never held for its deferred save: those blocks may hold what the failed load left. The save is given up."""
    s = sched(jobs_cap=1, held=2)
    a, b = Req("a", BS + 1), Req("b", BS + 1)
    for r in (a, b):
        s.steps.on_new_request(r)
    _run(s, a, BS + 1)
    _run(s, b, BS + 1)  # deferred at the cap
    check(s.steps.request_finished(b, may_hold=False) is False and s.steps.num_held_requests == 0,
          "a request ended by an error was held for its deferred save")
    given_up = s.steps.stats.total("saves_dropped")
    check(given_up == 1, f"{given_up} saves given up; expected 1")


def probe_a_mamba_hit_ends_at_its_last_state_key() -> None:
    """A Mamba hybrid's hit of H blocks needs the state key of block H - 1 (the state after H * bs tokens):
    with full-attention keys for blocks [0, F) the hit is the last block below F holding a state key, plus
    one; from a local prefix of 1 block, a state key below it makes no hit."""
    # (full-attention keys [0, F), state keys at, lookup from block, hit in blocks from block 0)
    cases = [(2, (1,), 0, 2), (3, (1,), 0, 2), (3, (0,), 0, 1), (3, (2,), 0, 3), (3, (0, 1), 0, 2),
             (3, (), 0, 0), (3, (1,), 1, 2), (3, (0,), 1, 1), (2, (2,), 0, 0)]
    for nfull, states, start, want in cases:
        s = _hybrid("state")
        req = Req("a", 3 * BS + 1)
        full, state = s.steps.key_builders
        for k in full.keys(req.block_hashes[:nfull]) + state.keys([req.block_hashes[i] for i in states]):
            s.store.data[k] = 1
        got = _lookup(s, req, start * BS)
        want_tokens = max(want - start, 0) * BS
        check(got == want_tokens, f"full-attention keys of blocks [0, {nfull}), state keys at blocks "
              f"{list(states)}, from block {start}: the lookup hit {got} tokens, expected {want_tokens}")


def probe_a_mamba_load_fills_only_the_state_block_at_the_hit_end() -> None:
    """A Mamba hybrid's load fills, of the state group, only the block at the hit's end (vLLM reads the state
    there), with the state key of that block, and every full-attention block of the hit; from a local
    prefix of 1 block, none before it. No other state block is pinned as a load's."""
    for start in (0, 1):
        s = _hybrid("state")
        req = Req("a", 3 * BS + 1)
        fkb, skb = s.steps.key_builders
        for k in fkb.keys(req.block_hashes[:3]) + skb.keys(req.block_hashes[:3]):
            s.store.data[k] = 1
        s.steps.on_new_request(req)
        n = _lookup(s, req, start * BS)
        check(n == (3 - start) * BS, f"from block {start} the lookup hit {n} tokens, expected {(3 - start) * BS}")
        full, state = _hybrid_tables(s, 4)
        try:
            spec = s.steps.emit_load(req, (full, state), n)
        except Exception as e:  # noqa: BLE001 - what the probe saw
            raise ProbeFailed(f"the load of a Mamba hybrid's hit raised {type(e).__name__}: {e}") from e
        want = full[start:3] + [state[2]]
        got = list(spec.block_ids) if spec is not None else None
        check(got == want and spec is not None and list(spec.groups) == [0] * (3 - start) + [1],
              f"from block {start} the load fills {got} (groups {spec and spec.groups}); expected full {full[start:3]}"
              f" and the end's state block {state[2]} of the row {state}")
        check(spec is not None and spec.block_hashes[-1] == req.block_hashes[2],
              "the state block loads another block's key")
        stray = [b for b in state[:2] + full[:start] if s.ledger.load_owner(b) is not None]
        check(stray == [], f"blocks {stray} outside the load are pinned as its destinations")


def probe_the_pin_cap_holds_a_job_of_every_kv_group() -> None:
    """The derived ``max_pinned_blocks`` of a model with g KV cache groups is at least g times the longest
    request's table (its job pins a block per group), through `derive_pin_cap` and `ConnectorConfig`; a
    hybrid's longest prompt under that cap opens its job (below it the save is given up: never admitted)."""
    cc = connector_config  # through the module: the patched function is the one ConnectorConfig calls
    longest = max_job_blocks(4 * BS, BS)

    def derived(make: Callable[[], int]) -> int:
        try:
            return make()
        except Exception as e:  # noqa: BLE001 - a ConfigError here is what the probe saw
            raise ProbeFailed(f"deriving the pin cap raised {type(e).__name__}: {e}") from e
    for g in (1, 2, 3):
        for blocks in (None, 16, 1 << 12):
            cap = derived(lambda: cc.derive_pin_cap(max_model_len=4 * BS, block_size=BS, num_gpu_blocks=blocks,
                                                    max_inflight_jobs=1, num_groups=g))
            check(cap >= g * longest, f"derive_pin_cap with {g} KV cache groups, pool {blocks}: {cap} < "
                  f"{g} x {longest} blocks")
    cap = derived(lambda: cc.ConnectorConfig(store=cc.StoreConfig(), block_size=BS, max_model_len=4 * BS,
                                             num_gpu_blocks=16, max_inflight_jobs=1, num_groups=2
                                             ).max_pinned_blocks)
    check(cap >= 2 * longest, f"ConnectorConfig with 2 KV cache groups derives a cap of {cap} < 2 x {longest}")
    s = _hybrid("sliding", pins=cap)
    req = Req("a", 4 * BS)
    s.steps.on_new_request(req)
    full, win = _hybrid_tables(s, 4)
    jobs = s.steps.emit_stores({"a": 4 * BS}, {"a": (full, win)}.get)
    check(len(jobs) == 1 and s.steps.stats.total("saves_dropped") == 0,
          f"the longest prompt of a 2-group model under the derived cap {cap} opened {jobs}")


PROBES: list[Callable[[], None]] = [
    probe_second_job_pins_from_block_0, probe_tail_only_once_the_prompt_is_computed,
    probe_deferred_save_is_retried, probe_collect_frees_in_job_order, probe_finish_notice_keeps_a_reused_id,
    probe_unannounced_preemption_saves_from_block_0, probe_failed_load_blocks_are_saved,
    probe_lookup_needs_every_shard, probe_preempt_notice_names_the_ended_generation,
    probe_save_waits_for_the_sync_load, probe_reused_id_with_a_pinned_load_loads_async,
    probe_recompute_policy_loads_async, probe_save_waits_for_a_shared_block_of_a_sync_load,
    probe_failed_sync_load_block_is_saved_once_recomputed, probe_mamba_state_saved_only_from_the_offered_block,
    probe_a_mamba_hit_needs_only_the_state_at_its_end, probe_sliding_window_saves_only_reachable_blocks,
    probe_a_deferred_job_saves_a_kept_state_offer_only_while_vllm_caches_it,
    probe_a_deferred_job_saves_a_freed_window_block_only_while_vllm_caches_it,
    probe_a_lone_sliding_group_never_pins_or_loads_the_null_block, probe_a_failed_load_is_requeued_once_under_recompute,
    probe_a_load_that_cannot_be_planned_is_pinned_and_reported_failed,
    probe_a_finish_notice_is_sent_once, probe_the_outboxes_drain_each_step,
    probe_a_save_given_up_is_counted_only_for_a_deferred_finish, probe_a_mamba_hit_ends_at_its_last_state_key,
    probe_a_mamba_load_fills_only_the_state_block_at_the_hit_end, probe_the_pin_cap_holds_a_job_of_every_kv_group,
    probe_a_deferred_save_holds_its_finished_request_until_it_is_stored, probe_held_requests_are_bounded,
    probe_a_request_ended_by_an_error_is_never_held,
]


# ---------------------------------------------------------------- mutants of the scheduler steps
def _pins_from_saved_offset(orig):  # a job pins only the blocks new since the last job (lagging rank unpinned)
    def emit_store(self, saves, req_id, num_scheduled, table_of, boundary_states=()):
        st = self._reqs.get(req_id)
        skip = st.saved_blocks if st is not None else 0

        def table(q: str) -> Any:
            tables = table_of(q)
            return None if tables is None else [[0] * min(skip, len(t)) + list(t[skip:])  # 0: vLLM's null block
                                                for t in tables]
        return orig(self, saves, req_id, num_scheduled, table, boundary_states)
    return emit_store


def _sends_from_saved_offset(orig):  # a spec's ids start at the saved offset, not where the last spec stopped
    def emit_store(self, saves, req_id, num_scheduled, table_of, boundary_states=()):
        st = self._reqs.get(req_id)
        if st is not None and st.generation == st.request.num_preemptions:
            if st.load_pending and not self._ledger().has_pinned_load(req_id):
                self.load_done(st.request)  # as emit_store does first: the kept blocks count as saved
            st.sent_blocks = max(st.sent_blocks, st.saved_blocks)  # after a load the ranks lack [0, kept)
        return orig(self, saves, req_id, num_scheduled, table_of, boundary_states)
    return emit_store


def _tail_before_prompt_end(orig):  # the tail rides on any job, before the prompt's last slots exist
    def _due_tail(self, st, token_len, end):
        return orig(self, st, max(token_len, st.request.num_prompt_tokens), end)
    return _due_tail


def _deferral_forgotten(orig):  # a deferred save is not indexed: never retried
    def set_deferred(self, st, deferred):
        return orig(self, st, False)
    return set_deferred


def _collect_in_report_order(orig):  # the merged reports released in the order they arrived
    def collect(self, completed_saves):
        return self._ledger().collect(dict(completed_saves)) if completed_saves else 0
    return collect


def _finish_notice_wipes_reused_id(orig):  # the finish notice forgets the req_id again (the reuse stall)
    def notices(self, finished_req_ids, preempted_req_ids):
        drops = orig(self, finished_req_ids, preempted_req_ids)
        for r in finished_req_ids:
            self._reqs.drop(r)
        self._loads_out = [x for x in self._loads_out if x.req_id not in finished_req_ids]
        return drops
    return notices


def _generation_not_checked(orig):  # save state survives a preemption the connector was not told of
    def current(self, st):
        return st
    return current


def _load_counted_whole(orig):  # every block of a load counts as saved, failed ones too
    def load_done(self, request):
        st = self._reqs.get(request.request_id)
        if st is not None and st.load_pending:
            request.num_computed_tokens, real = st.loaded_blocks * self.block_size, request.num_computed_tokens
            try:
                orig(self, request)
            finally:
                request.num_computed_tokens = real
    return load_done


def _lookup_own_shard_only(orig):  # the lookup asks, and judges, its own shard's keys only
    def own_shard(self, *args):
        kbs, self.key_builders = self.key_builders, self.key_builders[:1]
        try:
            return orig(self, *args)
        finally:
            self.key_builders = kbs
    return own_shard


def _preempt_notice_off_by_one(orig):  # the notice names the new generation, not the one that ended
    def notices(self, finished_req_ids, preempted_req_ids):
        drops = orig(self, finished_req_ids, preempted_req_ids)
        return [DropNotice(d.req_id, d.generation + 1, d.finished)
                if not d.finished and d.generation is not None else d for d in drops]
    return notices


def _emit_store_with_ledger_answering_no(query: str):
    """An emit_store whose ledger answers False to ``query`` (shadowing the method for that call only)."""
    def patch(orig):
        def emit_store(self, saves, req_id, num_scheduled, table_of, boundary_states=()):
            ledger = self._ledger()
            setattr(ledger, query, lambda _arg: False)
            try:
                return orig(self, saves, req_id, num_scheduled, table_of, boundary_states)
            finally:
                delattr(ledger, query)
        return emit_store
    return patch


# a save is decided while the request's sync load is still unreported
_save_during_sync_load = _emit_store_with_ledger_answering_no("has_pinned_load")
# only the request's own load is waited for, not a block it shares with another request's load
_save_reads_a_loading_block = _emit_store_with_ledger_answering_no("any_load_destination")


def _sync_despite_pinned_load(orig):  # the limit and the policy alone decide: a reused id's second load goes sync
    def load_is_async(self, req_id, num_external_tokens):
        return num_external_tokens > self.sync_load_max_tokens or self.kv_load_failure_policy != "fail"
    return load_is_async


def _sync_under_recompute(orig):  # the policy is not asked: short loads go sync under "recompute" too
    def load_is_async(self, req_id, num_external_tokens):
        policy, self.kv_load_failure_policy = self.kv_load_failure_policy, "fail"
        try:
            return orig(self, req_id, num_external_tokens)
        finally:
            self.kv_load_failure_policy = policy
    return load_is_async


def _state_rows_by_position(orig):  # a Mamba group saves its align-mode row by position, not vLLM's hand-offs
    def _state_rows(tables, offers, lo, hi, block_size, state_groups):
        return list(tables)
    return _state_rows


def _state_hit_as_full(orig):  # a Mamba group's keys asked at every block of the hit, as full attention's
    def _hit_run(self, rows, start, n):
        prop = KeyLayout.is_state
        KeyLayout.is_state = property(lambda _lay: False)  # type: ignore[method-assign,assignment]
        try:
            return orig(self, rows, start, n)
        finally:
            KeyLayout.is_state = prop  # type: ignore[method-assign]
    return _hit_run


def _kept_block_unchecked(orig):  # a deferred job's kept blocks used whatever vLLM's record says now
    def _kept_blocks(self, st):
        return {at: (block_id, True) for at, (block_id, _) in st.kept_blocks.items()}
    return _kept_blocks


def _deferral_keeps_no_block(orig):  # a deferred job keeps nothing vLLM may give back (states, window blocks)
    def _keep_blocks(self, st, tables, lo, hi):
        st.kept_blocks = {}
    return _keep_blocks


def _sliding_saves_every_block(orig):  # a sliding-window group saves every block, vLLM's rule ignored
    def _reachable_rows(tables, reachable, lo, hi):
        return tables
    return _reachable_rows


def _lone_group_as_full_attention(orig):  # one KV cache group is taken for full attention, whatever its window
    def emit_load(self, request, block_ids, num_external_tokens):
        if self.num_groups == 1:
            self.kinds = GroupKinds((GroupKind.FULL_ATTENTION,))
        return orig(self, request, block_ids, num_external_tokens)
    return emit_load


def _failed_load_never_requeued(orig):  # a request whose load failed stays where vLLM left it
    def requeue_after_failed_load(self, request):
        return False
    return requeue_after_failed_load


def _refused_load_dropped(orig):  # a load that cannot be planned is only logged: nothing pinned, nothing sent
    def refuse_load(self, request, block_ids, num_external_tokens, reason):
        self.errors.append(reason)
        return None
    return refuse_load


def _finish_notices_resent(orig):  # the notices come from the outbox of finishes, never cleared: all re-sent
    def notices(self, finished_req_ids, preempted_req_ids):
        outbox = dict(self._finished_out)
        ids = list(outbox) + [r for r in finished_req_ids if r not in outbox]
        try:
            return orig(self, ids, preempted_req_ids)
        finally:
            self._finished_out.update(outbox)
    return notices


def _finish_outbox_never_cleared(orig):  # the outbox of finishes is never cleared (notices right, a leak)
    def notices(self, finished_req_ids, preempted_req_ids):
        outbox = dict(self._finished_out)
        try:
            return orig(self, finished_req_ids, preempted_req_ids)
        finally:
            self._finished_out.update(outbox)
    return notices


def _load_outbox_never_drained(orig):  # take_loads hands the outbox out without emptying it: loads re-sent
    def take_loads(self):
        return list(self._loads_out)
    return take_loads


def _every_finish_counted_dropped(orig):  # a save given up counted at every finish, deferred or not
    def request_finished(self, request):
        st = self._reqs.drop(request.request_id)
        if st is not None:
            self._give_up_save()
        self._finished_out[request.request_id] = generation_of(request)
    return request_finished


def _deferred_finish_not_counted(orig):  # a request finishing while deferred gives its save up uncounted
    def request_finished(self, request):
        self._reqs.drop(request.request_id)
        self._finished_out[request.request_id] = generation_of(request)
    return request_finished


def _state_key_one_block_late(orig):  # the Mamba state key asked at block start + h, not start + h - 1
    def _hit_run(self, rows, start, n):
        # each state builder's answers moved one block on: the shipped rule then reads h
        late = [list(row[1:]) + [0] if kb.layout.is_state else row for row, kb in zip(rows, self.key_builders)]
        return orig(self, late, start, n)
    return _hit_run


def _state_load_fills_every_block(orig):  # a Mamba group loads every state block of the hit, as full attention
    def emit_load(self, request, block_ids, num_external_tokens):
        kinds = self.kinds
        self.kinds = GroupKinds(tuple(GroupKind.FULL_ATTENTION if k is GroupKind.MAMBA_STATE else k
                                      for k in kinds.kinds))
        try:
            return orig(self, request, block_ids, num_external_tokens)
        finally:
            self.kinds = kinds
    return emit_load


def _state_load_fills_the_first_block(orig):  # the end's state loaded into the hit's first state block
    def emit_load(self, request, block_ids, num_external_tokens):
        st = self._reqs.get(request.request_id)
        hit = st.lookup if st is not None else None
        if hit is not None and self.state_groups and num_external_tokens > 0:
            first = hit.num_computed_tokens // self.block_size
            last = -(-(hit.num_computed_tokens + num_external_tokens) // self.block_size)
            tables = [list(t) for t in block_ids]
            for g in self.state_groups:
                if last <= len(tables[g]):
                    tables[g][last - 1] = tables[g][first]
            block_ids = tuple(tables)
        return orig(self, request, block_ids, num_external_tokens)
    return emit_load


def _pin_cap_ignores_kv_groups(orig):  # the derived cap sized for one group's table, whatever the groups
    def derive_pin_cap(*, max_model_len, block_size, num_gpu_blocks, max_inflight_jobs, num_groups=1):
        return orig(max_model_len=max_model_len, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                    max_inflight_jobs=max_inflight_jobs)
    return derive_pin_cap


def _held_free_not_delayed(orig):  # held, yet vLLM is told to free the blocks its deferred save will read
    def request_finished(self, request):
        orig(self, request)
        return False
    return request_finished


def _held_bound_ignored(orig):  # every deferred finish held, past max_held_requests
    def request_finished(self, request):
        bound, self.held.max_held = self.held.max_held, 1 << 30
        try:
            return orig(self, request)
        finally:
            self.held.max_held = bound
    return request_finished


def _held_despite_an_error(orig):  # a request ended by an error held like any other
    def request_finished(self, request, *, may_hold=True):
        return orig(self, request)
    return request_finished


def _held_released_once_opened(orig):  # released when its save's job opens, not when every rank reported it
    def held_release_due(self):
        return [req_id for req_id in self.held if self.held.state(req_id) in (HeldState.SAVING,
                                                                                     HeldState.NOTHING_LEFT)]
    return held_release_due


Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    "sched_pins_from_saved_offset": [(SaveSteps, "emit_store", _pins_from_saved_offset)],
    "sched_tail_before_prompt_end": [(SaveSteps, "_due_tail", _tail_before_prompt_end)],
    "sched_deferral_forgotten": [(_RequestTable, "set_deferred", _deferral_forgotten)],
    "sched_collect_in_report_order": [(CollectSteps, "collect", _collect_in_report_order)],
    "sched_finish_notice_wipes_reused_id": [(SchedulerSteps, "notices", _finish_notice_wipes_reused_id)],
    "sched_generation_not_checked": [(_RequestTable, "current", _generation_not_checked)],
    "sched_failed_load_counted_saved": [(SaveSteps, "load_done", _load_counted_whole)],
    "sched_lookup_own_shard_only": [(LookupSteps, "ask", _lookup_own_shard_only),
                                    (LookupSteps, "_hit", _lookup_own_shard_only)],
    "sched_preempt_notice_off_by_one": [(SchedulerSteps, "notices", _preempt_notice_off_by_one)],
    "sched_sends_from_saved_offset": [(SaveSteps, "emit_store", _sends_from_saved_offset)],
    "sched_save_during_sync_load": [(SaveSteps, "emit_store", _save_during_sync_load)],
    "sched_sync_despite_pinned_load": [(LookupSteps, "load_is_async", _sync_despite_pinned_load)],
    "sched_sync_under_recompute": [(LookupSteps, "load_is_async", _sync_under_recompute)],
    "sched_save_reads_a_loading_block": [(SaveSteps, "emit_store", _save_reads_a_loading_block)],
    "sched_state_rows_by_position": [(scheduler_plan, "_state_rows", _state_rows_by_position)],
    "sched_state_hit_as_full": [(LookupSteps, "_hit_run", _state_hit_as_full)],
    "sched_sliding_saves_every_block": [(scheduler_plan, "_reachable_rows", _sliding_saves_every_block)],
    "sched_kept_block_unchecked": [(SaveSteps, "_kept_blocks", _kept_block_unchecked)],
    "sched_deferral_keeps_no_block": [(SaveSteps, "_keep_blocks", _deferral_keeps_no_block)],
    "sched_lone_group_as_full_attention": [(SchedulerSteps, "emit_load", _lone_group_as_full_attention)],
    "sched_failed_load_never_requeued": [(LookupSteps, "requeue_after_failed_load", _failed_load_never_requeued)],
    "sched_refused_load_dropped": [(SchedulerSteps, "refuse_load", _refused_load_dropped)],
    "sched_finish_notices_resent": [(SchedulerSteps, "notices", _finish_notices_resent)],
    "sched_finish_outbox_never_cleared": [(SchedulerSteps, "notices", _finish_outbox_never_cleared)],
    "sched_load_outbox_never_drained": [(SchedulerSteps, "take_loads", _load_outbox_never_drained)],
    "sched_every_finish_counted_dropped": [(SchedulerSteps, "request_finished", _every_finish_counted_dropped)],
    "sched_deferred_finish_not_counted": [(SchedulerSteps, "request_finished", _deferred_finish_not_counted)],
    "sched_state_key_one_block_late": [(LookupSteps, "_hit_run", _state_key_one_block_late)],
    "sched_state_load_fills_every_block": [(SchedulerSteps, "emit_load", _state_load_fills_every_block)],
    "sched_state_load_fills_the_first_block": [(SchedulerSteps, "emit_load", _state_load_fills_the_first_block)],
    "sched_pin_cap_ignores_kv_groups": [(connector_config, "derive_pin_cap", _pin_cap_ignores_kv_groups)],
    "sched_held_free_not_delayed": [(SchedulerSteps, "request_finished", _held_free_not_delayed)],
    "sched_held_bound_ignored": [(SchedulerSteps, "request_finished", _held_bound_ignored)],
    "sched_held_released_once_opened": [(SchedulerSteps, "held_release_due", _held_released_once_opened)],
    "sched_held_despite_an_error": [(SchedulerSteps, "request_finished", _held_despite_an_error)],
}

#: the shows-probe of each mutant: the probe that observes the patched function directly
SHOWS: dict[str, Callable[[], None]] = dict(zip(MUTANTS, [
    probe_second_job_pins_from_block_0, probe_tail_only_once_the_prompt_is_computed,
    probe_deferred_save_is_retried, probe_collect_frees_in_job_order, probe_finish_notice_keeps_a_reused_id,
    probe_unannounced_preemption_saves_from_block_0, probe_failed_load_blocks_are_saved,
    probe_lookup_needs_every_shard, probe_preempt_notice_names_the_ended_generation,
    probe_failed_load_blocks_are_saved, probe_failed_sync_load_block_is_saved_once_recomputed,
    probe_reused_id_with_a_pinned_load_loads_async, probe_recompute_policy_loads_async,
    probe_save_waits_for_a_shared_block_of_a_sync_load, probe_mamba_state_saved_only_from_the_offered_block,
    probe_a_mamba_hit_needs_only_the_state_at_its_end, probe_sliding_window_saves_only_reachable_blocks,
    probe_a_deferred_job_saves_a_kept_state_offer_only_while_vllm_caches_it,
    probe_a_deferred_job_saves_a_kept_state_offer_only_while_vllm_caches_it,
    probe_a_lone_sliding_group_never_pins_or_loads_the_null_block, probe_a_failed_load_is_requeued_once_under_recompute,
    probe_a_load_that_cannot_be_planned_is_pinned_and_reported_failed,
    probe_a_finish_notice_is_sent_once, probe_the_outboxes_drain_each_step, probe_the_outboxes_drain_each_step,
    probe_a_save_given_up_is_counted_only_for_a_deferred_finish,
    probe_a_save_given_up_is_counted_only_for_a_deferred_finish, probe_a_mamba_hit_ends_at_its_last_state_key,
    probe_a_mamba_load_fills_only_the_state_block_at_the_hit_end,
    probe_a_mamba_load_fills_only_the_state_block_at_the_hit_end, probe_the_pin_cap_holds_a_job_of_every_kv_group,
    probe_a_deferred_save_holds_its_finished_request_until_it_is_stored, probe_held_requests_are_bounded,
    probe_a_deferred_save_holds_its_finished_request_until_it_is_stored, probe_a_request_ended_by_an_error_is_never_held,
]))
assert len(SHOWS) == len(MUTANTS), "a mutant without its shows-probe"
