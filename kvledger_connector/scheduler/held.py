"""Held requests: finished while the caps deferred their save, kept by vLLM (`request_finished` delayed the
free) until that save is stored, then released and freed. One machine owns a held request's state:

    request_finished (save deferred)      -> DEFERRED      retried each step with the other deferred saves
    its retry opens the save's job        -> SAVING(job)   released once every rank reported the job
    its retry leaves nothing to save,
      or its save is given up (counted)   -> NOTHING_LEFT  released at the next step
    ReleaseHeld (`release`)               -> FREEING       its finish notice went out with ``release``: every
                                                           rank answers it in finished_sending
    vLLM's finished_sending (`freed`)     -> gone          vLLM freed the blocks it kept

Every state counts against ``max_held_requests``. The job's pins stay the ledger's: the machine asks it
whether a job is still pinned, never keeps a copy. A req_id is held once at a time: vLLM keeps a held
request in its table until it frees it, so no new request takes its id before then.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvledger.errors import LedgerInputError


class HeldState(enum.Enum):
    DEFERRED = "deferred"  # finished while its save was deferred: retried each step
    SAVING = "saving"  # its save's job opened: waits for every rank's report of it
    NOTHING_LEFT = "nothing_left"  # nothing of its save in flight (opened nothing, or given up)
    FREEING = "freeing"  # released: vLLM frees its blocks once every rank answered


@dataclass(frozen=True)
class HeldRequest:
    """One held request: its state, the generation its finish notice closes, and, SAVING, its save's job."""
    state: HeldState
    generation: int
    job: int | None = None


class HeldRequests:
    """The held requests by req_id, bounded by ``max_held`` (every state counts)."""

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self._held: dict[str, HeldRequest] = {}
        self.peak = 0  # most held at once

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[str]:
        """The held req_ids, in the order they were held."""
        return iter(list(self._held))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def state(self, req_id: str) -> HeldState | None:
        held = self._held.get(req_id)
        return None if held is None else held.state

    def awaits_save(self, req_id: str) -> bool:
        """Whether it is held and not yet released: its save's retries move its state (`retried`)."""
        return self.state(req_id) not in (None, HeldState.FREEING)

    def can_hold(self, req_id: str) -> bool:
        """Whether a request finishing now may be held: not held already, and under the bound."""
        return req_id not in self._held and len(self._held) < self.max_held

    def hold(self, req_id: str, generation: int) -> None:
        """request_finished of a request whose save is deferred: DEFERRED."""
        if not self.can_hold(req_id):
            raise LedgerInputError("req_id", req_id, f"is held already, or {self.max_held} are")
        self._held[req_id] = HeldRequest(HeldState.DEFERRED, generation)
        self.peak = max(self.peak, len(self._held))

    def retried(self, req_id: str, job: int | None) -> None:
        """Its save's retry was not deferred again: it opened ``job`` (SAVING), or nothing (NOTHING_LEFT)."""
        held = self._held.get(req_id)
        if held is None or held.state is HeldState.FREEING:
            raise LedgerInputError("req_id", req_id, "is not a held request awaiting its save")
        state = HeldState.NOTHING_LEFT if job is None else HeldState.SAVING
        self._held[req_id] = HeldRequest(state, held.generation, job)

    def give_up(self, req_id: str) -> None:
        """A DEFERRED request's save given up: NOTHING_LEFT."""
        held = self._held.get(req_id)
        if held is None or held.state is not HeldState.DEFERRED:
            raise LedgerInputError("req_id", req_id, "is not a held request whose save is deferred")
        self._held[req_id] = HeldRequest(HeldState.NOTHING_LEFT, held.generation)

    @staticmethod
    def _is_due(held: HeldRequest, is_job_pinned: Callable[[int], bool]) -> bool:
        return held.state is HeldState.NOTHING_LEFT or (
            held.state is HeldState.SAVING and held.job is not None and not is_job_pinned(held.job))

    def due(self, is_job_pinned: Callable[[int], bool]) -> list[str]:
        """The held requests whose release is due: their save's job was reported by every rank (its pins
        released: ``is_job_pinned`` is the ledger's), or nothing of it is left to save."""
        return [req_id for req_id, held in self._held.items() if self._is_due(held, is_job_pinned)]

    def release(self, req_id: str, is_job_pinned: Callable[[int], bool]) -> int:
        """ReleaseHeld: FREEING; the generation its finish notice closes."""
        held = self._held.get(req_id)
        if held is None or not self._is_due(held, is_job_pinned):
            raise LedgerInputError("req_id", req_id, "is not a held request whose save is done")
        self._held[req_id] = HeldRequest(HeldState.FREEING, held.generation)
        return held.generation

    def freed(self, req_ids: Iterable[str]) -> None:
        """vLLM's merged finished_sending: these released requests' blocks are freed; they are gone."""
        for req_id in req_ids:
            if self.state(req_id) is HeldState.FREEING:
                del self._held[req_id]
