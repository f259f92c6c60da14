"""Property: with vLLM's real BlockPool, random interleavings of Admit / EmitStore / Receive / DmaRead /
Put / Report / Collect / Preempt (announced or not) / Finish over several ranks keep RefCountExact (S3), NoStaleEffect (S4),
ReportedOnce (S5), BoundedPins (S6), and end at rest with every block free and no pin (NoLeakAtRest).
Hypothesis chooses the schedule (the only "fake" here is that choice: the ledgers and the pool are real)."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger import SchedulerLedger, Verdict, WorkerLedger, aggregate_all
from tests.unit.conftest import make_pool

NUM_BLOCKS = 40
REQS = ("a", "b", "c")
MAX_JOBS = 4
MAX_PINS = 12


class LedgerMachine(RuleBasedStateMachine):
    @initialize(world_size=st.integers(1, 3))
    def setup(self, world_size):
        self.ws = world_size
        self.pool = make_pool(NUM_BLOCKS)
        self.sched = SchedulerLedger(self.pool, world_size=world_size, max_inflight_jobs=MAX_JOBS,
                                     max_pinned_blocks=MAX_PINS)
        self.workers = [WorkerLedger(r, max_live_jobs=MAX_JOBS) for r in range(world_size)]
        self.queues: list[list[tuple[int, str, int]]] = [[] for _ in range(world_size)]
        self.running: dict[str, list[int]] = {}       # req_id -> block ids held by the request
        self.generation: Counter[str] = Counter()      # scheduler-side generation per req_id
        self.job_gen: dict[int, tuple[str, int]] = {}
        self.job_blocks: dict[int, list[int]] = {}
        self.pending_reports: list[dict[int, int]] = []
        self.reports_seen: Counter[int] = Counter()

    @precondition(lambda self: len(self.running) < len(REQS))
    @rule(data=st.data(), n=st.integers(1, 4))
    def admit(self, data, n):
        free = [r for r in REQS if r not in self.running]
        r = data.draw(st.sampled_from(free))
        if self.pool.get_num_free_blocks() < n:
            return
        self.running[r] = [b.block_id for b in self.pool.get_new_blocks(n)]
        self.generation[r] += 1

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), grow=st.booleans())
    def emit_store(self, data, grow):
        r = data.draw(st.sampled_from(sorted(self.running)))
        if grow and self.pool.get_num_free_blocks() > 0 and len(self.running[r]) < MAX_PINS // 2:
            self.running[r] += [self.pool.get_new_blocks(1)[0].block_id]
        job = self.sched.open_job(r, self.running[r])
        if job is None:
            return
        self.job_gen[job] = (r, self.generation[r])
        self.job_blocks[job] = list(self.running[r])
        for w, led in enumerate(self.workers):
            led.register(r, job, generation=self.generation[r])
            self.queues[w].append((job, r, len(self.running[r]) * 16))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), finished=st.booleans(), notice=st.booleans())
    def preempt_or_finish(self, data, finished, notice):
        """notice=False: reset_prefix_cache's preemption, which the workers are never told about."""
        r = data.draw(st.sampled_from(sorted(self.running)))
        blocks = self.running.pop(r)
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(blocks))
        if finished or notice:
            for led in self.workers:
                led.drop_generation(r, finished=finished, generation=self.generation[r])

    @precondition(lambda self: any(self.queues))
    @rule(data=st.data(), fail=st.booleans(), pressure=st.booleans(), raise_=st.booleans())
    def worker_runs_one(self, data, fail, pressure, raise_):
        w = data.draw(st.sampled_from([i for i, q in enumerate(self.queues) if q]))
        job, r, tokens = self.queues[w].pop(0)
        led = self.workers[w]
        job_gen = self.job_gen[job][1]
        cur = led.request(r)
        snap = (cur.saved_offset, cur.pressure_skip, set(cur.live)) if cur is not None else None
        try:
            v = led.begin(job)
            if v is Verdict.RUN:
                # S2 DmaReadsPinned: every block the job reads is pinned by it
                for b in self.job_blocks[job]:
                    assert self.pool.blocks[b].ref_cnt >= 1
                assert job in self.sched.inflight_jobs()
                if raise_:
                    raise RuntimeError("store raised")
                if fail:
                    led.record_failed(job, pressure=pressure)
                else:
                    led.record_saved(job, tokens)
        except RuntimeError:
            pass
        finally:
            led.finish(job)
        # S4 NoStaleEffect: a job of another generation than the open one changed nothing of it
        if cur is not None and cur.generation != job_gen:
            assert led.request(r) is cur
            assert (cur.saved_offset, cur.pressure_skip, set(cur.live)) == snap

    @precondition(lambda self: any(led.has_pending_work() for led in self.workers))
    @rule(split=st.booleans())
    def collect(self, split):
        parts = [led.take_completed() for led in self.workers]
        for p in parts:
            for j in p:
                self.reports_seen[j] += 1
        if split:
            for p in parts:
                self.sched.collect(p)
        else:
            self.sched.collect(aggregate_all(parts))

    @invariant()
    def ref_count_exact(self):
        if not hasattr(self, "pool"):
            return
        holders: Counter[int] = Counter()
        for blocks in self.running.values():
            holders.update(blocks)
        for job in self.sched.inflight_jobs():
            holders.update(self.sched.pinned_block_ids(job))
        for b in range(1, NUM_BLOCKS):
            assert self.pool.blocks[b].ref_cnt == holders[b], (b, self.pool.blocks[b].ref_cnt, holders[b])

    @invariant()
    def bounded_and_reported_once(self):
        if not hasattr(self, "pool"):
            return
        assert self.sched.num_inflight_jobs <= MAX_JOBS
        assert self.sched.num_pinned_blocks <= MAX_PINS
        assert all(c <= self.ws for c in self.reports_seen.values())

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        # drain: run every queued job, collect, finish every request: NoLeakAtRest
        for w, q in enumerate(self.queues):
            while q:
                job, _, _ = q.pop(0)
                self.workers[w].begin(job)
                self.workers[w].finish(job)
        self.sched.collect(aggregate_all(led.take_completed() for led in self.workers))
        for r in list(self.running):
            blocks = self.running.pop(r)
            self.pool.free_blocks(self.pool.blocks[b] for b in reversed(blocks))
        assert not self.sched.has_pending_work()
        assert all(self.pool.blocks[b].ref_cnt == 0 for b in range(1, NUM_BLOCKS))
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1


LedgerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40)
TestLedgerProperty = LedgerMachine.TestCase
