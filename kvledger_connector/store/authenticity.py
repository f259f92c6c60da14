"""Whether the master a store client talks to is the embedded one it joined (kvledger_connector/store/embedded.py
started it, in this process or another of the engine's: kvledger_connector/store/rendezvous.py).

A master this client cannot authenticate is a master down: the client's breaker opens when the listener on the
master's port is not that master's (its socket inode; checked at most once per `AUTH_CHECK_INTERVAL_S` on the
calling thread, counted in `master_unauthentic`), and a probe closes it only while it is. Whoever took the port
after the master died gets the client's calls for at most that interval (the client's own heartbeat to its
master address is Mooncake's, not stopped here). A master restarted on its address is followed; one its owner
moved to a fresh port (its old one taken) is not: the client stays on the old address, so its breaker stays
open (lookups miss, saves and loads fail, nothing wrong is read) and one error says the engine must be
restarted to use it (no client re-setup here).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Protocol

logger = logging.getLogger(__name__)

#: how often a call checks that an embedded master is still the authenticated one (a /proc read)
AUTH_CHECK_INTERVAL_S = 1.0


class MasterHandle(Protocol):
    """What the check reads of an embedded master's handle (`EmbeddedMooncake`, `AttachedMooncake`)."""

    @property
    def master_address(self) -> str: ...

    #: where the master's owner republished it when it moved to another address; None while it has not
    moved_to: str | None

    def authentic(self) -> bool:
        """Whether the listener on the master's port is that master's."""
        ...


class MasterIdentity:
    """The identity check of a client joined to ``address``, the master of ``embedded`` (None: a configured
    master, the operator's to secure: always authentic)."""

    def __init__(self, embedded: MasterHandle | None, address: str | None) -> None:
        self.embedded = embedded
        self.address = address
        self._due = -math.inf  # time.monotonic() of the next check (AUTH_CHECK_INTERVAL_S)
        self._moved_logged = False

    def authentic(self) -> bool:
        """Whether the master this client talks to is the embedded one it joined; True without an embedded
        handle. A master moved to another address is not: this client cannot follow it, and says so once."""
        emb = self.embedded
        if emb is None:
            return True
        ok = bool(emb.authentic())
        now = emb.moved_to or emb.master_address
        if now != self.address:
            if not self._moved_logged:
                self._moved_logged = True
                logger.error("the embedded Mooncake master moved from %s to %s (another process took its port): "
                             "this process's store client stays on the old address, so its store calls are "
                             "skipped; restart the engine to use the moved master", self.address, now)
            return False
        return ok

    def due(self) -> bool:
        """Whether a check is due now (at most once per AUTH_CHECK_INTERVAL_S; never without an embedded
        handle). Marks it made: concurrent callers skip this round."""
        if self.embedded is None:
            return False
        now = time.monotonic()
        if now < self._due:
            return False
        self._due = now + AUTH_CHECK_INTERVAL_S
        return True
