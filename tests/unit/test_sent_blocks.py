"""A job's block ids and hashes cross the wire once per generation (kvledger_connector/worker/steps.py `SentBlocks`,
`WorkerSteps.receive_save`): a SaveSpec carries the blocks no earlier job of its generation sent, each rank
resolves the rest, and a spec that does not continue them is refused and reported, never run on guessed
blocks. The scheduler side's half (what `emit_store` sends) is the probes' (conformance/probes_sched.py)."""
from __future__ import annotations

import pytest

from conformance.kvprobes import io_of, HASHES, ProbeStore, rank
from kvledger.errors import LedgerInputError
from kvledger_connector.worker.sent import SentBlocks
from kvledger_connector.metadata import SaveSpec

H = [bytes([i + 1]) * 32 for i in range(8)]


def spec(job: int, start: int, end: int, ids: tuple[int, ...], *, gen: int = 0, req: str = "r",
         tail: int = 0) -> SaveSpec:
    return SaveSpec(req, job, gen, start, end, ids, tuple(H[start:end]), tail_tokens=tail)


def test_later_specs_carry_only_new_blocks_and_resolve_the_whole_table():
    sb = SentBlocks(4)
    assert sb.resolve(spec(1, 0, 2, (10, 11))) == ((10, 11), tuple(H[:2]))
    assert sb.resolve(spec(2, 2, 3, (12,))) == ((10, 11, 12), tuple(H[:3]))


def test_a_partial_tail_is_the_jobs_own_and_not_kept_in_the_table():
    sb = SentBlocks(4)
    ids, _ = sb.resolve(spec(1, 0, 3, (10, 11, 12), tail=2))  # block 2 is the prompt's partial tail
    assert ids == (10, 11, 12)
    # decode fills block 2: the next job sends it again, now as a full block
    ids, hashes = sb.resolve(spec(2, 2, 4, (12, 13)))
    assert ids == (10, 11, 12, 13) and hashes == tuple(H[:4])


def test_a_new_generation_or_a_reused_id_starts_over_at_block_0():
    sb = SentBlocks(4)
    sb.resolve(spec(1, 0, 2, (10, 11)))
    assert sb.resolve(spec(2, 0, 1, (20,), gen=1))[0] == (20,)
    assert sb.resolve(spec(3, 1, 2, (21,), gen=1))[0] == (20, 21)


@pytest.mark.parametrize("bad, field", [
    (spec(2, 2, 3, (12,), gen=1), "start_block"),  # continues a generation this rank does not hold
    (spec(2, 3, 4, (13,)), "start_block"),  # a gap: block 2 was never sent
    (spec(2, 2, 4, (12,)), "block_ids"),  # fewer ids than its range
    (SaveSpec("r", 2, 0, 2, 3, (12,), ()), "block_hashes"),  # no hash for its block
    (SaveSpec("r", 2, 0, -1, 3, (12,), (H[0],)), "start_block"),
    (SaveSpec("r", 2, 0, 3, 2, (), ()), "start_block"),  # past its own end
])
def test_a_spec_that_does_not_continue_the_table_is_refused_and_changes_nothing(bad, field):
    sb = SentBlocks(4)
    sb.resolve(spec(1, 0, 2, (10, 11)))
    with pytest.raises(LedgerInputError, match=field):
        sb.resolve(bad)
    assert sb.resolve(spec(3, 2, 3, (12,)))[0] == (10, 11, 12)


def test_an_unknown_request_cannot_continue():
    with pytest.raises(LedgerInputError, match="this rank holds none"):
        SentBlocks(4).resolve(spec(1, 1, 2, (11,)))


def test_a_late_notice_of_an_older_generation_keeps_the_newer_table():
    sb = SentBlocks(4)
    sb.resolve(spec(1, 0, 1, (20,), gen=1))
    sb.drop("r", 0)  # generation 0's preemption notice, after generation 1's first job
    assert sb.resolve(spec(2, 1, 2, (21,), gen=1))[0] == (20, 21)
    sb.drop("r", 1)
    assert len(sb) == 0
    sb.resolve(spec(3, 0, 1, (30,)))
    sb.drop("r", None)  # a finish notice of a req_id the scheduler never knew
    assert len(sb) == 0


def test_the_bound_drops_the_oldest_table_and_its_next_spec_is_refused():
    sb = SentBlocks(2)
    for i, req in enumerate("abc"):
        sb.resolve(spec(i, 0, 1, (i,), req=req))
    assert len(sb) == 2 and sb.counts.total("sent_tables_evicted") == 1
    with pytest.raises(LedgerInputError, match="this rank holds none"):
        sb.resolve(spec(9, 1, 2, (9,), req="a"))
    assert sb.resolve(spec(10, 1, 2, (7,), req="c"))[0] == (2, 7)
    with pytest.raises(LedgerInputError, match="max_requests"):
        SentBlocks(0)


def test_a_refused_spec_is_reported_at_once_and_its_pins_can_be_released():
    """Bad input loses nothing: the job the rank cannot resolve is registered and reported (the scheduler
    releases its pins on the report), the error is kept, and no store call is made for it."""
    st = ProbeStore()
    w = rank(st)
    job = w.receive_save(SaveSpec("r", 1, 0, 1, 2, (2,), (HASHES[1],)))
    assert job is None and w.take_reports() == {1: 1}
    assert st.calls == [] and "start_block" in w.errors[-1]
    assert w.stats.total("rejected_jobs") == 1


def test_received_jobs_keep_their_blocks_after_the_table_is_dropped():
    """A finish notice may arrive while the generation's last job is still queued: the job resolved its
    blocks at Receive and runs on them."""
    st = ProbeStore()
    w = rank(st)
    st.mem.update({1: 1, 2: 2})
    j1 = w.receive_save(SaveSpec("r", 1, 0, 0, 1, (1,), (HASHES[0],)))
    j2 = w.receive_save(SaveSpec("r", 2, 0, 1, 2, (2,), (HASHES[1],)))
    w.drop_generation("r", finished=True, generation=0)
    assert len(w.sent) == 0 and j1 is not None and j2 is not None
    assert j2.block_ids == (1, 2) and j2.block_hashes == tuple(HASHES[:2])
    w.run_save(io_of(w), j2.req_id, j2.job_id, j2.end_block, j2.block_ids, j2.block_hashes, None, j2.full_end_block)
    assert w.take_reports() == {2: 1}
