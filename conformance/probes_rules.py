"""Probes of rules that only integration tests held, or none: the integrity mode's choice and the secret's
source (kvledger_connector/config/model.py `integrity_mode`, shape/integrity.py `IntegrityKey.resolve`, and the
connector's own resolution of its key), every part of a store key's identity (engine_facts.key_layout from
vLLM's own configs), the disk tier sweep's own directories (store/tier.py `sweep_offload_dirs`) and the
tail-first release of every pin when the engine stops (`SchedulerLedger.release_all`, through the scheduler
side's steps, on vLLM's BlockPool).

Each calls the shipped function through the module (or class) the connector looks it up in, so a patched
function (a mutant) is the one probed, and raises :class:`ProbeFailed` naming what it saw. Files live in a
temporary directory; every probe runs in milliseconds once vLLM's config of a tiny model is built
(`probes_edge.tp_config`, once per process).

`PROBES` runs in the mutant table (conformance/mutants.py) and, unmutated, in tests/unit/test_probes_rules.py;
`MUTANTS` and `SHOWS` as in conformance/probes_edge.py.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import os
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import kvledger_connector.config.model as config
import kvledger_connector.connector as connector_mod
import kvledger_connector.shape.engine_facts as engine_facts
import kvledger_connector.shape.integrity as integrity
import kvledger_connector.store.tier as tier
from conformance.kvprobes import ProbeFailed, check
from conformance.probes_edge import SECRET, _secret_file, tp_config
from conformance.probes_parts import HASH, runtime_dir_env
from conformance.probes_sched import BS, Req, _run, sched
from kvledger.errors import LedgerInputError
from kvledger.scheduler import SchedulerLedger
from kvledger_connector.config import ConnectorConfig, StoreConfig, read_settings
from kvledger_connector.shape.integrity import IntegrityKey
from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
from testbed.kvcache import attention_specs, build_kv_cache_config

#: a configured master (nothing listens: no probe connects), as an operator's settings name it
MASTER = {"master_server_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/metadata"}
#: another engine's deployment secret (SECRET is the probes' own)
OTHER_SECRET = b"another-secret-of-the-same-size!"


def _refused_by_name(what: str, call: Callable[[], Any], field: str, value: Any) -> None:
    """``call()`` must raise the connector's refusal naming ``field`` and ``value``."""
    try:
        got = call()
    except LedgerInputError as e:
        check(e.field == field and repr(value) in str(e), f"{what} was refused naming {e.field!r}, not "
                                                          f"{field}={value!r}: {e}")
        return
    raise ProbeFailed(f"{what} was accepted ({got!r}), not refused naming {field}")


@contextlib.contextmanager
def _operator_secret(mode: int = 0o600) -> Iterator[tuple[str, str]]:
    """(an operator's secret file holding SECRET, of ``mode``; the engine's private runtime directory, set for
    this process), in a fresh temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        os.mkdir(run, 0o700)
        with runtime_dir_env(run):
            yield _secret_file(tmp, "operator.key", mode), run


def _connector_key(extra: dict[str, Any]) -> IntegrityKey:
    """The integrity key the connector resolves from ``extra`` (its kv_connector_extra_config), by its own
    method `_integrity`, called on THIS IS A TEST DOUBLE: the connector object, holding only the two vLLM configs
    the method reads (real ones)."""
    from vllm.config import KVTransferConfig

    engine = types.SimpleNamespace(_vllm_config=tp_config(1, 2), _kv_transfer_config=KVTransferConfig(
        kv_connector="KVLedgerConnector", kv_role="kv_both", engine_id="probe-rules"))
    return connector_mod.KVLedgerConnector._integrity(engine, read_settings(extra, env={}), False)


def _generated() -> bytes:
    """The engine's generated secret: never the one an operator's file gives."""
    return b"g" * 32


# ---------------------------------------------------------------- 1. only 'mac' takes a secret
def probe_a_secret_file_beside_checksum_or_off_is_refused_by_name() -> None:
    """A secret is used only by 'mac': `integrity_secret_file` set with integrity 'checksum' or 'off' is
    refused naming the file (`integrity_mode`, `IntegrityKey.resolve`, the connector's key and its
    ConnectorConfig), with the embedded store and beside a configured master. It never quietly runs 'mac'
    (the operator asked for another mode)."""
    master = StoreConfig(**MASTER)
    with _operator_secret() as (path, _run):
        for mode in ("checksum", "off"):
            for embedded in (True, False):
                where = f"integrity={mode!r} with a secret file ({'embedded store' if embedded else 'a master'})"
                _refused_by_name(f"config.integrity_mode of {where}",
                                 lambda: config.integrity_mode(mode, path, embedded=embedded),
                                 "integrity_secret_file", path)
                _refused_by_name(f"IntegrityKey.resolve of {where}", lambda: IntegrityKey.resolve(
                    mode, path, embedded=embedded, generated=_generated, device="cpu"), "integrity_secret_file", path)
                _refused_by_name(f"ConnectorConfig of {where}", lambda: ConnectorConfig(
                    store=StoreConfig() if embedded else master, block_size=BS, integrity=mode,
                    integrity_secret_file=path), "integrity_secret_file", path)
                extra = {"integrity": mode, "integrity_secret_file": path} | ({} if embedded else MASTER)
                _refused_by_name(f"the connector's key of {where}", lambda: _connector_key(extra),
                                 "integrity_secret_file", path)


def _secret_beside_any_mode_runs_mac(orig):  # a secret file makes 'mac' whatever integrity says
    def integrity_mode(mode, secret_file, *, embedded):
        return orig(None if secret_file is not None else mode, secret_file, embedded=embedded)
    return integrity_mode


# ---------------------------------------------------------------- 2. the operator's secret is the engine's
def probe_an_operators_secret_file_is_the_engines_secret() -> None:
    """With the embedded store (where an unset secret is generated per engine), an operator's
    `integrity_secret_file` is the secret the engine runs 'mac' under, integrity unset or 'mac': read from
    the file by `IntegrityKey.resolve` and by the connector's own resolution, no secret generated (none asked
    for, none written to the runtime directory). The file is checked as ever: a group-readable one is
    refused naming it, never replaced by a generated secret."""
    asked: list[int] = []

    def generated() -> bytes:
        asked.append(1)
        return _generated()

    with _operator_secret() as (path, run):
        for mode in (None, "mac"):
            key = IntegrityKey.resolve(mode, path, embedded=True, generated=generated, device="cpu")
            check((key.mode, key.secret, asked) == ("mac", SECRET, []),
                  f"integrity={mode!r} with a secret file, embedded store: IntegrityKey.resolve runs {key.mode!r} "
                  f"under {'the file' if key.secret == SECRET else 'another secret'} (generated asked "
                  f"{len(asked)} times)")
            key = _connector_key({"integrity_secret_file": path} | ({} if mode is None else {"integrity": mode}))
            check((key.mode, key.secret) == ("mac", SECRET),
                  f"integrity={mode!r} with a secret file, embedded store: the connector runs {key.mode!r} under "
                  f"{'the file' if key.secret == SECRET else 'another secret'}")
        made = sorted(n for n in os.listdir(run) if n.startswith("secret-"))
        check(made == [], f"the connector generated {made} in its runtime directory beside the operator's secret")
        os.chmod(path, 0o640)
        _refused_by_name("a group-readable secret file (0640) with the embedded store", lambda: IntegrityKey.resolve(
            None, path, embedded=True, generated=generated, device="cpu"), "integrity_secret_file", path)


def _operator_secret_unread(orig):  # with the embedded store the generated secret, the operator's file unread
    def resolve(cls, mode, secret_file, *, embedded, generated, device):
        return orig.__func__(cls, mode, None if embedded else secret_file, embedded=embedded,
                             generated=generated, device=device)
    return classmethod(resolve)


# ---------------------------------------------------------------- 3. every part of a key's identity
def _engine_key(*, layout: str = "LBNHC", revision: str | None = None, hash_algo: str | None = None,
                weights_version: str = "", ikey: IntegrityKey = IntegrityKey("mac", SECRET),
                model: str | None = None) -> str:
    """The key of block HASH on rank 0 of a tiny engine (vLLM's own configs, `key_layout` as the connector
    builds it) that differs from the others only in what is given."""
    vc = copy.deepcopy(tp_config(1, 2))  # `build_kv_cache_config` records its layout in the config
    if revision is not None:
        vc.model_config.revision = revision
    if hash_algo is not None:
        vc.cache_config.prefix_caching_hash_algo = hash_algo
    kv = build_kv_cache_config(vc, attention_specs(1, block_size=vc.cache_config.block_size, num_kv_heads=2,
                                                   head_size=8), 4, layout)
    lay: KeyLayout = engine_facts.key_layout(vc, kv, 0, weights_version=weights_version, integrity_tag=ikey.key_tag)
    return KeyBuilder(lay if model is None else dataclasses.replace(lay, model=model)).key(HASH)


def probe_engines_differing_in_one_identity_part_share_no_key() -> None:
    """Two engines that differ in one part of a key's identity only never share a key (each would load
    the other's bytes as its own): the model's name, its config (another revision), vLLM's block hash
    algorithm, the weights version, the KV cache layout, the integrity mode and construction, and under
    'mac' the secret (its fingerprint is in the tag, the secret is not). Engines alike in all share it."""
    base = _engine_key()
    check(_engine_key() == base, "two engines alike in every part (one secret) build different keys")
    variants = {
        "model name": _engine_key(model="org/another-model"), "model revision": _engine_key(revision="v2"),
        "block hash algorithm": _engine_key(hash_algo="sha256_cbor"),
        "weights version": _engine_key(weights_version="v2"), "KV cache layout": _engine_key(layout="LHBNC"),
        "integrity off": _engine_key(ikey=IntegrityKey("off")),
        "integrity checksum (x3)": _engine_key(ikey=IntegrityKey("checksum")),
        "integrity checksum (mm8)": _engine_key(ikey=IntegrityKey("checksum", construction="mm8")),
        "mac construction mm8": _engine_key(ikey=IntegrityKey("mac", SECRET, "mm8")),
        "mac secret": _engine_key(ikey=IntegrityKey("mac", OTHER_SECRET)),
    }
    seen = {base: "the base engine"}
    for what, key in variants.items():
        check(key not in seen, f"engines differing only in {what} share the key {key!r} (with {seen.get(key)})")
        seen[key] = what
    tags = [IntegrityKey("mac", secret, how).key_tag for secret in (SECRET, OTHER_SECRET) for how in ("b3", "mm8")]
    check(not any(secret.decode() in t or secret.hex() in t for secret in (SECRET, OTHER_SECRET) for t in tags),
          f"a mac key tag shows its secret: {tags}")


def _tag_without_fingerprint(orig):  # a mac tag names the mode and construction, not the secret
    return property(lambda self: orig.fget(self).partition("-")[0])


def _identity_without_weights_version(orig):  # the model's identity leaves the weights version out
    def model_identity(model_config, prefix_caching_hash_algo, weights_version=""):
        return orig(model_config, prefix_caching_hash_algo)
    return model_identity


def _digest_without_integrity(orig):  # the layout digest leaves the integrity tag out
    def digest(self):
        return orig(dataclasses.replace(self, integrity=""))
    return digest


# ---------------------------------------------------------------- 4. the tier sweep removes only ours
def probe_the_tier_sweep_removes_only_our_own_directories() -> None:
    """`sweep_offload_dirs` removes under `disk_offload_dir` only tier directories of ours (by their name,
    TIER_DIR_PREFIX) whose client is gone: unlocked past UNLOCKED_GRACE_S. Another directory of this user,
    as unlocked and as old, stays with its files (not ours: the operator's), and so do a tier directory whose
    OWNER_LOCK a live client holds, one younger than the grace and a link named like ours."""
    with tempfile.TemporaryDirectory() as parent:
        names = {"ours, gone": tier.TIER_DIR_PREFIX + "gone", "not ours": "operator-data",
                 "ours, live": tier.TIER_DIR_PREFIX + "live", "ours, young": tier.TIER_DIR_PREFIX + "young"}
        paths = {w: os.path.join(parent, n) for w, n in names.items()}
        for path in paths.values():
            os.mkdir(path, 0o700)
        Path(paths["not ours"], "data.bin").write_bytes(b"x" * 64)
        lock = os.open(os.path.join(paths["ours, live"], tier.OWNER_LOCK), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its own open file: the sweep's flock conflicts
            link = tier.TIER_DIR_PREFIX + "link"
            os.symlink(paths["not ours"], os.path.join(parent, link))
            now = time.time()
            old = now - 10 * tier.UNLOCKED_GRACE_S
            for w in ("ours, gone", "not ours", "ours, live"):
                os.utime(paths[w], (old, old))
            gone = tier.sweep_offload_dirs(parent, now=now)
        finally:
            os.close(lock)
        check(gone == [paths["ours, gone"]], f"the sweep removed {[os.path.basename(g) for g in gone]}, not only "
                                            f"{names['ours, gone']!r}")
        left = set(os.listdir(parent))
        want = set(names.values()) - {names["ours, gone"]} | {link}
        check(left == want, f"after the sweep {sorted(left)} are left, not {sorted(want)}")
        check(os.listdir(paths["not ours"]) == ["data.bin"], "the sweep emptied a directory not of ours")


# ---------------------------------------------------------------- 5. a stopping engine frees pins tail first
def probe_a_stopping_engine_frees_every_pin_tail_first() -> None:
    """When the engine stops (`SchedulerSteps.release_all`; its workers stopped first) every pin goes back
    tail first, as a report frees it: each store job's blocks and each load's destination blocks in the
    reverse of their pin order. vLLM's BlockPool hands blocks out again last freed first, so a request's tail
    is reused before the prefix that other prompts share."""
    s = sched()
    reqs = [Req("a", 3 * BS + 1), Req("b", 2 * BS + 1)]
    for r in reqs:
        s.steps.on_new_request(r)
    pins = {f"store job of {r.request_id}": s.ledger.pinned_block_ids(_run(s, r, r.num_prompt_tokens)[0].store_job_id)
            for r in reqs}
    s.ledger.pin_load("c", s.alloc("c", 3))
    pins["load of c"] = s.ledger.load_pinned_block_ids("c")
    for table in s.table.values():  # the requests end: only the pins hold their blocks
        s.pool.free_blocks(reversed([s.pool.blocks[b] for b in table]))
    s.steps.release_all()
    check(not s.ledger.has_pending_work(), "pins are still held after the engine stopped")
    free = [b.block_id for b in s.pool.free_block_queue.get_all_free_blocks()]
    for what, ids in pins.items():
        order = [b for b in free if b in ids]
        check(len(ids) > 1 and order == ids[::-1], f"the {what} pinned {ids}: at shutdown they went back in the "
                                                   f"order {order}, not tail first {ids[::-1]}")


def _shutdown_store_pins_head_first(orig):  # at shutdown each store job's blocks are freed head first
    def release_all(self):
        for rec in self._pinned.values():
            rec[0] = rec[0][::-1]
        return orig(self)
    return release_all


def _shutdown_load_pins_head_first(orig):  # at shutdown each load's destination blocks are freed head first
    def release_all(self):
        for fifo in self._loads.values():
            for rec in fifo:
                rec[0] = rec[0][::-1]
        return orig(self)
    return release_all


PROBES: list[Callable[[], None]] = [
    probe_a_secret_file_beside_checksum_or_off_is_refused_by_name, probe_an_operators_secret_file_is_the_engines_secret,
    probe_engines_differing_in_one_identity_part_share_no_key, probe_the_tier_sweep_removes_only_our_own_directories,
    probe_a_stopping_engine_frees_every_pin_tail_first,
]

Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    # ConnectorConfig calls integrity_mode in config/model.py, IntegrityKey.resolve through its own module's binding
    "secret_file_beside_checksum_runs_mac": [(config, "integrity_mode", _secret_beside_any_mode_runs_mac),
                                             (integrity, "integrity_mode", _secret_beside_any_mode_runs_mac)],
    "embedded_store_ignores_operator_secret": [(IntegrityKey, "resolve", _operator_secret_unread)],
    "mac_tag_without_secret_fingerprint": [(IntegrityKey, "key_tag", _tag_without_fingerprint)],
    # _layout_of calls model_identity through the engine_facts module
    "key_without_weights_version": [(engine_facts, "model_identity", _identity_without_weights_version)],
    "key_digest_without_integrity": [(KeyLayout, "digest", _digest_without_integrity)],
    # the sweep reads the prefix at every call: "" takes every directory of this user for one of ours
    "tier_sweep_any_directory": [(tier, "TIER_DIR_PREFIX", lambda _prefix: "")],
    "shutdown_frees_store_pins_head_first": [(SchedulerLedger, "release_all", _shutdown_store_pins_head_first)],
    "shutdown_frees_load_pins_head_first": [(SchedulerLedger, "release_all", _shutdown_load_pins_head_first)],
}

#: the shows-probe of each mutant: the probe that observes the patched function directly
SHOWS: dict[str, Callable[[], None]] = {
    "secret_file_beside_checksum_runs_mac": probe_a_secret_file_beside_checksum_or_off_is_refused_by_name,
    "embedded_store_ignores_operator_secret": probe_an_operators_secret_file_is_the_engines_secret,
    "mac_tag_without_secret_fingerprint": probe_engines_differing_in_one_identity_part_share_no_key,
    "key_without_weights_version": probe_engines_differing_in_one_identity_part_share_no_key,
    "key_digest_without_integrity": probe_engines_differing_in_one_identity_part_share_no_key,
    "tier_sweep_any_directory": probe_the_tier_sweep_removes_only_our_own_directories,
    "shutdown_frees_store_pins_head_first": probe_a_stopping_engine_frees_every_pin_tail_first,
    "shutdown_frees_load_pins_head_first": probe_a_stopping_engine_frees_every_pin_tail_first,
}
