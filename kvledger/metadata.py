"""Worker metadata: ``completed_saves = {store_job_id: number of ranks that finished it}`` and
``completed_loads = {req_id: number of ranks that finished its sync load}``.

The engine merges the per-rank objects of one step before the scheduler sees them; :func:`aggregate` is
that merge: a pure sum of counts, associative and commutative (property-tested), with the empty mapping as
identity. The connector wraps it in vLLM's ``KVConnectorWorkerMetadata`` (kvledger does not import vLLM).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from .errors import LedgerInputError

CompletedSaves = dict[int, int]
CompletedLoads = dict[str, int]


def check_completed(completed: Mapping[int, int], field: str = "completed_saves") -> None:
    """Every key a job id (int >= 0), every count an int > 0."""
    for job_id, n in completed.items():
        if job_id.__class__ is not int or job_id < 0:
            raise LedgerInputError(f"{field} key", job_id, "a store job id must be an int >= 0")
        if n.__class__ is not int or n <= 0:
            raise LedgerInputError(f"{field}[{job_id}]", n, "a report count must be an int > 0")


def check_completed_loads(completed: Mapping[str, int], field: str = "completed_loads") -> None:
    """Every key a req_id (a non-empty str), every count an int > 0."""
    for req_id, n in completed.items():
        if req_id.__class__ is not str or not req_id:
            raise LedgerInputError(f"{field} key", req_id, "a req_id must be a non-empty str")
        if n.__class__ is not int or n <= 0:
            raise LedgerInputError(f"{field}[{req_id!r}]", n, "a report count must be an int > 0")


def aggregate_loads_into(acc: dict[str, int], other: Mapping[str, int]) -> dict[str, int]:
    """Adds ``other``'s sync-load reports into ``acc`` (a sum per req_id, like `aggregate_into`)."""
    check_completed_loads(other)
    for req_id, n in other.items():
        acc[req_id] = acc.get(req_id, 0) + n
    return acc


def aggregate(a: Mapping[int, int], b: Mapping[int, int]) -> CompletedSaves:
    """A new mapping with the counts of ``a`` and ``b`` summed per job id."""
    check_completed(a)
    check_completed(b)
    out = dict(a)
    for job_id, n in b.items():
        out[job_id] = out.get(job_id, 0) + n
    return out


def aggregate_into(acc: dict[int, int], other: Mapping[int, int]) -> dict[int, int]:
    """In-place form (vLLM's ``aggregate`` mutates its accumulator): adds ``other`` into ``acc``."""
    check_completed(other)
    for job_id, n in other.items():
        acc[job_id] = acc.get(job_id, 0) + n
    return acc


def aggregate_all(parts: Iterable[Mapping[int, int]]) -> CompletedSaves:
    out: dict[int, int] = {}
    for p in parts:
        aggregate_into(out, p)
    return out
