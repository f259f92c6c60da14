"""WorkerLedger: live sets per request generation, stale jobs, exactly-once reports.
Scenario names read like the upstream bug they pin down."""
from __future__ import annotations

import pytest

from kvledger import LedgerInputError, LedgerInvariantError, ListTrace, Verdict, WorkerLedger


def w(**kw) -> WorkerLedger:
    args = dict(max_live_jobs=16)
    args.update(kw)
    return WorkerLedger(0, **args)


def run_ok(led: WorkerLedger, job: int, tokens: int) -> Verdict:
    v = led.begin(job)
    if v is Verdict.RUN:
        led.record_saved(job, tokens)
    led.finish(job)
    return v


def test_live_job_runs_moves_offset_and_is_reported_once():
    led = w()
    led.register("r", 0)
    assert led.begin(0) is Verdict.RUN
    assert led.saved_offset(0) == 0
    assert led.record_saved(0, 64)
    led.finish(0)
    assert led.take_completed() == {0: 1}
    assert led.take_completed() == {}
    assert led.request("r").saved_offset == 64


def test_stale_job_cannot_retire_new_generation_51637():
    """upstream 51637: an old generation's job completing after req_id reuse must not retire the new one."""
    led = w()
    led.register("r", 0)                     # generation 1
    led.drop_generation("r", finished=False)  # Preempt
    led.register("r", 1)                     # generation 2
    assert led.begin(0) is Verdict.STALE
    led.finish(0)
    assert led.is_live(1) and led.request("r").live == {1}
    assert run_ok(led, 1, 32) is Verdict.RUN
    assert led.take_completed() == {0: 1, 1: 1}


def test_stale_job_cannot_rewind_offset_of_new_generation():
    led = w()
    led.register("r", 0)
    assert led.begin(0) is Verdict.RUN
    led.drop_generation("r", finished=False)   # preempted during the put
    led.register("r", 1)
    assert run_ok(led, 1, 16) is Verdict.RUN
    assert led.record_saved(0, 64) is False     # the old put lands late: no effect
    led.finish(0)
    assert led.request("r").saved_offset == 16


def test_offset_never_moves_back_for_live_jobs():
    led = w()
    led.register("r", 0)
    led.register("r", 1)
    led.begin(0)
    led.begin(1)
    led.record_saved(1, 64)
    led.record_saved(0, 32)
    assert led.request("r").saved_offset == 64


def test_stale_job_cannot_skip_new_generation_under_pressure():
    led = w()
    led.register("r", 0)
    led.begin(0)
    led.drop_generation("r", finished=False)
    led.register("r", 1)
    led.record_failed(0, pressure=True)   # stale job hits store pressure
    led.finish(0)
    assert led.under_pressure
    assert led.request("r").pressure_skip is False
    assert led.begin(1) is Verdict.RUN


def test_pressure_skips_request_until_a_put_succeeds():
    led = w()
    led.register("a", 0)
    led.register("b", 1)
    led.begin(0)
    led.record_failed(0, pressure=True)
    led.finish(0)
    led.register("a", 2)
    assert led.begin(2) is Verdict.SKIP
    led.finish(2)
    assert run_ok(led, 1, 16) is Verdict.RUN   # b's put succeeds: pressure over
    led.register("a", 3)
    assert led.begin(3) is Verdict.RUN and not led.under_pressure


def test_store_raises_job_still_reported_43742():
    """upstream 43742: an exception between 'job added' and 'job done' must not skip the report."""
    led = w()
    led.register("r", 0)
    led.register("r", 1)
    try:
        led.begin(0)
        raise RuntimeError("store put raised")
    except RuntimeError:
        pass
    finally:
        led.finish(0)
    led.finish(1)   # raised before begin: queued -> failed -> reported
    assert led.take_completed() == {0: 1, 1: 1}
    assert led.num_live_jobs == 0 and led.request("r").live == set()


def test_double_finish_raises_reported_once():
    led = w()
    led.register("r", 0)
    led.begin(0)
    led.finish(0)
    with pytest.raises(LedgerInvariantError) as e:
        led.finish(0)
    assert e.value.invariant_id == "S5"
    assert led.take_completed() == {0: 1}
    with pytest.raises(LedgerInvariantError):
        led.finish(0)   # still recognised after the take


def test_unknown_job_id_is_input_error():
    led = w()
    for call in (led.begin, led.finish, led.saved_offset):
        with pytest.raises(LedgerInputError) as e:
            call(5)
        assert e.value.field == "job_id" and e.value.value == 5


def test_duplicate_register_rejected():
    led = w()
    led.register("r", 0)
    with pytest.raises(LedgerInputError):
        led.register("r", 0)
    with pytest.raises(LedgerInputError):
        led.register("r", "0")


def test_finish_with_live_jobs_defers_close_until_they_report():
    led = w()
    led.register("r", 0)
    assert led.drop_generation("r", finished=True) == "closing"
    assert led.begin(0) is Verdict.RUN   # a finished request's job still saves: its blocks are pinned
    led.record_saved(0, 48)
    req = led.job_request(0)
    assert req.state == "closing" and req.saved_offset == 48 and led.num_closing == 1
    assert led.request("r") is None
    led.finish(0)
    assert req.state == "closed" and led.num_closing == 0 and led.num_requests == 0


def test_finish_without_live_jobs_closes_at_once():
    led = w()
    led.register("r", 0)
    run_ok(led, 0, 16)
    assert led.drop_generation("r", finished=True) == "closed"
    assert led.num_requests == 0


def test_drop_unknown_request_is_noop():
    assert w().drop_generation("nope", finished=False) is None


def test_drop_after_finish_does_not_touch_the_closing_generation():
    """Found by the property test: finish (closing), the req_id comes back as a new request and is
    preempted before it saved anything here. The notice is about the new generation: the old one's
    jobs keep saving."""
    led = w()
    led.register("r", 0)
    led.drop_generation("r", finished=True)
    assert led.drop_generation("r", finished=False) is None
    assert led.begin(0) is Verdict.RUN
    led.finish(0)
    assert led.job_request  # closed cleanly
    assert led.num_closing == 0


def test_closed_generation_cannot_be_dropped_again_by_machine():
    from kvledger.machines import STORE_REQUEST, step
    with pytest.raises(LedgerInvariantError) as e:
        step(STORE_REQUEST, "StoreRequest", "closing", "DropGeneration", "closed", "r")
    assert e.value.invariant_id == "StoreRequest"


def test_req_id_reused_after_finish_gets_fresh_generation():
    led = w()
    led.register("r", 0)
    led.drop_generation("r", finished=True)   # closing with job 0 live
    led.register("r", 1)                      # a new request with the same id
    old_gen = led.job_state(0)
    assert old_gen == "queued"
    assert led.request("r").live == {1}
    led.finish(0)                              # closes the old generation, not the new one
    assert led.request("r").live == {1} and led.request("r").state == "open"


def test_bound_on_live_jobs_hits_s6():
    led = w(max_live_jobs=3)
    for j in range(3):
        led.register("r", j)
    with pytest.raises(LedgerInvariantError) as e:
        led.register("r", 3)
    assert e.value.invariant_id == "S6"
    led.finish(0)
    with pytest.raises(LedgerInvariantError):   # reported but not taken still counts
        led.register("r", 3)
    led.take_completed()
    led.register("r", 3)
    assert led.num_live_jobs == 3


def test_bound_on_request_states():
    led = w(max_requests=2)
    led.register("a", 0)
    led.register("b", 1)
    with pytest.raises(LedgerInputError) as e:
        led.register("c", 2)
    assert e.value.field == "max_requests"
    assert led.num_live_jobs == 2


def test_record_saved_rejects_negative_tokens():
    led = w()
    led.register("r", 0)
    led.begin(0)
    with pytest.raises(LedgerInputError) as e:
        led.record_saved(0, -1)
    assert e.value.field == "num_tokens"
    assert led.job_state(0) == "running"


def test_put_before_begin_violates_lifecycle():
    led = w()
    led.register("r", 0)
    with pytest.raises(LedgerInvariantError) as e:
        led.record_saved(0, 16)
    assert e.value.invariant_id == "StoreJob"
    assert led.job_state(0) == "queued"


def test_stale_job_cannot_put():
    led = w()
    led.register("r", 0)
    led.drop_generation("r", finished=False)
    assert led.begin(0) is Verdict.STALE
    with pytest.raises(LedgerInvariantError):
        led.record_saved(0, 16)
    led.finish(0)
    assert led.take_completed() == {0: 1}


def test_trace_events_in_vocabulary():
    tr = ListTrace()
    led = WorkerLedger(1, max_live_jobs=4, trace=tr)
    led.register("r", 0)
    led.drop_generation("r", finished=False)
    led.begin(0)
    led.finish(0)
    assert tr.actions() == ["Receive", "DropGeneration", "DmaRead", "Report"]
    assert {e["actor"] for e in tr.events} == {"w1"}
    assert tr.events[1]["stale"] == [0] and tr.events[2]["dest"] == "stale"
    assert tr.events[3]["from"] == "stale"


def test_request_state_memory_is_small():
    import sys

    from kvledger.worker import StoreRequestState
    st = StoreRequestState("req-0123456789", 3)
    st.live.update(range(4))
    size = sys.getsizeof(st) + sys.getsizeof(st.live) + sys.getsizeof(st.req_id)
    assert size < 2048, size


# ---- scheduler generations (as the model's gen[r]): unannounced preemption, late notices
def test_unannounced_preemption_new_generation_makes_old_jobs_stale():
    """reset_prefix_cache(reset_running_requests=True) preempts outside schedule(): no notice. The next
    generation's first job tells the rank."""
    tr = ListTrace()
    led = WorkerLedger(0, max_live_jobs=8, trace=tr)
    led.register("r", 0, generation=1)
    assert led.begin(0) is Verdict.RUN          # gen 1 job is reading
    led.register("r", 1, generation=1)          # queued, gen 1
    led.register("r", 2, generation=2)          # gen 2 arrives: gen 1 is gone
    assert led.request("r").generation == 2 and led.request("r").live == {2}
    assert tr.events[-1]["superseded"] == [0, 1] and tr.actions().count("DropGeneration") == 0
    assert led.record_saved(0, 128) is False    # the old read lands: no effect on gen 2
    assert led.begin(1) is Verdict.STALE
    assert run_ok(led, 2, 32) is Verdict.RUN
    led.finish(0)
    led.finish(1)
    assert led.request("r").saved_offset == 32
    assert led.take_completed() == {0: 1, 1: 1, 2: 1}


def test_late_notice_of_older_generation_is_ignored():
    led = w()
    led.register("r", 0, generation=1)
    led.register("r", 1, generation=2)          # supersedes gen 1
    assert led.drop_generation("r", finished=False, generation=1) is None
    assert led.is_live(1)


def test_old_generation_job_arriving_late_is_stale():
    led = w()
    led.register("r", 5, generation=2)
    led.register("r", 4, generation=1)
    assert led.begin(4) is Verdict.STALE
    assert led.request("r").live == {5}
    led.finish(4)
    assert led.take_completed() == {4: 1}


def test_notice_for_newer_generation_closes_the_open_one():
    led = w()
    led.register("r", 0, generation=1)
    assert led.drop_generation("r", finished=False, generation=2) == "closed"
    assert led.begin(0) is Verdict.STALE


def test_finish_notice_of_same_generation_defers_close():
    led = w()
    led.register("r", 0, generation=3)
    assert led.drop_generation("r", finished=True, generation=3) == "closing"
    assert led.begin(0) is Verdict.RUN


@pytest.mark.parametrize("g", [-1, 1.0, "2"])
def test_bad_generation_names_field(g):
    led = w()
    with pytest.raises(LedgerInputError) as e:
        led.register("r", 0, generation=g)
    assert e.value.field == "generation" and led.num_live_jobs == 0
