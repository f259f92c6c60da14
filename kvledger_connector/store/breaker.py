"""The store client's circuit breaker: a dead master costs one slow call, not one per step.

The first master failure (-900/-901, or a caller's deadline, or a master this process cannot authenticate)
opens it; while it is open the client answers every call with `StoreCode.UNHEALTHY_SKIPPED` at once (each RPC to
a dead master takes ~4 s, and Mooncake's own `health_check()` lags a master crash by ~4-12 s). Only `probe()`
closes it: one question to the master (the client's ``ask``) once `unhealthy_backoff_ms` has passed, the wait
doubled for each failed probe up to `max_unhealthy_backoff_ms`, the breaker closed by the first probe the
master answers (0 or 1). A thread of the breaker's own runs the probes (started at the first failure), so no
caller, the scheduler's step least of all, ever pays a call to a master that is known down. The backoff reads
the ``clock`` given at construction (time.monotonic; a replay passes its own and calls `probe()` itself, to
be deterministic: no thread then).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from kvledger.counts import Counter, Counts
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.contract import MASTER_DOWN_CODES, StoreCode

logger = logging.getLogger(__name__)


class Breaker:
    """The breaker of one client of ``config``'s master. ``ask``: one probe of the master, its code (0 or 1:
    answered; it may raise, counted as a client exception). ``background_probe``: run the probes on a thread
    of the breaker's own (default: when ``clock`` is time.monotonic). Counts into ``stats``: breaker_trips
    (it opened), breaker_probes (probes made). Thread-safe; `open` is read without the lock (a bool, set
    last)."""

    def __init__(self, config: StoreConfig, ask: Callable[[], int], *,
                 clock: Callable[[], float] = time.monotonic, background_probe: bool | None = None) -> None:
        self.config = config
        self._ask = ask
        self._clock = clock
        self.stats: Counter = Counts()
        self.last_exception: BaseException | None = None  # what the prober caught (never seen)
        self.open = False
        self._skip_until = -math.inf  # clock time of the next probe while open
        self._down_in_a_row = 0  # master failures in a row: the one that opened the breaker, then failed probes
        self._probing = False
        self._stopped = False  # the client is closed: no probe, the prober ends
        self._background = clock is time.monotonic if background_probe is None else background_probe
        self._prober: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the prober: the breaker opened, or it was stopped

    def backoff_s(self, down_in_a_row: int) -> float:
        """The wait before the next probe after the `down_in_a_row`-th master failure in a row:
        `unhealthy_backoff_ms` doubled per failure after the first, at most `max_unhealthy_backoff_ms` (never
        below the first)."""
        base, cap = self.config.unhealthy_backoff_ms, self.config.max_unhealthy_backoff_ms
        return min(base << min(max(down_in_a_row, 1) - 1, 32), max(base, cap)) / 1000.0

    @property
    def skip_remaining_s(self) -> float:
        """Seconds until the next probe is due (0 when the breaker is closed, or a probe is due now)."""
        return max(0.0, self._skip_until - self._clock()) if self.open else 0.0

    def trip(self, on_open: Callable[[], None] | None = None) -> None:
        """Open the breaker as a master failure does; ``on_open`` runs first, under the lock, only when this
        call opens it. A breaker already open stays as it is (calls that were inside when the master died:
        one failure, not one per call)."""
        with self._lock:
            if self.open:
                return
            if on_open is not None:
                on_open()
            self._down_in_a_row = 1
            self._skip_until = self._clock() + self.backoff_s(1)
            self.open = True
            logger.warning("Mooncake master %s failed: store calls skipped until a probe is answered (first in "
                           "%.1fs)", self.config.master_server_address, self.backoff_s(1))
            self.stats.add("breaker_trips")
            if self._background and not self._stopped:
                if self._prober is None:
                    self._prober = threading.Thread(target=self._probe_loop, name="kvledger-store-probe",
                                                    daemon=True)
                    self._prober.start()
                self._wake.notify_all()

    def note(self, results: list[int]) -> list[int]:
        """A call's codes: a master-down code among them opens the breaker. Returns them."""
        if results and min(results) < 0 and any(r in MASTER_DOWN_CODES for r in results):
            self.trip()
        return results

    def probe(self, *, force: bool = False) -> bool:
        """One probe of an open breaker whose wait is over (or at once with ``force``): True when the breaker
        is closed after it. The master answered (``ask`` gave 0 or 1): closed. Otherwise the next wait doubles
        (`backoff_s`). At most one probe runs at a time; a closed breaker is not probed, nor one stopped."""
        with self._lock:
            if not self.open:
                return True
            if self._stopped or self._probing or (not force and self._clock() < self._skip_until):
                return False
            self._probing = True
        res = int(StoreCode.CLIENT_EXCEPTION)
        try:
            res = self._ask()
        finally:
            with self._lock:
                self._probing = False
                self.stats.add("breaker_probes")
                if res in (0, 1):
                    self.open = False
                    self._down_in_a_row = 0
                    logger.warning("Mooncake master %s answered a probe: store calls resume",
                                   self.config.master_server_address)
                else:
                    self._down_in_a_row += 1
                    self._skip_until = self._clock() + self.backoff_s(self._down_in_a_row)
        return res in (0, 1)

    def stop(self) -> None:
        """The client closed: no probe is made after this, and the prober ends."""
        with self._lock:
            self._stopped = True
            self._wake.notify_all()

    def _probe_loop(self) -> None:
        """The prober: sleeps while the breaker is closed, probes it each time its wait is over."""
        with self._lock:
            while not self._stopped:
                if not self.open:
                    self._wake.wait()
                    continue
                wait = self._skip_until - self._clock()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                self._lock.release()
                try:
                    self.probe()
                except Exception as e:  # never seen (probe returns codes); the prober must not die of it
                    self.last_exception = e
                finally:
                    self._lock.acquire()

