"""Probes of the connector's edges that only integration tests reached before: the integrity
secret's privacy, the embedded default's generated secret and mode, a seal's comparison of tags, the
owner of a replicated KV head under the TP-shared layout, the store breaker's probe backoff, the lookup
deadline behind an abandoned call, a slow lookup's wait for the next step, the rendezvous metadata URL, the embedded master's supervision, and
the reset: the weights-version switch first, the removal after it off the engine thread (bounded retries),
lookups missing while a removal of the keys they read is owed. Each calls the shipped function through the module (or class) the
connector looks it up in, so a patched function (a mutant) is the one probed, and raises
:class:`ProbeFailed` naming what it saw. Every probe runs in milliseconds (the VllmConfig of the head-shard
probe is built once per process, ~2 s); waits are short real timeouts (tens of ms) or controllable clocks.

`PROBES` runs in the mutant table (conformance/mutants.py) and, unmutated, in tests/unit/test_probes_edge.py;
`MUTANTS` are the seeded bugs of these rules and `SHOWS` the direct observation that each changes what its
name says (tests/unit/test_mutant_shows.py runs each both ways).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import kvledger_connector.connector as connector_mod
import kvledger_connector.shape.engine_facts as engine_facts
import kvledger_connector.shape.integrity as integrity
import kvledger_connector.scheduler.reset as reset_mod
from conformance.kvprobes import ProbeFailed, check, quiet
from conformance.probes_parts import runtime_dir_env
from conformance.probes_sched import BS, Req, sched
from kvledger.errors import LedgerInputError
from kvledger_connector.store import embedded, listeners
from kvledger_connector.store import rendezvous
from kvledger_connector.config import StoreConfig
from kvledger_connector.store.deadline import DeadlineStore
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from kvledger_connector.scheduler.steps import SchedulerSteps
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.breaker import Breaker
from kvledger_connector.store.client import MooncakeStore
from kvledger_connector.scheduler.side import ask_store
from testbed.store_double import StoreDouble

SECRET = b"probe-secret-of-32-bytes-exactly"


# ---------------------------------------------------------------- 1. the integrity secret is private
def _secret_file(tmp: str, name: str, mode: int) -> str:
    path = os.path.join(tmp, name)
    Path(path).write_bytes(SECRET)
    os.chmod(path, mode)
    return path


def probe_integrity_secret_must_be_private() -> None:
    """The `mac` secret is read only from this user's regular file that no one else may read: a file of mode
    0600 is read (through IntegrityKey.of, as the connector reads it); one readable by its group (0640) or by
    others (0644), a symlink (even to a private secret) and another user's file are refused, naming
    integrity_secret_file."""
    with tempfile.TemporaryDirectory() as tmp:
        good = _secret_file(tmp, "good", 0o600)
        key = integrity.IntegrityKey.of("mac", good)
        check(key.secret == SECRET, "a private secret file (0600) was not read as written")
        cases = [("readable by its group (0640)", _secret_file(tmp, "group", 0o640)),
                 ("readable by others (0644)", _secret_file(tmp, "others", 0o644))]
        link = os.path.join(tmp, "link")
        os.symlink(good, link)
        cases.append(("a symlink to a private secret", link))
        if os.geteuid() == 0:  # as root: a private file given to nobody; otherwise no such file can be made
            foreign = _secret_file(tmp, "foreign", 0o600)
            os.chown(foreign, 65534, 65534)
            cases.append(("another user's file", foreign))
        for what, path in cases:
            try:
                integrity.read_secret(path)
            except LedgerInputError as e:
                check(e.field == "integrity_secret_file", f"the refusal of {what} names {e.field!r}: {e}")
                continue
            raise ProbeFailed(f"an integrity secret file {what} was accepted ({path})")


def _private_checks_others_only(orig):  # the private check looks at the "others" bits only: 0640 accepted
    def read_own_file(field_, path, *, max_bytes, private):
        if private:
            try:
                mode = stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)
            except OSError:
                mode = 0
            if mode & 0o007:
                raise LedgerInputError(field_, path, f"has mode {mode:04o}: others may read it; chmod 600")
        return orig(field_, path, max_bytes=max_bytes, private=False)
    return read_own_file


def probe_embedded_default_runs_mac_under_one_private_generated_secret() -> None:
    """Where the connector starts the store, an unset `integrity` is 'mac' under the engine's generated
    secret (IntegrityKey.resolve, as the connector calls it); beside a configured master, 'checksum'. The
    secret (rendezvous.engine_secret) is generated once and read by every later call of the engine, 32
    bytes of mode 0600; a group-readable secret file, or a runtime directory others may enter, is refused
    by name."""
    made = b"g" * 32
    key = integrity.IntegrityKey.resolve(None, None, embedded=True, generated=lambda: made, device="cpu")
    check((key.mode, key.secret) == ("mac", made), f"the embedded default resolved to {key.mode!r}, not 'mac' "
                                                   f"under the generated secret")
    key = integrity.IntegrityKey.resolve(None, None, embedded=False, generated=lambda: made, device="cpu")
    check(key.mode == "checksum", f"beside a configured master and no secret file: {key.mode!r}, not 'checksum'")
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        os.mkdir(run, 0o700)
        with runtime_dir_env(run):
            first = rendezvous.engine_secret("probe")
            check(len(first) == rendezvous.SECRET_BYTES and rendezvous.engine_secret("probe") == first,
                  "a second process of the engine read another secret than the first one generated")
            path = rendezvous.secret_path("probe")
            mode = stat.S_IMODE(os.stat(path).st_mode)
            check(mode == 0o600, f"the generated secret has mode {mode:04o}, not 0600")
            for what, fix, undo, field_ in (
                    ("a group-readable secret (0640)", lambda: os.chmod(path, 0o640), lambda: os.chmod(path, 0o600),
                     "engine_secret"),
                    ("a runtime dir others may enter (0711)", lambda: os.chmod(run, 0o711),
                     lambda: os.chmod(run, 0o700), rendezvous.RUNTIME_DIR_ENV)):
                fix()
                try:
                    rendezvous.engine_secret("probe")
                except LedgerInputError as e:
                    check(e.field == field_, f"the refusal of {what} names {e.field!r}: {e}")
                else:
                    raise ProbeFailed(f"{what} was accepted as holding the engine's secret")
                finally:
                    undo()


def probe_a_seal_verifies_every_tag_it_is_asked_for() -> None:
    """BlockSeal.verify compares each block's tag: a block changed after its seal, or a trailer read under
    another key, is False (what the worker's load path turns into a load error)."""
    from conformance.probes_parts import integrity_case

    _w, seal, _kv = integrity_case()
    got = seal.verify(0, ["k1", "k2"], [1, 2])
    check(got == [True, False], f"block 2 changed after its tag: verify said {got}, not [True, False]")
    got = seal.verify(0, ["k2", "k1"], [1, 2])
    check(got == [False, False], f"trailers read under each other's key: verify said {got}")
    seal.seal(0, ["k1", "k2"], [1, 1])  # block 1's bytes sealed under two keys, in rows 0 and 1
    got = seal.verify(0, ["k2"], [1], rows=[1])  # the get's second key alone (its first missed)
    check(got == [True], f"k2 checked against its own trailer row 1: verify said {got}, not [True]")


def _embedded_default_checksum(orig):  # the embedded default keeps the unkeyed tag a local client can forge
    def integrity_mode(mode, secret_file, *, embedded):
        return "checksum" if mode is None and secret_file is None else orig(mode, secret_file, embedded=embedded)
    return integrity_mode


def _secret_per_process(orig):  # each process of the engine generates its own: their tags never verify
    def engine_secret(engine_id, **kw):
        try:
            os.remove(rendezvous.secret_path(engine_id))
        except OSError:
            pass
        return orig(engine_id, **kw)
    return engine_secret


def _dir_privacy_unchecked(orig):  # a runtime dir others may enter is taken to hold the secret
    def private_dir(d):
        return d
    return private_dir


def _verify_skipped(orig):  # the tags are never compared: every block read is taken as verified
    def verify(self, slot, keys, block_ids, parts=None, rows=None):
        return [True] * len(keys)
    return verify


def _verify_rows_by_place(orig):  # each key checked against the trailer row of its place among those asked
    def verify(self, slot, keys, block_ids, parts=None, rows=None):
        return orig(self, slot, keys, block_ids, parts)
    return verify


# ---------------------------------------------------------------- 2. the owner of a replicated KV head
@functools.lru_cache(maxsize=None)
def tp_config(tp: int, kv_heads: int) -> Any:
    """vLLM's own VllmConfig of a tiny model with ``kv_heads`` KV heads served at TP ``tp`` (built once per
    process: ~2 s the first time)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    from testbed.emu_model import write_model_dir
    with tempfile.TemporaryDirectory() as d:
        path = write_model_dir(d, num_layers=1, num_kv_heads=kv_heads, head_size=8, num_attention_heads=2 * tp)
        mc = ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, dtype="float32", seed=0,
                         max_model_len=256)
        return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                          device_config=DeviceConfig("cpu"))


def probe_replicated_kv_head_owner() -> None:
    """With more TP ranks than KV heads, vLLM replicates each head over ``tp / heads`` consecutive ranks
    (QKVParallelLinear: rank r holds head ``r // replicas``): at TP 4 over 2 heads ranks 0, 1 hold head 0
    and ranks 2, 3 head 1; `kv_head_shard` names that head for each rank (the TP-shared layout's key), and
    `kv_replicas` counts 2 ranks per head."""
    vc = tp_config(4, 2)
    mc, pc = vc.model_config, vc.parallel_config
    total, per_rank = mc.get_total_num_kv_heads(), mc.get_num_kv_heads(pc)
    check((total, per_rank) == (2, 1), f"the probe's model has {total} KV heads, {per_rank} per rank, not 2 and 1")
    replicas = engine_facts.kv_replicas(vc)
    check(replicas == 2, f"kv_replicas at TP 4 over 2 KV heads is {replicas}, not 2")
    got = [engine_facts.kv_head_shard(vc, per_rank, r, 1) for r in range(4)]
    want = [(total, r // (4 // total)) for r in range(4)]
    check(got == want, f"kv_head_shard at TP 4 over 2 KV heads gives (heads, first head) {got} for ranks 0..3; "
                       f"vLLM gives rank r head r // 2: {want}")


def _head_owner_modulo(orig):  # rank r's replicated head taken as r % heads (round robin), not r // replicas
    def kv_head_shard(vllm_config, heads_per_rank, tp_rank, kv_heads_per_key):
        total, first = orig(vllm_config, heads_per_rank, tp_rank, kv_heads_per_key)
        if vllm_config.parallel_config.tensor_parallel_size > total:
            first = tp_rank % total
        return total, first
    return kv_head_shard


# ---------------------------------------------------------------- 3. the store breaker's probe backoff
class _DownClient:
    """THIS IS A TEST DOUBLE: a raw Mooncake client whose master is down (every batch_is_exist answers
    RPC_FAIL) until ``up`` is set."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        return [0 if self.up else int(StoreCode.RPC_FAIL)] * len(keys)


class _Clock:
    """A controllable monotonic clock (seconds): the breaker reads only the clock it was given."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def probe_breaker_backoff_doubles_to_its_cap() -> None:
    """The first master failure opens the breaker for `unhealthy_backoff_ms`; each failed probe doubles the
    wait up to `max_unhealthy_backoff_ms`; no probe is sent before the wait is over; the first answered probe
    closes it, and the next failure starts from the base wait again. Driven by the store's own ``clock``
    parameter (no thread, no sleep)."""
    cfg = StoreConfig(master_server_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata",
                      local_hostname="127.0.0.1", unhealthy_backoff_ms=100, max_unhealthy_backoff_ms=700)
    raw, clock = _DownClient(), _Clock()
    st = MooncakeStore(raw, cfg, clock=clock, background_probe=False)
    res = st.batch_is_exist(["k"])
    check(st.breaker_open, f"a batch_is_exist answered {res} (master down) did not open the breaker")
    waits = [round(st.skip_remaining_s, 6)]
    for _ in range(5):
        left = st.skip_remaining_s
        clock.t += left * 0.9
        sent = raw.calls
        check(not st.probe() and raw.calls == sent, "a probe was sent before its wait was over")
        clock.t += left * 0.1 + 1e-6  # just past the wait (no exact float sum needed)
        check(not st.probe() and raw.calls == sent + 1, "no probe was sent once its wait was over")
        waits.append(round(st.skip_remaining_s, 6))
    check(waits == [0.1, 0.2, 0.4, 0.7, 0.7, 0.7], f"the breaker's waits after 1..6 failures in a row are {waits} s; "
                                                 "base 0.1 doubled per failed probe, at most 0.7, is "
                                                 "[0.1, 0.2, 0.4, 0.7, 0.7, 0.7]")
    raw.up = True
    clock.t += st.skip_remaining_s + 1e-6
    check(st.probe() and not st.breaker_open, "a probe the master answered did not close the breaker")
    raw.up = False
    st.batch_is_exist(["k"])
    check(st.breaker_open and round(st.skip_remaining_s, 6) == 0.1,
          f"a failure after the breaker closed waits {st.skip_remaining_s} s, not the base 0.1 s")


def _backoff_never_doubles(orig):  # every wait is the first one: a failed probe does not double it
    def backoff_s(self, down_in_a_row):
        return orig(self, 1)
    return backoff_s


# ---------------------------------------------------------------- 4. the lookup deadline behind an abandoned call
DEADLINE_S = 0.05


class _StuckStore(StoreDouble):
    """THIS IS A TEST DOUBLE: a store whose batch_is_exist blocks until ``release`` is set (a master that
    stopped answering), then answers every key present."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        self.release.wait(5.0)  # bounded: the probe releases it; 5 s only if the probe itself is killed
        return [1] * len(keys)


def probe_lookup_deadline_behind_an_abandoned_call() -> None:
    """A lookup the store does not answer within the deadline is answered as a miss (negative codes) at the
    deadline; a lookup made while that abandoned call is still inside the store is bounded too: answered as a
    miss within the deadline, never queued behind the stuck call (and never sent into the store: at most one
    call is inside it through the DeadlineStore)."""
    inner = _StuckStore()
    ds = DeadlineStore(inner, DEADLINE_S)
    second: queue.SimpleQueue[tuple[float, list[int]]] = queue.SimpleQueue()

    def lookup() -> None:
        t = time.monotonic()
        r = ds.batch_is_exist(["b", "c"])
        second.put((time.monotonic() - t, r))

    th = threading.Thread(target=lookup, name="probe-second-lookup", daemon=True)
    try:
        t0 = time.monotonic()
        first = ds.batch_is_exist(["a"])
        took = time.monotonic() - t0
        check(len(first) == 1 and first[0] < 0, f"a lookup the store never answered returned {first}, not a miss")
        check(took < DEADLINE_S + 0.5, f"a lookup past its {DEADLINE_S * 1e3:.0f} ms deadline took {took:.2f} s")
        th.start()
        th.join(DEADLINE_S + 0.5)
        check(not th.is_alive(), f"a lookup made while an abandoned call is still inside the store waited "
                                 f"{DEADLINE_S + 0.5:.2f} s and more (queued behind the stuck call)")
        took2, res = second.get_nowait()
        check(len(res) == 2 and all(c < 0 for c in res), f"the lookup behind the abandoned call answered {res}, "
                                                         "not a miss")
        check(took2 < DEADLINE_S + 0.5, f"the lookup behind the abandoned call took {took2:.2f} s")
        check(inner.calls == 1, f"{inner.calls} calls went into the stuck store, not only the abandoned one")
    finally:
        inner.release.set()  # no thread outlives the probe
        if th.ident is not None:
            th.join(2.0)
        ds.stop()
        helper = object.__getattribute__(ds, "_kvl_thread")
        if helper is not None:
            helper.join(2.0)


def probe_a_slow_lookup_waits_for_the_next_step() -> None:
    """A prefix lookup the store has not answered within the step's wait answers "not known yet" (None: vLLM
    asks again next step) well before the deadline, and asked again with the same keys, gets the store's
    answer of the same call (one call sent), not a miss."""
    inner = _StuckStore()
    ds = DeadlineStore(inner, 2.0, wait_s=0.01)
    try:
        t0 = time.monotonic()
        first = ds.ask_exist(["a"])
        took = time.monotonic() - t0
        check(first is None, f"a lookup the store had not answered within the step's wait answered {first}, "
                             "not None (asked again next step)")
        check(took < 1.0, f"a lookup held its step {took:.2f} s, past the step's 10 ms wait")
        inner.release.set()
        end = time.monotonic() + 5.0
        got = None
        while got is None and time.monotonic() < end:
            got = ds.ask_exist(["a"])
        check(got == [1], f"asked again once the store answered, the lookup got {got}, not the hit")
        check(inner.calls == 1, f"{inner.calls} calls went into the store for one lookup")
    finally:
        inner.release.set()
        ds.stop()


def _lookup_holds_the_step(orig):  # a lookup waits for its answer up to the deadline, inside the step
    def ask_exist(self, keys):
        return self.batch_is_exist(keys)
    return ask_exist


def _waits_behind_abandoned_call(orig):  # a lookup waits for the abandoned call to leave the store first
    def check_exist(self, keys):
        busy = object.__getattribute__(self, "_kvl_busy")
        with busy:
            pass
        return orig(self, keys)
    return check_exist


# ---------------------------------------------------------------- 5. the rendezvous metadata URL
def probe_attached_process_uses_the_published_metadata_url() -> None:
    """The owner of an engine's embedded servers publishes them as they listen (the master at
    127.0.0.1:<rpc port>, the metadata server at http://127.0.0.1:<metadata port>/metadata), and another
    process of the engine attaches to exactly those: its client config names the same two URLs."""
    with tempfile.TemporaryDirectory() as tmp, runtime_dir_env(tmp), \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as master, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as meta:
        for s in (master, meta):  # listeners standing in for the servers (the attach checks the master's)
            s.bind((embedded.LOOPBACK, 0))
            s.listen(4)
        emb = embedded.EmbeddedMooncake(start=False, log_dir=tmp)  # no process started: its addresses only
        owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            emb.rpc_port, emb.metadata_port = master.getsockname()[1], meta.getsockname()[1]
            emb.master_inode = os.fstat(master.fileno()).st_ino  # what a started master records of its listener
            want = (f"127.0.0.1:{emb.rpc_port}", f"http://127.0.0.1:{emb.metadata_port}/metadata")
            got = rendezvous.acquire("probe-rdv", lambda: emb)
            check(got is emb, f"the first process did not start the servers: {got!r}")
            path = rendezvous.rendezvous_path("probe-rdv")
            info = json.loads(Path(path).read_text())
            published = (info.get("master_address"), info.get("metadata_server"))
            check(published == want, f"the rendezvous file publishes {published}; the servers listen at {want}")
            # the file as another live process of the engine (a child standing in for it) would have published it
            Path(path).write_text(json.dumps({**info, **rendezvous.owner_fields(owner.pid)}))

            def start() -> Any:
                raise ProbeFailed("a process of the engine started its own servers beside a live owner's")
            att = rendezvous.acquire("probe-rdv", start)
            check(isinstance(att, rendezvous.AttachedMooncake), f"the second process got {att!r}, not an attach")
            cfg = StoreConfig(local_hostname="127.0.0.1").with_addresses(att.master_address, att.metadata_server)
            used = (cfg.master_server_address, cfg.metadata_server)
            check(used == want, f"the attached process's client uses {used}; the owner published {want}")
        finally:
            emb.stop()
            owner.communicate(timeout=5.0)  # its stdin closed: it exits


def _metadata_url_on_master_port(orig):  # the published metadata URL built with the master's port
    return property(lambda self: f"http://{embedded.LOOPBACK}:{self.rpc_port}/metadata")


def _attach_metadata_from_master_port(orig):  # the attacher rebuilds the metadata URL from the master's port
    def parse_info(blob):
        info = orig(blob)
        if info is not None:
            info = {**info, "metadata_server": f"http://{embedded.LOOPBACK}:{info['master_port']}/metadata"}
        return info
    return parse_info


# ---------------------------------------------------------------- 6. the embedded master's supervision
class _FakePopen:
    """THIS IS A TEST DOUBLE: a master process that runs until ``exit(rc)`` (no process exists; the probe
    never lets `EmbeddedMooncake` signal it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def exit(self, rc: int) -> None:
        self.returncode = rc
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._exited.wait(timeout)
        return self.returncode if self.returncode is not None else 0


class _Wake:
    """A controllable stand-in for the supervisor's wake event: ``wait(t)`` records the backoff asked for and
    returns at once (as if ``t`` seconds passed), True once set (stop())."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._set = False

    def set(self) -> None:
        self._set = True

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None and timeout >= 0.5:  # the restart backoff; 0.05 s polls of the port are not
            self.waits.append(timeout)
        return self._set


def probe_supervisor_restarts_a_dead_master() -> None:
    """Supervised, the embedded master that exits is started again (on its ports), and again after each
    later exit; a start that fails is retried after 1 s doubling up to `MAX_RESTART_BACKOFF_S`, and the wait
    is back to 1 s after a successful restart. Runs the shipped supervisor loop on a test double of the
    master process and of its start (no mooncake_master is spawned) with a controllable backoff wait."""
    emb = embedded.EmbeddedMooncake(start=False, supervise=True)
    emb.rpc_port = listeners.free_port()  # nothing listens there: the old master's port is free at once
    wake = _Wake()
    emb._wake = wake  # type: ignore[assignment]
    fails: list[int] = [0]  # starts still to fail
    starts: queue.SimpleQueue[_FakePopen] = queue.SimpleQueue()
    procs: list[_FakePopen] = []

    def start_master() -> None:  # the double of spawning mooncake_master: a fake process, or a failed start
        if fails[0] > 0:
            fails[0] -= 1
            raise embedded.EmbeddedStartError("probe: the master did not start")
        p = _FakePopen(4_000_000 + len(procs))
        procs.append(p)
        emb._master = embedded._Proc("master", ["mooncake_master"], os.devnull, p)  # type: ignore[arg-type]
        starts.put(p)

    emb.start_master = start_master  # type: ignore[method-assign]
    start_master()
    starts.get_nowait()
    sup = threading.Thread(target=emb._supervise, name="probe-supervisor", daemon=True)
    sup.start()
    try:
        procs[-1].exit(-9)  # the master is killed
        check(emb.wait_restarts(1, 1.0), "the supervisor did not restart the master after it was killed")
        fails[0] = 6
        procs[-1].exit(1)  # it dies again; the next six starts fail
        check(emb.wait_restarts(2, 1.0), "the supervisor did not restart the master after its second exit "
                                         f"(starts failing six times; backoffs asked: {wake.waits})")
        cap = embedded.MAX_RESTART_BACKOFF_S
        want = [min(2.0 ** i, cap) for i in range(6)]
        check(wake.waits == want, f"failed restarts were retried after {wake.waits} s, not {want}")
        fails[0] = 1
        procs[-1].exit(1)
        check(emb.wait_restarts(3, 1.0), "the supervisor did not restart the master after a third exit")
        check(wake.waits[6:] == [1.0], f"after a successful restart the backoff is {wake.waits[6:]}, not [1.0]")
    finally:
        emb._master = None  # the doubles are not processes: nothing for stop() to signal
        emb.stop()
        for p in procs:
            p.exit(0)
        sup.join(2.0)


def _supervisor_only_reports(orig):  # the supervisor logs the master's exit and gives up: no restart
    def _supervise(self):
        proc = self._master
        if proc is not None and proc.popen is not None:
            rc = proc.popen.wait()
            if not self._stopped:
                embedded.logger.warning("embedded mooncake_master exited with %s", rc)
    return _supervise


# ---------------------------------------------------------------- 7. the weights-version switch at reset
class _RemovingStore(StoreDouble):
    """THIS IS A TEST DOUBLE: the store's existence checks over a set of keys, and a `remove_by_regex` that
    answers ``rc`` (removing nothing: what it removes is the reset pattern's probe's business)."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.rc = 0
        self.removals: list[str] = []

    removes_by_regex = True

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.keys else 0 for k in keys]

    def remove_by_regex(self, regex: str, force: bool = False) -> int:
        self.removals.append(regex)
        return self.rc


class _Waits:
    """THIS IS A TEST DOUBLE: `StoreRemovals.wait` that records each backoff and returns at once (not stopped)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return False


def _reset_log_quiet() -> Any:
    """The removals' warnings silenced: the failures are the probes' own doing."""
    return quiet(reset_mod.__name__)


def _reset_rig(store: _RemovingStore) -> tuple[SchedulerSteps, reset_mod.StoreRemovals, _Waits, DeadlineStore]:
    """A scheduler side whose lookups go to `store` as the connector wires them, and its removals without a
    thread (the probe runs them)."""
    waits = _Waits()
    removals = reset_mod.StoreRemovals(store, background=False, wait=waits)
    side = sched().steps
    bounded = DeadlineStore(store, DEADLINE_S)
    bounded.stop()  # calls go direct (no helper thread)
    return side, removals, waits, bounded


def _rekey(layouts: list[KeyLayout]) -> Callable[[str, str], list[KeyBuilder]]:
    """The connector's `rekey` over `layouts`: the shipped key identity under a version and reset epoch."""
    def rekey(version: str, epoch: str) -> list[KeyBuilder]:
        h = engine_facts.key_identity("probe-model-config", "sha256", version, epoch)
        return [KeyBuilder(dataclasses.replace(lay, model_hash=h)) for lay in layouts]
    return rekey


def probe_reset_switches_the_weights_version() -> None:
    """reset_cache with a new weights version (as the connector calls `reset_scheduler_side`), the store
    failing every removal: the reset returns True having switched the weights version and key builders
    together (no reset epoch: engines switching to one version share its keys) before any removal was tried
    (nothing in flight reads the old keys, so their removal is best-effort), every later lookup asks the new
    version's keys (a block stored under them hits, one under the old version's misses), and the old keys'
    removal is then tried REMOVAL_ATTEMPTS times with waits doubling to their cap, given up and counted, the
    version staying switched."""
    side0 = sched().steps
    rekey = _rekey([kb.layout for kb in side0.key_builders])
    new_kbs, old_kbs = rekey("v2", ""), [KeyBuilder(kb.layout) for kb in side0.key_builders]
    a, b = Req("a", 2 * BS + 1), Req("b", 2 * BS + 1)
    store = _RemovingStore({k for kb in new_kbs for k in kb.keys(a.block_hashes)}
                           | {k for kb in old_kbs for k in kb.keys(b.block_hashes)})
    store.rc = int(StoreCode.RPC_FAIL)
    side, removals, waits, bounded = _reset_rig(store)
    old_regex = reset_mod.engine_key_regex(side.key_builders)
    with _reset_log_quiet():
        ok = connector_mod.reset_scheduler_side(side, removals, rekey, "v2")
    check(ok is True, f"a reset with a new weights version returned {ok} (the store fails every removal)")
    check((side.weights_version, side.reset_epoch) == ("v2", ""),
          f"after the reset the keys are under ({side.weights_version!r}, {side.reset_epoch!r}), not ('v2', '') "
          f"(store calls so far: {store.removals})")
    check([kb.prefix for kb in side.key_builders] == [kb.prefix for kb in new_kbs],
          f"after the switch to 'v2' keys are built under {[kb.prefix for kb in side.key_builders]}, not the "
          f"new version's {[kb.prefix for kb in new_kbs]}")
    check(store.removals == [], f"the reset called the store on the engine thread: {store.removals}")
    for req in (a, b):
        side.on_new_request(req)
    hit_a, hit_b = ask_store(side, bounded, a, 0), ask_store(side, bounded, b, 0)
    check(hit_a == 2 * BS, f"a prompt stored under the new version's keys hits {hit_a} tokens, not {2 * BS}")
    check(hit_b == 0, f"a prompt stored only under the old version's keys hits {hit_b} tokens after the switch")
    with _reset_log_quiet():
        removals.run_pending()
    n = reset_mod.REMOVAL_ATTEMPTS
    want = [reset_mod.removal_backoff_s(i) for i in range(1, n)]
    check(store.removals == [old_regex] * n, f"the old keys' removal was tried {len(store.removals)} times "
                                             f"({store.removals[:2]}...), not {n} times {old_regex!r}")
    check(waits.waits == want, f"failed removals were retried after {waits.waits} s, not {want}")
    given_up = removals.counts.total("reset_removals_given_up")
    check(given_up == 1 and side.weights_version == "v2",
          f"after {n} failed tries: {given_up} removals given up, weights version "
          f"{side.weights_version!r}")


def probe_a_reset_keeping_the_version_moves_the_keys_to_a_fresh_epoch() -> None:
    """A reset that keeps the weights version moves the keys under a fresh reset epoch at once: the stored
    prompt misses right after it though its old keys are still there (removal not run, then failing), and
    still misses after another client puts the pre-reset objects back under their old keys (a replay: first
    writer wins in the store); what is stored under the new epoch's keys hits; each reset draws a new epoch;
    a later reset with a new version drops the epoch."""
    a = Req("a", 2 * BS + 1)
    side0 = sched().steps
    rekey = _rekey([kb.layout for kb in side0.key_builders])
    before = rekey("", "")
    store = _RemovingStore({k for kb in before for k in kb.keys(a.block_hashes)})
    side, removals, _, bounded = _reset_rig(store)
    side.switch_keys("", "", before)
    side.on_new_request(a)
    check(ask_store(side, bounded, a, 0) == 2 * BS, "before the reset the stored prompt does not hit")
    store.rc = int(StoreCode.RPC_FAIL)
    epochs = []
    for _ in range(2):
        with _reset_log_quiet():
            ok = connector_mod.reset_scheduler_side(side, removals, rekey)
        check(ok is True, f"a reset keeping the version returned {ok}")
        epochs.append(side.reset_epoch)
        hit = ask_store(side, bounded, a, 0)
        check(hit == 0, f"after a reset keeping the version (epoch {side.reset_epoch!r}), its removal not run, "
                        f"the pre-reset prompt hits {hit} tokens")
    with _reset_log_quiet():
        removals.run_pending()
    store.keys |= {k for kb in before for k in kb.keys(a.block_hashes)}  # the replay
    side.forget_store_knowledge()  # each check below asks the store, not a cached answer
    hit = ask_store(side, bounded, a, 0)
    check(hit == 0, f"pre-reset objects put back under their keys after the removal hit {hit} tokens")
    check(side.weights_version == "" and len(set(epochs)) == 2 and "" not in epochs,
          f"two resets keeping the version drew reset epochs {epochs} (weights version {side.weights_version!r})")
    store.keys |= {k for kb in side.key_builders for k in kb.keys(a.block_hashes)}
    side.forget_store_knowledge()
    hit = ask_store(side, bounded, a, 0)
    check(hit == 2 * BS, f"a prompt stored under the new epoch's keys hits {hit} tokens, not {2 * BS}")
    with _reset_log_quiet():
        connector_mod.reset_scheduler_side(side, removals, rekey, "v2")
    check((side.weights_version, side.reset_epoch) == ("v2", ""),
          f"a reset to version 'v2' left the keys under ({side.weights_version!r}, {side.reset_epoch!r})")


def _switch_skipped_at_reset(orig):  # the reset removes the old keys but never moves to the new version
    def reset_scheduler_side(side, removals, rekey, new_version=None):
        return orig(side, removals, lambda v, e: list(side.key_builders), new_version)
    return reset_scheduler_side


def _switch_after_removal(orig):  # the old order: remove on the engine thread, switch only once that succeeded
    def reset_scheduler_side(side, removals, rekey, new_version=None):
        if reset_mod.refusal(side) is None:
            if int(removals.store.remove_by_regex(reset_mod.engine_key_regex(side.key_builders), True)) < 0:
                return False
        return orig(side, removals, rekey, new_version)
    return reset_scheduler_side


def _epoch_kept(orig):  # a reset keeping the version leaves the keys where they are (only removes them)
    def keys_after_reset(weights_version, new_version):
        version, _ = orig(weights_version, new_version)
        return version, ""
    return keys_after_reset


def _epoch_not_hashed(orig):  # the reset epoch never reaches the key
    def key_identity(config_hash, hash_algo, weights_version, reset_epoch=""):
        return orig(config_hash, hash_algo, weights_version)
    return key_identity


def _removal_never_retried(orig):  # one failed try gives the removal up
    def _remove(self, regex):
        wait, self.wait = self.wait, lambda s: True  # the first backoff wait ends it
        try:
            return orig(self, regex)
        finally:
            self.wait = wait
    return _remove


def _switch_keeps_old_key_builders(orig):  # the version is recorded, the key builders stay the old ones
    def switch_keys(self, weights_version, reset_epoch, key_builders):
        kbs = list(self.key_builders)
        orig(self, weights_version, reset_epoch, key_builders)
        self.key_builders = kbs
        if self.events is not None:
            self.events.key_builders = list(kbs)
    return switch_keys


PROBES: list[Callable[[], None]] = [
    probe_integrity_secret_must_be_private, probe_replicated_kv_head_owner,
    probe_embedded_default_runs_mac_under_one_private_generated_secret,
    probe_a_seal_verifies_every_tag_it_is_asked_for,
    probe_breaker_backoff_doubles_to_its_cap, probe_lookup_deadline_behind_an_abandoned_call,
    probe_a_slow_lookup_waits_for_the_next_step,
    probe_attached_process_uses_the_published_metadata_url, probe_supervisor_restarts_a_dead_master,
    probe_reset_switches_the_weights_version, probe_a_reset_keeping_the_version_moves_the_keys_to_a_fresh_epoch,
]

Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    # read_secret looks read_own_file up in its own module (imported by name from ownfile)
    "integrity_secret_group_readable": [(integrity, "read_own_file", _private_checks_others_only)],
    # the embedded default's generated secret (rendezvous looks read_own_file up in its own module too), its
    # mode (integrity looks integrity_mode up in its own module), and the comparison of tags
    "engine_secret_group_readable": [(rendezvous, "read_own_file", _private_checks_others_only)],
    "engine_secret_dir_others_may_enter": [(rendezvous, "private_dir", _dir_privacy_unchecked)],
    "engine_secret_per_process": [(rendezvous, "engine_secret", _secret_per_process)],
    "embedded_default_checksum": [(integrity, "integrity_mode", _embedded_default_checksum)],
    "integrity_verify_skipped": [(integrity.BlockSeal, "verify", _verify_skipped)],
    "integrity_rows_by_place": [(integrity.BlockSeal, "verify", _verify_rows_by_place)],
    "tp_shared_head_owner_modulo": [(engine_facts, "kv_head_shard", _head_owner_modulo)],
    "breaker_backoff_never_doubles": [(Breaker, "backoff_s", _backoff_never_doubles)],
    "lookup_waits_behind_abandoned_call": [(DeadlineStore, "check_exist", _waits_behind_abandoned_call)],
    "lookup_holds_the_step": [(DeadlineStore, "ask_exist", _lookup_holds_the_step)],
    "rendezvous_metadata_url_master_port": [(embedded.EmbeddedMooncake, "metadata_server",
                                             _metadata_url_on_master_port)],
    "rendezvous_attach_metadata_from_master_port": [(rendezvous, "parse_info", _attach_metadata_from_master_port)],
    "embedded_master_not_restarted": [(embedded.EmbeddedMooncake, "_supervise", _supervisor_only_reports)],
    # the connector calls reset_scheduler_side through its own binding (imported by name from reset)
    "reset_weights_switch_skipped": [(connector_mod, "reset_scheduler_side", _switch_skipped_at_reset)],
    "weights_switch_keeps_old_keys": [(SchedulerSteps, "switch_keys", _switch_keeps_old_key_builders)],
    # the reset's order (switch first, remove after, off the engine thread), its epoch and its retries
    "reset_switch_after_removal": [(connector_mod, "reset_scheduler_side", _switch_after_removal)],
    # reset.py looks keys_after_reset up in its own module; EngineFacts and the probe key_identity in engine_facts
    "reset_epoch_kept": [(reset_mod, "keys_after_reset", _epoch_kept)],
    "reset_epoch_not_in_key": [(engine_facts, "key_identity", _epoch_not_hashed)],
    "reset_removal_never_retried": [(reset_mod.StoreRemovals, "_remove", _removal_never_retried)],
}

#: the shows-probe of each mutant: the probe that observes the patched function directly
SHOWS: dict[str, Callable[[], None]] = {
    "integrity_secret_group_readable": probe_integrity_secret_must_be_private,
    "engine_secret_group_readable": probe_embedded_default_runs_mac_under_one_private_generated_secret,
    "engine_secret_dir_others_may_enter": probe_embedded_default_runs_mac_under_one_private_generated_secret,
    "engine_secret_per_process": probe_embedded_default_runs_mac_under_one_private_generated_secret,
    "embedded_default_checksum": probe_embedded_default_runs_mac_under_one_private_generated_secret,
    "integrity_verify_skipped": probe_a_seal_verifies_every_tag_it_is_asked_for,
    "integrity_rows_by_place": probe_a_seal_verifies_every_tag_it_is_asked_for,
    "tp_shared_head_owner_modulo": probe_replicated_kv_head_owner,
    "breaker_backoff_never_doubles": probe_breaker_backoff_doubles_to_its_cap,
    "lookup_waits_behind_abandoned_call": probe_lookup_deadline_behind_an_abandoned_call,
    "lookup_holds_the_step": probe_a_slow_lookup_waits_for_the_next_step,
    "rendezvous_metadata_url_master_port": probe_attached_process_uses_the_published_metadata_url,
    "rendezvous_attach_metadata_from_master_port": probe_attached_process_uses_the_published_metadata_url,
    "embedded_master_not_restarted": probe_supervisor_restarts_a_dead_master,
    "reset_weights_switch_skipped": probe_reset_switches_the_weights_version,
    "weights_switch_keeps_old_keys": probe_reset_switches_the_weights_version,
    "reset_switch_after_removal": probe_reset_switches_the_weights_version,
    "reset_epoch_kept": probe_a_reset_keeping_the_version_moves_the_keys_to_a_fresh_epoch,
    "reset_epoch_not_in_key": probe_a_reset_keeping_the_version_moves_the_keys_to_a_fresh_epoch,
    "reset_removal_never_retried": probe_reset_switches_the_weights_version,
}
