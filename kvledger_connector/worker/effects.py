"""What a job's generator asks for, and who makes it (etcd-raft's Ready/Advance): the worker's step functions
(kvledger_connector/worker/steps.py) neither call the store, nor wait on the device, nor take a lock. A job's
generator yields a `StoreCall` (kvledger_connector/store/io.py) or a `DeviceCall`, a value that says which call
to make; whoever drives the generator makes it and sends the answer back in.

`Stepped` is that driver: it answers every call through a `JobEdge` and hands its caller only the model's
steps, so a store thread drains a job by iterating over it and the conformance replay advances one model
action per ``next()``. The edge holds the caller's lock, if any (the worker side's, shared with the model
runner thread): the job's own code, the ledgers it moves, runs under it; every call is made outside it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ContextManager, Generic, Literal, TypeVar

from kvledger_connector.store.io import StoreCall, StoreIO

DeviceOp = Literal["wait", "seal", "verify"]


@dataclass(frozen=True)
class DeviceCall:
    """Work on the KV cache's device a job asks for, answered by its result: ``wait``, the forward's writes to
    the blocks have landed (``on``: the step's event, anything with ``synchronize()``); ``seal`` / ``verify``,
    the integrity tags of blocks (``on``: the `BlockSeal`, ``args``: its method's arguments; their kernels,
    kvledger_connector/shape/tagkernel.py)."""
    op: DeviceOp
    on: Any
    args: tuple[Any, ...] = ()


def make_device_call(call: DeviceCall) -> Any:
    if call.op == "wait":
        return call.on.synchronize()
    return getattr(call.on, call.op)(*call.args)


class JobEdge:
    """Where a job's calls are made: its store calls through ``io`` (`StoreIO`: an exception becomes
    CLIENT_EXCEPTION per key), its device calls on the calling thread; the job's own code runs under ``lock``
    (None: a single-threaded driver's, no lock)."""

    def __init__(self, io: StoreIO, lock: ContextManager[Any] | None = None) -> None:
        self.io = io
        self.lock: ContextManager[Any] = lock if lock is not None else contextlib.nullcontext()

    @classmethod
    def of(cls, edge: JobEdge | StoreIO) -> JobEdge:
        return edge if isinstance(edge, JobEdge) else cls(edge)

    def make(self, call: StoreCall | DeviceCall) -> Any:
        return self.io(call) if isinstance(call, StoreCall) else make_device_call(call)


_S = TypeVar("_S")


class Stepped(Generic[_S]):
    """A job's generator (yielding its model steps, `StoreCall`s and `DeviceCall`s) with every call made by
    ``edge``: an iterator of the model steps alone. ``throw`` and ``close`` go to the job's generator, as they
    would on it (a job fails, or is abandoned, where it stands; `WorkerSteps.save_steps`); so does a device
    call that raised, at the point that asked for it."""

    def __init__(self, gen: Generator[_S | StoreCall | DeviceCall, Any, None], edge: JobEdge | StoreIO) -> None:
        self.gen = gen
        self.edge = JobEdge.of(edge)

    def __iter__(self) -> Stepped[_S]:
        return self

    def __next__(self) -> _S:
        with self.edge.lock:
            item = self.gen.send(None)
        return self._answer(item)

    def throw(self, exc: BaseException) -> _S:
        with self.edge.lock:
            item = self.gen.throw(exc)
        return self._answer(item)

    def close(self) -> None:
        with self.edge.lock:
            self.gen.close()

    def _answer(self, item: _S | StoreCall | DeviceCall) -> _S:
        while isinstance(item, (StoreCall, DeviceCall)):
            try:
                answer = self.edge.make(item)
            except Exception as e:  # a device call raised: the job meets it where it asked
                with self.edge.lock:
                    item = self.gen.throw(e)
                continue
            with self.edge.lock:
                item = self.gen.send(answer)
        return item
