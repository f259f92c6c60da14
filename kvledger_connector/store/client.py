"""The Mooncake client: a thin, safe wrapper (`MooncakeStore`, a `KVStore`) over
`mooncake.store.MooncakeDistributedStore`, and its set-up (`open_client`).

What it adds over the raw pybind11 client (and why):
  * one result code per key, always (`list[int]`, same length as `keys`), never an exception for a
    per-key problem: the connector turns every negative code into a reported load error or a failed save;
  * inputs checked before they reach C++: mismatched list lengths raise `ValueError` naming the argument;
    a null pointer, a non-positive size or an oversized key becomes a per-key code without calling Mooncake
    (a bad pointer would crash the process, not fail the call);
  * a dead master costs one slow call, not one per step: a circuit breaker (kvledger_connector/store/breaker.py)
    whose probe is one `batch_is_exist` of `PROBE_KEY`;
  * a master it cannot authenticate is a master down: with an embedded handle (`embedded=`: the servers
    this process started, or another process of the engine did) the breaker opens when the listener on the
    master's port is not that master's, and a probe closes it only while it is
    (kvledger_connector/store/authenticity.py);
  * an exception from the client becomes `StoreCode.CLIENT_EXCEPTION` per key (the message is kept in
    `last_exception`), so a store thread never dies of it;
  * the client is never closed under a live call, nor called once closed: either kills the process
    inside Mooncake (measured: SIGSEGV, even for `batch_is_exist` after `close()`). Every call is
    counted in and out under one lock; `close` refuses new calls, waits (bounded) for the calls inside
    to return, and when one does not, leaves the client open (leaked, logged, `store_close_leaked`) rather
    than close it under that call.

Mooncake's disk tier (``disk_offload``, docs/disk-tier.md): a client that owns a memory segment is set up with
offload on, writing to a private directory of its own (kvledger_connector/store/tier.py) that `connect` makes
and `close` removes.

Zero-copy only: puts use `batch_put_from_multi_buffers`, gets `batch_get_into_multi_buffers`; a key's
object is the concatenation of its chunks (e.g. one chunk per layer's K and V), and a get must ask for
exactly the object's total size (larger: -800, smaller: -600).

Network note: the servers we start (kvledger_connector/store/embedded.py) bind 127.0.0.1 only; this client's
transfer-engine ports bind all interfaces by Mooncake's design (INADDR_ANY is hard-coded there), so
`MC_TCP_BIND_ADDRESS` only sets the address we advertise; `kvledger_connector/store/transfer_ports.py` lists
them and prints the firewall recipe.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvledger.counts import Counter, Counts
from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.store.authenticity import MasterIdentity
from kvledger_connector.store.breaker import Breaker
from kvledger_connector.store.contract import StoreCode, StoreError
from kvledger_connector.store.embedded import OFFLOAD_PATH_ENV
from kvledger_connector.store.tier import make_offload_dir, offload_environment, offloads, remove_offload_dir

if TYPE_CHECKING:
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.store.rendezvous import AttachedMooncake


logger = logging.getLogger(__name__)

#: bound on MooncakeStore.close (a close against a dead master measured ~7 s)
CLOSE_TIMEOUT_S = 30.0
#: share of close's bound spent waiting for calls still inside the client (each is bounded by
#: MC_RPC_TIMEOUT_MS per RPC, so a few RPC timeouts' worth)
CLOSE_DRAIN_SHARE = 0.5
#: the key the breaker's probe asks for (never stored: any answer, 0 or 1, shows the master answers)
PROBE_KEY = "kvledger-breaker-probe"


class StoreUnavailableError(StoreError):
    """The client could not join the store; names the master address, the metadata server and the code."""

    def __init__(self, master: str, metadata: str, code: int, hint: str = "") -> None:
        self.master, self.metadata, self.code = master, metadata, code
        super().__init__(f"Mooncake setup() against master_server_address={master!r} metadata_server="
                         f"{metadata!r} returned {StoreCode.label(code)}{'; ' + hint if hint else ''}")


def _check_lists(keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> None:
    if len(ptrs) != len(keys) or len(sizes) != len(keys):
        raise ValueError(f"batch lengths differ: keys={len(keys)} ptrs={len(ptrs)} sizes={len(sizes)}")
    for i, (p, s) in enumerate(zip(ptrs, sizes)):
        if len(p) != len(s):
            raise ValueError(f"key {keys[i]!r}: {len(p)} buffer pointers but {len(s)} sizes")


def _probe(field: str, address: str, other: str, timeout_s: float = 2.0) -> None:
    """Raise StoreUnavailableError unless `address` ("host:port" or a URL) accepts a TCP connection."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if host is None or port is None:
        raise StoreUnavailableError(address if field == "master_server_address" else other,
                                    address if field == "metadata_server" else other, -1,
                                    f"{field}={address!r} has no host:port")
    try:
        socket.create_connection((host, port), timeout_s).close()
    except OSError as e:
        master, metadata = (address, other) if field == "master_server_address" else (other, address)
        raise StoreUnavailableError(master, metadata, int(StoreCode.RPC_FAIL),
                                    f"{field} {host}:{port} does not accept connections ({e})") from None


def _all_positive(ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> bool:
    """Fast path of the buffer check: every pointer and size of every key > 0 (C-speed min over the lists)."""
    try:
        return not ptrs or (min(map(min, ptrs)) > 0 and min(map(min, sizes)) > 0)
    except (ValueError, TypeError):  # an empty chunk list or a non-number: check key by key
        return False


def _unique_rounds(keys: Sequence[str], send: list[int]) -> list[list[int]]:
    """Split `send` so no call repeats a key: Mooncake fails every occurrence of a key that appears twice in
    one batch when any occurrence fails (measured: a good get next to a bad one of the same key gave -800)."""
    if len({keys[i] for i in send}) == len(send):
        return [send] if send else []
    rounds: list[list[int]] = []
    seen: list[set[str]] = []
    for i in send:
        for r, names in zip(rounds, seen):
            if keys[i] not in names:
                r.append(i)
                names.add(keys[i])
                break
        else:
            rounds.append([i])
            seen.append({keys[i]})
    return rounds

#: serialises the process-wide variables Mooncake reads at setup() with the setup that reads them
_SETUP_ENV_LOCK = threading.Lock()


def open_client(config: StoreConfig, *, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                offload_dir: str | None = None) -> tuple[Any, StoreConfig]:
    """A set-up `MooncakeDistributedStore` at `config`'s master (or `embedded`'s), and the config with the
    addresses it used; `MooncakeStore.connect` wraps it. Raises `StoreUnavailableError` when setup() fails.
    A client that writes the disk tier (`offloads`) writes to `offload_dir` (`make_offload_dir`; its caller
    removes it)."""
    if embedded is not None:
        config = config.with_addresses(embedded.master_address, embedded.metadata_server)
    if config.master_server_address is None or config.metadata_server is None:
        raise StoreUnavailableError(str(config.master_server_address), str(config.metadata_server), -1,
                                    "embedded mode: start an EmbeddedMooncake and pass embedded=")
    config = config.with_local_hostname()  # start-up: the route to the master names the address to advertise
    if embedded is not None and not embedded.authentic():
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, int(StoreCode.RPC_FAIL),
                                    "the listener on the embedded master's port is not that master's (gone, or "
                                    "another process's)")
    # setup() against a dead master retries for ~90 s (measured); a TCP probe answers in milliseconds.
    _probe("master_server_address", config.master_server_address, config.metadata_server)
    if config.metadata_server.startswith(("http://", "https://")):
        _probe("metadata_server", config.metadata_server, config.master_server_address)
    # Read by the transfer engine / RPC client at setup() from the environment only: setup() takes no
    # argument for them (neither its positional form nor its dict form), so they stay process-wide, as
    # Mooncake designed them. A transfer that makes no progress (a frozen peer) fails with -800 after
    # transfer_timeout_s instead of hanging.
    os.environ["MC_TCP_BIND_ADDRESS"] = config.local_hostname
    os.environ["MC_RPC_TIMEOUT_MS"] = str(config.rpc_timeout_ms)
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(config.transfer_timeout_s)
    os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(config.transfer_timeout_s)
    from mooncake.store import MooncakeDistributedStore  # heavy import, only at the edge

    tier = offloads(config)
    if tier and offload_dir is None:
        raise ConfigError("disk_offload_dir", config.disk_offload_dir, "open_client: pass offload_dir= "
                          "(make_offload_dir) for a client that writes the disk tier")
    raw = MooncakeDistributedStore()
    try:
        with _SETUP_ENV_LOCK:
            if tier and offload_dir is not None:
                # the tier's backend, bounds and staging buffer are read from the environment only (setup()
                # has no argument for them); its directory is setup()'s ssd_offload_path, which Mooncake
                # takes over the variable (test_disk_tier.py finds the files there), so that one is not set
                os.environ.update({k: v for k, v in offload_environment(config, offload_dir).items()
                                   if k != OFFLOAD_PATH_ENV})
            rc = raw.setup(config.local_hostname, config.metadata_server, config.global_segment_size,
                           config.local_buffer_size, config.protocol, config.rdma_devices,
                           config.master_server_address, None, tier, offload_dir or "")
    except Exception as e:  # pybind11 raises on bad argument types
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, -1,
                                    f"setup raised {type(e).__name__}: {e}") from e
    if rc != 0:
        try:
            raw.close()
        except Exception:
            pass
        # destroyed here, not whenever the traceback is: its destructor unmounts through the master again,
        # ~10 s against one gone meanwhile
        raw = None
        hint = ("disk_offload needs a master started with --enable_offload=true"
                if rc == StoreCode.UNABLE_OFFLOAD else "is the master running and reachable?")
        raise StoreUnavailableError(config.master_server_address, config.metadata_server, rc, hint)
    return raw, config


class MooncakeStore:
    """One Mooncake client. Thread-safe for concurrent batch calls (the client is; our state is a float).

    ``raw``: a set-up `MooncakeDistributedStore` (`open_client`), or a test double over one
    (testbed.faults.FaultyMooncakeClient). ``clock``: seconds, monotonic; only the master-down backoff reads
    it (close's bounds are real waits on time.monotonic). ``background_probe``: run the breaker's probes on a
    thread of the breaker's own (default: when ``clock`` is time.monotonic); without it the owner of the clock
    calls `probe()`."""

    def __init__(self, raw: Any, config: StoreConfig, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                 *, clock: Callable[[], float] = time.monotonic, background_probe: bool | None = None) -> None:
        self._raw = raw
        self.config = config
        self.embedded = embedded  # kept alive as long as the client; stopped by its owner
        self.max_key_bytes = config.max_key_bytes
        # the breaker (kvledger_connector/store/breaker.py); its probe asks the master through this client
        self.breaker = Breaker(config, self._ask_master, clock=clock, background_probe=background_probe)
        self._master = MasterIdentity(embedded, config.master_server_address)
        # the counter sink: breaker_trips (the breaker opened), breaker_probes (probes made: a master this
        # process cannot authenticate is not sent one), master_unauthentic (trips because the master's
        # listener was not the authenticated one), store_close_leaked; the connector sets its StatsRecorder
        self.stats = Counts()
        self._closed = False
        self._lock = threading.Lock()  # close() vs calls
        self._idle = threading.Condition(self._lock)  # notified when the last call inside the client returns
        self._calls_inside = 0  # calls now inside the raw client (guarded by _lock)
        self._close_result: bool | None = None  # what the first close returned (later closes repeat it)
        self.last_exception: BaseException | None = None
        self.registered: dict[int, int] = {}  # ptr -> size
        # this client's own directory of the disk tier (`connect` made it), removed once the client is closed
        self.offload_dir: str | None = None

    # -- connection --------------------------------------------------------------------------------

    @classmethod
    def connect(cls, config: StoreConfig, *, embedded: EmbeddedMooncake | AttachedMooncake | None = None,
                clock: Callable[[], float] = time.monotonic) -> MooncakeStore:
        """Join the store at `config`'s master, or at `embedded`'s when given (then `config` may be in
        embedded mode). Raises `StoreUnavailableError` when setup() fails (bad address, master down)."""
        tier_dir = make_offload_dir(config) if offloads(config) else None
        try:
            raw, config = open_client(config, embedded=embedded, offload_dir=tier_dir)
        except BaseException:
            if tier_dir is not None:
                remove_offload_dir(tier_dir)
            raise
        store = cls(raw, config, embedded, clock=clock)
        store.offload_dir = tier_dir
        return store

    @property
    def raw(self) -> Any:
        """The underlying MooncakeDistributedStore (benchmarks compare against it; do not use in the connector)."""
        return self._raw

    # -- calls into the raw client ------------------------------------------------------------------

    def _enter(self) -> bool:
        """Count a call in; False once closing has begun (the caller must not touch the raw client)."""
        with self._lock:
            if self._closed:
                return False
            self._calls_inside += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._calls_inside -= 1
            if self._calls_inside == 0:
                self._idle.notify_all()

    @property
    def calls_inside(self) -> int:
        """Calls now inside the raw client (tests and shutdown diagnostics)."""
        with self._lock:
            return self._calls_inside

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register a KV-cache region for zero-copy transfers (required for RDMA; harmless over TCP)."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise StoreError(f"register_buffer: ptr={ptr!r} must be a positive address")
        if not isinstance(size, int) or size <= 0:
            raise StoreError(f"register_buffer: size={size!r} must be > 0")
        if not self._enter():
            raise StoreError(f"register_buffer(ptr={ptr:#x}, size={size}): the store is closed")
        try:
            rc = self._raw.register_buffer(ptr, size)
        finally:
            self._leave()
        if rc != 0:
            raise StoreError(f"register_buffer(ptr={ptr:#x}, size={size}) returned {StoreCode.label(rc)}")
        self.registered[ptr] = size

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Unregister buffers and leave the store. Idempotent and safe from several threads (later calls
        return the first one's result; one racing the first may return True before it finishes). Does not
        stop an embedded master.

        New calls are refused at once (per-key INVALID_PARAMS). Calls already inside the client are waited
        for, up to `CLOSE_DRAIN_SHARE` of `timeout_s`: closing under a live call, or calling a closed
        client, crashes the process inside Mooncake. If one is still inside then, the client is left open
        (leaked: logged, counted in `store_close_leaked`) and False is returned.

        Bounded: Mooncake's close unmounts the segment through the master (measured ~7 s with a dead
        master, ~3 s with a hung one) and could block longer on a wedged transfer; it runs in a helper
        thread joined for the rest of `timeout_s`. Returns False (and logs an error naming the master) when
        it did not finish in time; the helper is a daemon and the client is abandoned."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return self._close_result if self._close_result is not None else True
            self._closed = True
            self.breaker.stop()  # no probe after this; the prober ends
            drained = self._idle.wait_for(lambda: self._calls_inside == 0, timeout_s * CLOSE_DRAIN_SHARE)
            inside = self._calls_inside
            if not drained:
                self.stats.add("store_close_leaked")
                self._close_result = False
        if not drained:
            logger.error("Mooncake client of master %s not closed: %d call(s) still inside it after %.1fs; "
                         "the client is leaked (closing it under a live call would crash the process)",
                         self.config.master_server_address, inside, timeout_s * CLOSE_DRAIN_SHARE)
            return False
        done = threading.Event()

        def _close() -> None:
            for ptr in list(self.registered):
                try:
                    self._raw.unregister_buffer(ptr)
                except Exception:
                    pass
            self.registered.clear()
            try:
                self._raw.close()
            except Exception as e:
                self.last_exception = e
            if self.offload_dir is not None:
                # Mooncake's close leaves a client with the disk tier running (its heartbeat writes on, its
                # segment stays mounted): only its destructor unmounts it, run here by the last reference's
                # drop, while the master still answers (every call after close is refused by `_enter`)
                self._raw = None
            done.set()

        t = threading.Thread(target=_close, name="kvledger-store-close", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if not done.is_set():
            logger.error("Mooncake client close against master %s did not finish in %.1fs; abandoned",
                         self.config.master_server_address, timeout_s)
            self._close_result = False
            return False
        self._close_result = True
        if self.offload_dir is not None:  # the client that wrote it is gone: its files are read by no one
            remove_offload_dir(self.offload_dir)
        return True

    # -- health ------------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Cheap: False while the breaker is open, or when Mooncake's heartbeat says so."""
        self._check_authentic()
        if self.breaker.open or not self._enter():
            return False
        try:
            return int(self._raw.health_check()) == 0
        except Exception as e:
            self.last_exception = e
            return False
        finally:
            self._leave()

    @property
    def stats(self) -> Counter:
        """The counter sink of this client and its breaker: breaker_trips, breaker_probes, master_unauthentic,
        store_close_leaked (the connector sets its StatsRecorder)."""
        return self._stats

    @stats.setter
    def stats(self, sink: Counter) -> None:
        self._stats = self.breaker.stats = sink

    def backoff_s(self, down_in_a_row: int) -> float:
        """The breaker's wait before its next probe (`Breaker.backoff_s`)."""
        return self.breaker.backoff_s(down_in_a_row)

    @property
    def breaker_open(self) -> bool:
        """True while calls are skipped (a master failure opened the breaker; no probe has closed it yet)."""
        return self.breaker.open

    @property
    def skip_remaining_s(self) -> float:
        """Seconds until the next probe is due (0 when the breaker is closed, or a probe is due now)."""
        return self.breaker.skip_remaining_s

    def trip(self) -> None:
        """Open the breaker as a master failure does (a caller's own deadline passed on a call still inside
        the client: `kvledger_connector.store.deadline`). A breaker already open stays as it is."""
        self.breaker.trip()

    def probe(self, *, force: bool = False) -> bool:
        """One probe of an open breaker (`Breaker.probe`): True when the breaker is closed after it."""
        return self.breaker.probe(force=force)

    def authentic(self) -> bool:
        """Whether the master this client talks to is the embedded one it joined (`MasterIdentity`)."""
        return self._master.authentic()

    def _ask_master(self) -> int:
        """The breaker's probe: never a call to a master this process cannot authenticate, nor a close on its
        answer (`authentic` before and after the call)."""
        if not self.authentic():
            return int(StoreCode.RPC_FAIL)
        res = self._invoke(self._raw.batch_is_exist, 1, [PROBE_KEY])[0]
        return int(StoreCode.RPC_FAIL) if res in (0, 1) and not self.authentic() else res

    def _check_authentic(self) -> None:
        """At most once per AUTH_CHECK_INTERVAL_S, on the calling thread: an embedded master that is not the
        authenticated one opens the breaker, as a master failure does."""
        if self.breaker.open or self._closed or not self._master.due() or self.authentic():
            return
        self.breaker.trip(on_open=self._unauthentic)

    def _unauthentic(self) -> None:
        self.stats.add("master_unauthentic")
        logger.warning("Mooncake master %s: the listener on its port is not the master this process joined "
                       "(gone, or another process's)", self.config.master_server_address)

    def _skip(self, n: int) -> list[int] | None:
        self._check_authentic()
        if self._closed:
            return [int(StoreCode.INVALID_PARAMS)] * n
        if self.breaker.open:
            return [int(StoreCode.UNHEALTHY_SKIPPED)] * n
        return None

    # -- batch calls -------------------------------------------------------------------------------

    def _key_code(self, key: object) -> int:
        """0 if `key` may be sent, else the local code for it."""
        if not isinstance(key, str) or not key:
            return int(StoreCode.INVALID_PARAMS)
        # ASCII keys (ours always are) are as long in bytes as in chars: skip the encode
        n = len(key) if key.isascii() else len(key.encode())
        return 0 if n <= self.max_key_bytes else int(StoreCode.KEY_TOO_LONG)

    @staticmethod
    def _buffer_ok(ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
        # a null or negative pointer would crash the process inside Mooncake; refuse it here
        # (a non-int that compares, e.g. a float, is rejected by pybind11 for the whole call -> CLIENT_EXCEPTION)
        try:
            return bool(ptrs) and min(ptrs) > 0 and min(sizes) > 0
        except TypeError:
            return False

    def _presend(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]] | None,
                 sizes: Sequence[Sequence[int]] | None) -> tuple[list[int], list[int]]:
        """(indices to send, per-key codes; 0 for the ones sent)."""
        codes = [self._key_code(k) for k in keys]
        if ptrs is not None and sizes is not None and not _all_positive(ptrs, sizes):
            for i, c in enumerate(codes):
                if c == 0 and not self._buffer_ok(ptrs[i], sizes[i]):
                    codes[i] = int(StoreCode.BAD_BUFFER)
        return [i for i, c in enumerate(codes) if c == 0], codes

    def _run(self, method: Callable[[Any], Any], keys: Sequence[str], *args: Sequence[Sequence[int]]) -> list[int]:
        """Check, skip or call ``method(raw client)``: one code per key, never an exception for a per-key
        problem. The raw client's method is looked up only once the call is sent (none is after close)."""
        n = len(keys)
        skipped = self._skip(n)
        if skipped is not None:
            return skipped
        send, codes = self._presend(keys, *(args or (None, None)))  # type: ignore[arg-type]
        fn = method(self._raw)
        if len(send) == n and len(set(keys)) == n:  # the common case: one call, no copying
            return self.breaker.note(self._invoke(fn, n, list(keys), *[list(a) for a in args]))
        for batch in _unique_rounds(keys, send):
            res = self._invoke(fn, len(batch), [keys[i] for i in batch], *[[a[i] for i in batch] for a in args])
            for i, r in zip(batch, res):
                codes[i] = r
        return self.breaker.note(codes)

    def _invoke(self, fn: Any, n: int, *args: list[Any]) -> list[int]:
        if not self._enter():  # closed since _skip: never call a closed client
            return [int(StoreCode.INVALID_PARAMS)] * n
        try:
            res = [int(r) for r in fn(*args)]
        except Exception as e:  # pybind11 type errors, anything else the client throws
            self.last_exception = e
            return [int(StoreCode.CLIENT_EXCEPTION)] * n
        finally:
            self._leave()
        if len(res) != n:  # never seen; do not trust a short answer
            return [int(StoreCode.CLIENT_EXCEPTION)] * n
        return res

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 exists, 0 missing, < 0 error (per key)."""
        return self._run(lambda raw: raw.batch_is_exist, keys)

    def batch_put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """Zero-copy put of each key's chunks; 0 stored or already present (first writer wins), < 0 error."""
        _check_lists(keys, ptrs, sizes)
        return self._run(lambda raw: raw.batch_put_from_multi_buffers, keys, ptrs, sizes)

    def batch_get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[int]:
        """Zero-copy get into each key's chunks; bytes read (== object size) or < 0 error."""
        _check_lists(keys, ptrs, sizes)
        return self._run(lambda raw: raw.batch_get_into_multi_buffers, keys, ptrs, sizes)

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 leased (use force). Used by fault injection and tests."""
        skipped = self._skip(1)
        if skipped is not None:
            return skipped[0]
        code = self._key_code(key)
        if code:
            return code
        return self._single_call(self._raw.remove, key, force)

    @property
    def removes_by_regex(self) -> bool:
        """Mooncake's master removes by pattern."""
        return True

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        """Keys removed (>= 0) or < 0 error (-600 for a regex the master cannot parse). The master *searches*
        each key (ECMAScript syntax): anchor the pattern. Used by `reset_cache`
        (kvledger_connector/scheduler/reset.py)."""
        skipped = self._skip(1)
        if skipped is not None:
            return skipped[0]
        if not isinstance(regex, str) or not regex:
            return int(StoreCode.INVALID_PARAMS)
        return self._single_call(self._raw.remove_by_regex, regex, force)

    def _single_call(self, fn: Any, *args: Any) -> int:
        """One counted client call returning one code (refused once closing; an exception is CLIENT_EXCEPTION)."""
        if not self._enter():
            return int(StoreCode.INVALID_PARAMS)
        try:
            return self.breaker.note([int(fn(*args))])[0]
        except Exception as e:
            self.last_exception = e
            return int(StoreCode.CLIENT_EXCEPTION)
        finally:
            self._leave()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
