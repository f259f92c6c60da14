"""One NDJSON trace sink per file per process (the connector's `trace_path`).

The scheduler connector and every worker connector of one process log into the same file. Each opened its
own buffered stream before; lines then reached the file in flush order, not in the order of the state
changes, and each stream numbered `seq` from 0, so a log could not be checked as one behaviour. Here every
connector of the process that names the same path shares one sink: one lock, one `seq`, each event written
and flushed before the next, so the file order is the order of the state changes (each ledger emits while
its connector holds the lock around the change). A multi-process engine gives each process its own path.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from kvledger.trace import NdjsonTrace
from kvledger_connector.ownfile import append_own_file

_registry_lock = threading.Lock()
_open: dict[str, "SharedTrace"] = {}


class SharedTrace:
    """A locked, line-flushed :class:`NdjsonTrace`, reference-counted by the connectors that use it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = append_own_file("trace_path", path)  # this user's file, not a link
        self._ndjson = NdjsonTrace(self._file)
        self._lock = threading.Lock()
        self.users = 0

    def emit(self, actor: str, action: str, fields: dict[str, Any]) -> None:
        with self._lock:
            self._ndjson.emit(actor, action, fields)
            self._file.flush()

    def _close(self) -> None:
        with self._lock:
            self._file.close()


def open_trace(path: str) -> SharedTrace:
    """The process's sink for `path` (opened in append mode on first use)."""
    key = os.path.realpath(path)
    with _registry_lock:
        sink = _open.get(key)
        if sink is None:
            sink = _open[key] = SharedTrace(path)
        sink.users += 1
        return sink


def close_trace(sink: SharedTrace) -> None:
    """One user is done; the file is closed when the last one is."""
    key = os.path.realpath(sink.path)
    with _registry_lock:
        sink.users -= 1
        if sink.users > 0:
            return
        _open.pop(key, None)
    sink._close()
