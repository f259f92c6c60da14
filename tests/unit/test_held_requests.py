"""Held requests as one state machine (kvledger_connector/scheduler/held.py): DEFERRED -> SAVING(job) or
NOTHING_LEFT -> FREEING -> gone, bounded in every state, a wrong transition refused by name."""
from __future__ import annotations

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector.scheduler.held import HeldRequests, HeldState


def test_a_held_request_goes_from_deferred_through_its_job_to_freed() -> None:
    held, pinned = HeldRequests(2), {7}
    held.hold("a", 3)
    assert held.state("a") is HeldState.DEFERRED and held.due(pinned.__contains__) == []
    held.retried("a", 7)
    assert held.state("a") is HeldState.SAVING and held.due(pinned.__contains__) == []
    pinned.clear()  # every rank reported job 7
    assert held.due(pinned.__contains__) == ["a"]
    assert held.release("a", pinned.__contains__) == 3  # the generation its notice closes
    assert held.state("a") is HeldState.FREEING and len(held) == 1 and not held.awaits_save("a")
    held.freed(["a", "b"])
    assert "a" not in held and len(held) == 0 and held.peak == 1


def test_nothing_left_is_due_at_once_and_every_state_counts_against_the_bound() -> None:
    held = HeldRequests(2)
    held.hold("a", 0)
    held.hold("b", 0)
    assert not held.can_hold("c")
    held.give_up("a")
    held.retried("b", None)
    assert held.due(lambda _job: True) == ["a", "b"]
    held.release("a", lambda _job: True)
    assert not held.can_hold("c")  # "a" is FREEING: still held until vLLM frees it


def test_wrong_transitions_are_refused() -> None:
    held = HeldRequests(1)
    with pytest.raises(LedgerInputError):
        held.give_up("a")
    held.hold("a", 0)
    with pytest.raises(LedgerInputError):
        held.hold("a", 0)
    with pytest.raises(LedgerInputError):
        held.release("a", lambda _job: False)  # still deferred
    held.retried("a", 4)
    with pytest.raises(LedgerInputError):
        held.give_up("a")  # its save is not deferred any more
    with pytest.raises(LedgerInputError):
        held.release("a", lambda _job: True)  # job 4 still pinned
