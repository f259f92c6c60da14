"""Probes of what a rank accepts: every spec the worker receives (LoadSpec, SaveSpec, DropNotice, the metadata
types vLLM hands it) is checked whole before anything of it runs (kvledger_connector/metadata.py's checks,
applied by `WorkerSteps.admit_load`, `receive_save`, `receive_drop`). A malformed one fails as one unit:
every block of a load that names a real block is reported failed and the load finished (its request never
waits), a save's job is reported at once (its pins are released) unless its id is not one or another job's,
no store call is made for it, and nothing raises into the model runner. A well-formed spec still runs.

The probe drives the shipped step functions the way `WorkerSide.start_step` / `end_step` do, on a scripted
store (conformance/kvprobes.py's ProbeStore); tests/integration/test_malformed_specs.py drives the real
worker on a real Mooncake master. `PROBES` run in the mutant table and, unmutated, in
tests/unit/test_spec_checks.py; `MUTANTS` and `SHOWS` as in conformance/probes_edge.py.
"""
from __future__ import annotations

from typing import Any, Callable

import kvledger_connector.metadata as metadata
import kvledger_connector.worker.loads as loads
import kvledger_connector.worker.saves as saves
import kvledger_connector.worker.sent as sent
from conformance.kvprobes import io_of, HASHES, ProbeFailed, ProbeStore, check, probe_cache, rank
from kvledger.errors import LedgerInputError
from kvledger_connector.worker.steps import WorkerSteps
from kvledger_connector.metadata import DropNotice, LoadSpec, SaveSpec

NUM_BLOCKS = 8  # the probe rank's KV cache: blocks 1..7 (0 is vLLM's null block)


def _no_raise(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; anything it raises would reach the model runner: a ProbeFailed naming ``what``."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the finding is that it raised at all
        raise ProbeFailed(f"{what} raised into the model runner: {type(e).__name__}: {e}") from e


def _start_loads(w: WorkerSteps, specs: list[LoadSpec]) -> None:
    """The loads of one step as `WorkerSide.start_step` runs them (a load thread's run drained inline)."""
    for spec in specs:
        if _no_raise(f"admit_load({spec})", lambda: w.admit_load(spec)):
            _no_raise(f"run_load({spec})", lambda: w.run_load(io_of(w), spec.req_id, spec.block_ids, spec.block_hashes,
                                                               sync=spec.sync, groups=spec.groups))


def probe_a_malformed_spec_fails_whole_and_runs_nothing() -> None:
    """Malformed LoadSpecs (a negative id, a non-int id, an id past the KV cache, an id twice, a hash missing)
    are finished at once with every real block they name reported failed, sync or async, and no store call;
    a malformed SaveSpec (a negative generation, an id twice, an id past the cache) is reported at once and
    never run; one whose job id is another live job's is dropped without a second report; a malformed
    DropNotice raises nothing. A well-formed load and save of the same rank still run."""
    st = ProbeStore()
    w = rank(st, cache=probe_cache(num_blocks=NUM_BLOCKS))
    h = HASHES
    bad_loads = [LoadSpec("neg", (4, -1, 5), tuple(h[:3])),
                 LoadSpec("flt", (4, 1.5), tuple(h[:2]), sync=True),  # type: ignore[arg-type]
                 LoadSpec("far", (4, NUM_BLOCKS), tuple(h[:2])),
                 LoadSpec("dup", (5, 5, 6), tuple(h[:3]), sync=True),
                 LoadSpec("nohash", (4, 5), tuple(h[:1]))]
    _start_loads(w, bad_loads)
    check(st.calls == [], f"malformed loads reached the store: {st.calls}")
    done = w.take_finished_loads() | set(w.take_finished_sync_loads())
    want = {s.req_id for s in bad_loads}
    check(done == want, f"of the malformed loads {sorted(want)} only {sorted(done)} finished (the rest wait for ever)")
    errs = w.take_load_errors()
    check(errs == {4, 5, 6}, f"the malformed loads' real blocks 4, 5, 6 reported failed as {sorted(errs)}")
    # saves, as end_step receives them: job 1 well-formed and live; the rest malformed
    good = SaveSpec("s", 1, 0, 0, 2, (1, 2), tuple(h[:2]))
    bad_saves = [SaveSpec("s", 2, -1, 0, 2, (1, 2), tuple(h[:2])),
                 SaveSpec("t", 3, 0, 0, 2, (3, 3), tuple(h[:2])),
                 SaveSpec("u", 4, 0, 0, 1, (NUM_BLOCKS,), tuple(h[:1])),
                 SaveSpec("v", 1, 0, 0, 1, (7,), tuple(h[:1]))]  # job 1 is live: not a second job 1
    job = _no_raise("receive_save(well-formed)", lambda: w.receive_save(good))
    check(job is not None, f"a well-formed save was refused: {w.errors[-1:]}")
    for spec in bad_saves:
        got = _no_raise(f"receive_save({spec})", lambda: w.receive_save(spec))
        check(got is None, f"a malformed save was received to run: {spec}")
    reports = w.take_reports()
    check(reports == {2: 1, 3: 1, 4: 1}, f"malformed saves reported as {reports}; expected jobs 2, 3, 4 once each "
                                         f"and none for the second job 1")
    check(w.ledger.is_live(1), "a malformed spec naming live job 1 changed it")
    for nt in (DropNotice("s", -1, False), DropNotice("s", 0, "yes")):  # type: ignore[arg-type]
        _no_raise(f"receive_drop({nt})", lambda: w.receive_drop(nt))
    check(st.calls == [], f"malformed saves or notices reached the store: {st.calls}")
    # the well-formed load still runs
    _start_loads(w, [LoadSpec("ok", (3,), tuple(h[:1]))])
    check([fn for fn, _ in st.calls] == ["batch_get"], f"a well-formed load made the calls {st.calls}")
    check(w.take_finished_loads() == {"ok"}, "a well-formed load did not finish")


PROBES: list[Callable[[], None]] = [probe_a_malformed_spec_fails_whole_and_runs_nothing]


# ---------------------------------------------------------------- a real worker, for the tests of this rule
WORKER_BLOCK_SIZE = 4


def worker_side(store: Any, *, num_blocks: int = NUM_BLOCKS, secret: bytes | None = None, model: str = "specs",
                load_sub_batch_keys: int = 64, **side: Any) -> tuple[Any, dict[str, Any]]:
    """(a started `WorkerSide` of rank 0 over ``store``, its KV cache): one layer of vLLM's own LBNHC cache of
    ``num_blocks`` blocks, every byte from a fixed seed; ``secret``: integrity 'mac' under it (else off);
    ``side``: further `WorkerSide` arguments."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    from kvledger_connector.shape.block_shape import BlockShape
    from kvledger_connector.config import ConnectorConfig, StoreConfig
    from kvledger_connector.shape.integrity import IntegrityKey
    from kvledger_connector.shape.keys import KeyBuilder, KeyLayout
    from kvledger_connector.shape.kvlayout import plan_block_copies
    from kvledger_connector.worker.side import WorkerSide
    from testbed.kvcache import allocate, attention_specs, build_kv_cache_config

    bs = WORKER_BLOCK_SIZE
    vc = VllmConfig(cache_config=CacheConfig(block_size=bs), device_config=DeviceConfig("cpu"))
    kv = allocate(build_kv_cache_config(vc, attention_specs(1, block_size=bs, num_kv_heads=1, head_size=4),
                                        num_blocks, "LBNHC"), "LBNHC")
    g = torch.Generator().manual_seed(11)
    for t in kv.values():
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, tuple(u.shape), dtype=torch.uint8, generator=g))
    keys = KeyBuilder(KeyLayout(model=model, tp_rank=0, tp_size=1, block_size=bs, dtype="torch.float32",
                                kv_layout="LBNHC", num_layers=1, num_kv_heads=1, head_size=4))
    cfg = ConnectorConfig(store=StoreConfig(load_sub_batch_keys=load_sub_batch_keys), block_size=bs)
    ws = WorkerSide(cfg, store=store, shape=BlockShape.of_keys([keys]), tp_rank=0, max_requests=16,
                    integrity=IntegrityKey("mac", secret) if secret is not None else None, **side)
    ws.register_kv_caches(plan_block_copies(kv, layout="LBNHC", block_size=bs, num_blocks=num_blocks), kv)
    return ws, kv


def _skipped(orig: Any) -> Any:  # the check accepts anything: a spec runs as it came
    def skip(*args: Any, **kwargs: Any) -> None:
        return None
    return skip


def _duplicates_accepted(orig: Any) -> Any:  # an id named twice in a spec passes
    def block_ids_error(where: str, block_ids: Any, num_blocks: int | None, *, null_ok: bool) -> Any:
        return orig(where, list(dict.fromkeys(block_ids)) if isinstance(block_ids, (tuple, list)) else block_ids,
                    num_blocks, null_ok=null_ok)
    return block_ids_error


Patch = tuple[Any, str, Callable[[Any], Any]]
MUTANTS: dict[str, list[Patch]] = {
    # the steps look the checks up in their own modules (imported by name from metadata)
    "spec_check_skipped": [(loads, "check_load_spec", _skipped), (saves, "check_save_spec", _skipped),
                           (sent, "check_save_spec", _skipped), (saves, "check_drop_notice", _skipped)],
    # the checks look block_ids_error up in metadata
    "spec_duplicate_block_ids_accepted": [(metadata, "block_ids_error", _duplicates_accepted)],
}


def _refuses(what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except LedgerInputError:
        return
    raise ProbeFailed(f"{what} was accepted")


def _show_skipped() -> None:
    _refuses("LoadSpec block id -1", lambda: loads.check_load_spec(LoadSpec("a", (-1,), (b"h",)),
                                                                   num_blocks=NUM_BLOCKS, num_groups=1))
    _refuses("SaveSpec generation -1", lambda: saves.check_save_spec(SaveSpec("a", 1, -1, 0, 1, (1,), (b"h",))))
    _refuses("DropNotice generation -1", lambda: saves.check_drop_notice(DropNotice("a", -1, False)))


def _show_duplicates() -> None:
    check(metadata.block_ids_error("probe", (4, 4), NUM_BLOCKS, null_ok=False) is not None,
          "block_ids_error accepted block 4 named twice")


#: the shows-probe of each mutant: the patched function observed directly
SHOWS: dict[str, Callable[[], None]] = {
    "spec_check_skipped": _show_skipped,
    "spec_duplicate_block_ids_accepted": _show_duplicates,
}
