"""The connector inside vLLM 0.32's REAL engine: `LLM` → `EngineCore` → executor → workers.

The model is the only stand-in (`testbed.emu_worker.EmuWorker`, passed as `worker_cls`). Under vLLM's CPU build
(.venv) the runs a real model does (test_real_model.py) are skipped (`REAL_MODEL_COVERS`); under vLLM 0.33 (the
CUDA wheel, .venv033: no real model runs) they are the engine's only check. Everything else —
the scheduler, block pool, prefix cache, executor processes and queues, the connector factory, vLLM's
connector call sequence and output aggregation, the KV allocator — is vLLM's. Each engine runs in a
subprocess with a timeout (tests/engine/conftest.py).

Two passes over prompts with shared prefixes, `reset_prefix_cache()` between them, so pass 2 finds nothing
in vLLM's own cache and loads prompt blocks from the Mooncake store. Checked per run:

- every output equals the emulated model's (`expected_output`) and a run without the connector;
- no rank read wrong KV (`wrong_kv`: each rank checks every position it did not write itself);
- pass 2 loaded from the store (vLLM's external prefix-cache hits; the connector's loads on every rank);
- nothing leaked: reset_prefix_cache() succeeds at the end (vLLM's "every block is free"), no rank has
  pending connector work or handler errors;
- the connector's trace log is accepted by TLC (conformance.runlog), ending at rest;
- nothing is left after the engine exits: no process of its session or group, no Mooncake server one of
  its processes started, and (EngineCore in the driver's process) no pinned block after shutdown.

Runs: TP=1 in-process (vLLM's default layout, and LHBNC); TP=2 with worker processes and EngineCore in its
own process, on a configured master (also with an MLA model: one copy in the store); TP=1 with a pool
small enough that vLLM preempts and the same request ids added again after they finished; TP=1 with load
faults injected (`FaultyEmuWorker`: a FAULT-INJECTION TEST DOUBLE around the real store) under both
`kv_load_failure_policy` values; a gpt-oss-like hybrid model (sliding-window and full-attention KV cache groups, vLLM's hybrid KV cache manager
on) at TP=1 in-process (with preemptions and reused request ids) and at TP=2 with worker processes; a
Mistral-like model whose every layer has one sliding window (one SlidingWindowSpec group) at TP=1 in-process.
The embedded default across an engine's processes and the master killed mid-run are test_real_model.py's.
"""
from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.store.embedded import EmbeddedMooncake
from testbed.emu_model import VOCAB, expected_output, shared_prefix_prompts
from testbed.vllm_build import installed_vllm, runs_real_models

from engine_checks import (  # tests/engine is on sys.path (rootdir mode)
    PIN_CAP, RECOVERED_MARK, check_at_rest as _check_at_rest, check_nothing_left as _check_nothing_left,
    check_trace as _check_trace, master_timeouts as _master_timeouts)

pytestmark = pytest.mark.slow

#: engine runs whose connector paths vLLM 0.33 does not change (the same views and calls as a test that runs
#: on both versions): run on 0.32 only, to keep `make test`'s time where it is
ONE_VERSION = pytest.mark.skipif(installed_vllm()[0] != "0.32.0",
                                 reason="the same connector path as a test run on both vLLM versions")
#: runs a real model can do (test_real_model.py, vLLM's CPU build): the stand-in runs them only where no real
#: model runs (vLLM 0.33, the CUDA wheel); with ONE_VERSION as well, the real model's test replaces it
REAL_MODEL_COVERS = pytest.mark.skipif(runs_real_models(), reason="test_real_model.py runs it with a real model")

MAX_TOKENS = 6
BLOCK_SIZE = 16


def _prompts(n: int = 6, *, prefix_len: int = 40, suffix_len: int = 12, seed: int = 0) -> list[list[int]]:
    """Two shared prefixes (2 full blocks each) + unique suffixes: local prefix hits in pass 1, store
    loads of 3 full blocks per prompt in pass 2."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, VOCAB - 10) for _ in range(prefix_len)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(10, VOCAB - 10) for _ in range(suffix_len)] for i in range(n)]


PROMPTS = _prompts()


def _spec(workdir: Path, *, tp: int, mp: int, connector: dict[str, Any] | None, **over: Any) -> dict[str, Any]:
    return {"workdir": str(workdir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "passes": 2, "tp": tp,
            "mp": mp, "backend": "uni" if tp == 1 and mp == 0 else "mp", "num_blocks": 64,
            "block_size": BLOCK_SIZE, "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 128,
            "num_layers": 2, "num_kv_heads": 2, "head_size": 8, "connector": connector,
            "reset_between_passes": True, "settle_timeout_s": 60, **over}


def _connector(mc: EmbeddedMooncake, trace: Path, **extra: Any) -> dict[str, Any]:
    return {"policy": "recompute", "extra": {
        "master_server_address": mc.master_address, "metadata_server": mc.metadata_server,
        "global_segment_size": "32MB", "local_buffer_size": "4MB", "max_inflight_jobs": PIN_CAP,
        "max_pinned_blocks": 64, "trace_path": str(trace),
        "lookup_timeout_ms": 5000,  # a loaded machine must not turn a lookup into a miss here
        **extra}}


@pytest.fixture(scope="module")
def baseline(run_engine: Callable[..., dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
             ) -> list[list[int]]:
    """Outputs of the same engine without a connector (TP=1, in-process), one pass."""
    spec = _spec(tmp_path_factory.mktemp("baseline-model"), tp=1, mp=0, connector=None)
    spec["passes"] = 1
    res = run_engine(spec, timeout_s=180, name="baseline")
    assert all(w["wrong_kv"] == 0 for w in res["workers"]), res["workers"]
    outputs: list[list[int]] = res["passes"][0]["outputs"]
    return outputs


def _check_outputs(res: dict[str, Any], baseline: list[list[int]] | None, max_tokens: int = MAX_TOKENS,
                   prompts: list[list[int]] | None = None) -> None:
    want = [expected_output(p, max_tokens) for p in (PROMPTS if prompts is None else prompts)]
    if baseline is not None:
        assert baseline == want, "the engine without a connector does not produce the emulated model's outputs"
    for n, ps in enumerate(res["passes"]):
        assert ps["outputs"] == want, f"pass {n}: outputs differ from the model's"
        assert set(ps["finish_reasons"]) == {"length"}, f"pass {n}: finish reasons {ps['finish_reasons']}"
    for n, ps in enumerate(res["passes"][1:], 1):
        assert ps["reset"]["done"], f"reset_prefix_cache() never succeeded before pass {n}: {ps}"


def _check_workers(res: dict[str, Any], *, tp: int, load_faults: bool = False,
                   recovery_mark: str | None = RECOVERED_MARK) -> None:
    """Every rank: no wrong KV, checked some KV it did not write, loaded (and finished every load), saved,
    no handler errors, no pending work. `load_faults`: failed load blocks are injected (and required).
    `recovery_mark`: what the log must show when load blocks failed (None: vLLM logs nothing, as for a hybrid
    model's per-request reports; no wrong KV and the model's outputs then show the recompute).

    Without injected faults a load block may fail only when the master did not answer in time: with fewer
    cores than busy processes the main threads of vLLM's workers and EngineCore busy-poll their shared-memory queues
    (sched_yield loops) during a pass, and the other processes, the Mooncake master and kernel threads
    included, were measured waiting on the run queue for seconds (/proc/<pid>/schedstat: an external
    master 1.8 s, an embedded one up to 12 s; 2 s RPC timeouts in about a third of the embedded TP=2 runs,
    none of five external ones). The store client then times out, the connector reports the blocks, and
    vLLM recomputes them: allowed, when the log shows both."""
    workers = res["workers"]
    assert sorted(w["tp_rank"] for w in workers) == list(range(tp))
    for w in workers:
        who = f"tp rank {w['tp_rank']}"
        assert w["wrong_kv"] == 0, f"{who} read wrong KV: {w['messages']}"
        assert w["counts"].get("tokens_checked", 0) > 0, f"{who} checked no KV it did not write"
        c = w["connector"]
        assert c is not None and c["class"] == "KVLedgerConnector", f"{who}: connector {c}"
        assert c["errors"] == [], f"{who} connector handler errors: {c['errors']}"
        assert c["num_loads"] > 0 and c["loads_finished"] == c["num_loads"], f"{who} loads: {c}"
        if not load_faults and c["num_load_blocks_failed"]:
            timeouts = _master_timeouts(res)
            assert timeouts > 0, f"{who} failed load blocks with no master RPC timeout in the log: {c}"
            if recovery_mark is not None:
                assert recovery_mark in Path(res["log"]).read_text(errors="replace"), \
                    f"{who}: failed load blocks that vLLM did not recompute: {c}"
            print(f"NOTE {who}: {c['num_load_blocks_failed']} load blocks failed after {timeouts} master RPC "
                  f"timeouts (a starved master: see _check_workers); all recomputed")
        assert c["num_saves_run"] > 0, f"{who} saved nothing: {c}"
        assert not c["pending_work"], f"{who} has pending connector work at the end"
    if load_faults:
        assert sum(w["connector"]["num_load_blocks_failed"] for w in workers) > 0, "no load block failed"
        assert sum(w["connector"].get("faults_injected", 0) for w in workers) > 0, "no fault was injected"


def _check_store_hits(res: dict[str, Any], *, min_tokens: int = len(PROMPTS) * BLOCK_SIZE) -> None:
    """Pass 2 starts from an empty local cache: its hits are the store's."""
    hits = res["metrics"].get("external_prefix_cache_hits", 0)
    assert hits >= min_tokens, f"vLLM counted {hits} tokens loaded from the store"
    assert sum(res["passes"][1]["num_cached_tokens"]) > sum(res["passes"][0]["num_cached_tokens"])


@contextlib.contextmanager
def _busy_cpu() -> Iterator[None]:
    """A CPU-bound process beside the engine, as another test suite on the same machine: puts slow down and
    the pin caps defer saves past their requests' finish. Niced: it takes the CPU the engine leaves, so the
    store's own timeouts (a put starved of CPU for seconds fails, which is not the subject here) keep their
    meaning. Stopped by its process id."""
    burner = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def _check_no_save_given_up(res: dict[str, Any]) -> None:
    """No save was given up (`saves_dropped`): a request that finished while the caps deferred its save was
    held (vLLM kept its blocks) until the save was stored, however slow the puts."""
    assert res["metrics"].get("kvledger_saves_dropped", 0) == 0, res["metrics"]


def _check_run(res: dict[str, Any], *, tp: int, trace: Path, baseline: list[list[int]] | None,
               max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """The standard assertions (module docstring); returns the trace's events."""
    _check_outputs(res, baseline, max_tokens)
    _check_workers(res, tp=tp)
    _check_store_hits(res)
    _check_at_rest(res)
    _check_no_save_given_up(res)
    events = _check_trace(trace)
    _check_nothing_left(res)
    return events


# LHBNC on 0.32 only: the copy plans read the views test_kv_layouts checks on both versions
@pytest.mark.parametrize("layout", [pytest.param(None, marks=REAL_MODEL_COVERS), pytest.param("LHBNC", marks=ONE_VERSION)],
                         ids=["default-layout", "LHBNC"])
def test_tp1_in_process_engine_loads_prefixes_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], baseline: list[list[int]],
        tmp_path: Path, layout: str | None) -> None:
    """UniProcExecutor, EngineCore in the driver's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one
    process holds the scheduler-side and the worker-side connector, one trace file. Also with LHBNC chosen
    through vLLM's own VLLM_KV_CACHE_LAYOUT (a block is one segment per layer and head there)."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, tp=1, mp=0, connector=_connector(mooncake, trace)), timeout_s=180,
                     name=f"tp1-{layout or 'default'}", env={"VLLM_KV_CACHE_LAYOUT": layout} if layout else None)
    print(f"tp1 {layout or 'default layout'}: start-up {res['startup_s']}s, total {res['total_s']}s, "
          f"shutdown {res['shutdown_s']}s, metrics {res['metrics']}")
    assert {w["kv_layout"] for w in res["workers"]} == {layout or "LBNHC"}
    _check_run(res, tp=1, trace=trace, baseline=baseline)


def test_tp2_mp_engine_loads_prefixes_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    """MultiprocExecutor with 2 worker processes (gloo TP group), EngineCore in its own process
    (VLLM_ENABLE_V1_MULTIPROCESSING=1): three processes append to ONE trace file. With `save_partial_tail`:
    pass 2 loads each prompt's partial tail too (all but the last token). Their events interleave
    in the file in real-time order; each process writes and flushes an event before any message that
    depends on it leaves the process, so the file order respects causality (`seq` restarts per process
    and is not used by the check)."""
    trace = tmp_path / "trace.ndjson"
    conn = _connector(mooncake, trace)
    conn["extra"]["save_partial_tail"] = True  # every prompt is 3 full blocks + 4 tokens: its tail is saved too
    # the burner beside the engine (and, in CI, another suite) can starve the master past 2 s, and a load
    # that times out is recomputed (_check_workers allows it); this test's subject is that every load
    # lands, tails included, so its client waits longer for the master
    conn["extra"]["rpc_timeout_ms"] = 10_000
    # vLLM's client gives EngineCore 5 s to exit; its workers need about 4 s here (interpreter teardown,
    # with or without a connector), after which EngineCore still has to shut the scheduler-side connector
    # down: a longer bound lets it (else vLLM force-kills EngineCore mid-teardown). Run beside a busy CPU:
    # every save must still land (held past its request's finish when the caps defer it)
    with _busy_cpu():
        res = run_engine(_spec(tmp_path, tp=2, mp=1, connector=conn, shutdown_timeout_s=30),
                         timeout_s=300, name="tp2")
    print(f"tp2: start-up {res['startup_s']}s, total {res['total_s']}s, shutdown {res['shutdown_s']}s, "
          f"metrics {res['metrics']}")
    _check_run(res, tp=2, trace=trace, baseline=baseline)
    # partial tails: pass 2 (empty local cache) has every prompt but its last token from the cache and the
    # store, and both ranks checked the loaded tail slots (wrong_kv == 0 in _check_run)
    assert res["passes"][1]["num_cached_tokens"] == [len(p) - 1 for p in PROMPTS], res["passes"][1]
    assert res["engine_mooncake"] == {"startup": [], "end": []}, "a configured master: the engine starts none"


def test_tp2_mla_engine_stores_one_copy_and_both_ranks_load_it(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    """A DeepSeek-V2 (MLA) model at TP=2 with worker processes: both ranks hold the same latent, share one
    key per block (`tp0+2of2`) and each key is put by one of them; in pass 2 both ranks load every key,
    half of which the other rank put, and each checks every loaded position against the model's KV."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, tp=2, mp=1, connector=_connector(mooncake, trace), kv_kind="mla",
                           head_size=16, shutdown_timeout_s=30), timeout_s=300, name="tp2-mla")
    print(f"tp2 mla: start-up {res['startup_s']}s, total {res['total_s']}s, metrics {res['metrics']}")
    _check_run(res, tp=2, trace=trace, baseline=baseline)
    conns = [w["connector"] for w in res["workers"]]
    assert len({c["key_prefix"] for c in conns}) == 1 and "/tp0+2of2-pp0of1/" in conns[0]["key_prefix"], conns
    full_blocks = {tuple(p[:BLOCK_SIZE * (i + 1)]) for p in PROMPTS for i in range(len(p) // BLOCK_SIZE)}
    puts = [c["put_keys"] for c in conns]
    assert sum(puts) == len(full_blocks) and all(puts), f"keys put per rank {puts}, {len(full_blocks)} blocks"


@ONE_VERSION  # the per-head copy plans read the views test_kv_layouts checks on both versions
def test_tp2_mp_engine_with_the_tp_shared_layout_puts_and_loads_a_key_per_kv_head(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    """`kv_heads_per_key` 1 at TP 2 with worker processes, a model of 4 KV heads: each rank's block is two
    keys, one per head it holds (`kvh<h>+1of4`), cut from vLLM's views of that rank; pass 2 loads both keys
    of every block into each rank's head slices, checked against the model's KV of those heads. The keys
    are the ones a TP 1 or TP 4 engine of this model builds (test_tp_shared_layout.py loads them there)."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, tp=2, mp=1, connector=_connector(mooncake, trace, kv_heads_per_key=1),
                           num_kv_heads=4, shutdown_timeout_s=30), timeout_s=300, name="tp2-heads")
    print(f"tp2 kv heads: start-up {res['startup_s']}s, total {res['total_s']}s, metrics {res['metrics']}")
    _check_run(res, tp=2, trace=trace, baseline=baseline)
    conns = sorted((w["connector"] for w in res["workers"]), key=lambda c: c["key_prefixes"][0])
    heads = [[p.rstrip("/").split("/")[-1] for p in c["key_prefixes"]] for c in conns]
    assert heads == [["kvh0+1of4-pp0of1", "kvh1+1of4-pp0of1"], ["kvh2+1of4-pp0of1", "kvh3+1of4-pp0of1"]], heads
    full_blocks = {tuple(p[:BLOCK_SIZE * (i + 1)]) for p in PROMPTS for i in range(len(p) // BLOCK_SIZE)}
    puts = [c["put_keys"] for c in conns]
    assert puts == [2 * len(full_blocks)] * 2, f"keys put per rank {puts}, {len(full_blocks)} blocks"
    assert all(c["get_keys"] > 0 and c["get_keys"] % 2 == 0 for c in conns), conns  # both heads of each block


@pytest.mark.parametrize("kind", [pytest.param("per_rank", marks=REAL_MODEL_COVERS),
                                  pytest.param("mla", marks=ONE_VERSION)])
def test_tp1_engine_with_preemptions_and_reused_request_ids_keeps_kv_right(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path, kind: str) -> None:
    """A 16-block pool and 40 generated tokens per request: vLLM preempts running requests (their blocks
    go back to the pool while store jobs may still pin them) and resumes them with new block tables. Every
    resumed request is re-checked from position 0 by the worker; stale store jobs of old generations are
    reported and run nothing.

    request_id reuse: each pass adds "req-0".."req-5" itself (`llm_engine.add_request`) and steps until they
    finish, so pass 2 adds the same ids again after they finished. vLLM 0.32 appends 8 random characters to
    every id unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 (which the driver sets for this spec): only then
    do the scheduler and the connector see the same id twice, which the trace shows (a Finish per lifetime).
    Also for the MLA (DeepSeek-V2) stand-in: one latent per token."""
    trace = tmp_path / "trace.ndjson"
    mla = {"kv_kind": "mla", "head_size": 16} if kind == "mla" else {}
    res = run_engine(_spec(tmp_path, tp=1, mp=0, connector=_connector(mooncake, trace), num_blocks=16,
                           max_tokens=40, max_model_len=128, request_ids="fixed", **mla),
                     timeout_s=180, name=f"tp1-preempt-reuse-{kind}")
    print(f"tp1 preemptions + reused ids: total {res['total_s']}s, metrics {res['metrics']}, "
          f"counts {res['workers'][0]['counts']}, connector {res['workers'][0]['connector']}")
    assert res["metrics"].get("num_preemptions", 0) > 0, "no preemption happened: the scenario is void"
    assert res["workers"][0]["counts"].get("resumptions", 0) > 0
    ids = [f"req-{i}" for i in range(len(PROMPTS))]
    assert [ps["request_ids"] for ps in res["passes"]] == [ids, ids]
    events = _check_run(res, tp=1, trace=trace, baseline=None, max_tokens=40)
    # each id: a lifetime that finished (pass 1), then the same id admitted again, loading and saving (pass 2);
    # the last requests' Finish notices go out with the scheduler's next step, which may not come
    for r in ids:
        acts = [e["action"] for e in events if e.get("req_id") == r]
        assert "Finish" in acts, f"{r} never finished: {acts}"
        after = acts[acts.index("Finish") + 1:]
        assert "EmitStore" in after or "Load" in after, f"{r} was not used again after it finished: {acts}"
    assert Counter(e["req_id"] for e in events if e["action"] == "Finish")["req-0"] == 2


#: a FAULT-INJECTION TEST DOUBLE's plan (testbed.faults.FaultyStore around rank 0's real store, installed by
#: testbed.emu_worker.FaultyEmuWorker): the first batch_get of rank 0 fails for every key (TRANSFER_FAIL),
#: i.e. the first load of pass 2
LOAD_FAULT_PLAN = {"seed": 0, "ranks": [0], "rules": [{"op": "get", "action": "code", "code": -800, "calls": [0]}]}


def _run_with_load_faults(run_engine: Callable[..., dict[str, Any]], tmp_path: Path, mc: EmbeddedMooncake,
                          policy: str) -> tuple[dict[str, Any], Path]:
    trace = tmp_path / "trace.ndjson"
    conn = _connector(mc, trace)
    conn["policy"] = policy
    res = run_engine(_spec(tmp_path, tp=1, mp=0, connector=conn, worker_cls="testbed.emu_worker.FaultyEmuWorker"),
                     timeout_s=180, name=f"tp1-load-faults-{policy}",
                     env={"EMU_FAULT_PLAN": json.dumps(LOAD_FAULT_PLAN)})
    print(f"tp1 load faults ({policy}): total {res['total_s']}s, metrics {res['metrics']}, "
          f"connector {res['workers'][0]['connector']}, pass 2 {res['passes'][1]['finish_reasons']}")
    return res, trace


@REAL_MODEL_COVERS
def test_tp1_load_faults_recompute_policy_recomputes_the_failed_blocks(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """Fault injection (FaultyStore, a test double around the real store): the first load's get fails.
    Under kv_load_failure_policy="recompute" the connector reports every block of it, vLLM recomputes them
    ("Recovered from KV load failure"), every output is still the model's and no rank read wrong KV."""
    res, trace = _run_with_load_faults(run_engine, tmp_path, mooncake, "recompute")
    _check_outputs(res, None)
    _check_workers(res, tp=1, load_faults=True)
    _check_store_hits(res, min_tokens=BLOCK_SIZE)
    _check_at_rest(res)
    _check_trace(trace)
    _check_nothing_left(res)
    log = Path(res["log"]).read_text(errors="replace")
    assert "Recovered from KV load failure" in log, "vLLM did not report recomputing the failed blocks"
    assert res["workers"][0]["counts"].get("invalid_blocks", 0) > 0, "the worker handed vLLM no failed block"


@REAL_MODEL_COVERS
def test_tp1_load_faults_fail_policy_fails_the_affected_requests(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """The same fault injection (a test double) under kv_load_failure_policy="fail": the requests whose
    blocks did not load finish with an error (finish reason "error", vLLM logs "Failing ... due to KV load
    failure"), every other request's output is the model's, no rank read wrong KV and nothing leaks."""
    res, trace = _run_with_load_faults(run_engine, tmp_path, mooncake, "fail")
    want = [expected_output(p, MAX_TOKENS) for p in PROMPTS]
    assert res["passes"][0]["outputs"] == want and set(res["passes"][0]["finish_reasons"]) == {"length"}
    p2 = res["passes"][1]
    failed = [i for i, r in enumerate(p2["finish_reasons"]) if r == "error"]
    assert failed, f"no request finished with an error: {p2['finish_reasons']}"
    for i, (out, reason) in enumerate(zip(p2["outputs"], p2["finish_reasons"])):
        if i in failed:
            assert len(out) < MAX_TOKENS, f"request {i} failed but produced {out}"
        else:
            assert reason == "length" and out == want[i], f"request {i}: {reason} {out}"
    log = Path(res["log"]).read_text(errors="replace")
    assert "due to KV load failure" in log and "failure_policy=fail" in log, "vLLM did not report failing requests"
    _check_workers(res, tp=1, load_faults=True)
    _check_at_rest(res)
    _check_trace(trace)
    _check_nothing_left(res)


# ---------------------------------------------------------------------------------------------- hybrid model
#: a gpt-oss-like hybrid: even layers attend to the last WINDOW tokens (SlidingWindowSpec), odd ones to all
WINDOW = 128
PREFIX_LEN = 256
#: 300-token prompts on two 256-token shared prefixes: longer than the window, so vLLM puts its null block
#: below the window in the sliding-window group's tables (prefill runs in 128-token chunks)
HYBRID_PROMPTS = shared_prefix_prompts(6, num_prefixes=2, prefix_len=PREFIX_LEN, suffix_len=44, seed=5)
HMA_OFF_MARK = "Turning off hybrid kv cache manager"
#: tokens generated per request in the TP=1 hybrid test: decodes that outgrow its small pool (preemptions)
HYBRID_PREEMPT_TOKENS = 80
#: the Gemma-3-like TP=1 run: a request holds up to 29 full-attention blocks and 9 per sliding group, and
#: the pin cap must admit the longest request's 6 x 30 blocks
GEMMA3_PREEMPT_TOKENS = 160
GEMMA3_PREEMPT_BLOCKS = 200
#: the TP=2 hybrid runs' block pin cap: a job pins a request's blocks of every group from block 0 (up to 30
#: pins), so PIN_CAP jobs pin fewer than this and only the job cap defers a save
HYBRID_TP2_PIN_BLOCKS = 480


def _hybrid_spec(workdir: Path, *, tp: int, mp: int, connector: dict[str, Any], **over: Any) -> dict[str, Any]:
    return _spec(workdir, tp=tp, mp=mp, connector=connector, **{
        "prompts": HYBRID_PROMPTS, "sliding_window": WINDOW, "num_layers": 4, "num_blocks": 160,
        "max_model_len": 384, **over})


#: the KV cache groups vLLM plans for the gpt-oss-like stand-in (4 layers, every 2nd full attention) and the
#: Gemma-3-like one (6 layers, every 6th full: one group per layer, as vLLM groups 5 sliding : 1 full)
GPT_OSS_GROUPS = [{"spec": "SlidingWindowSpec", "sliding_window": WINDOW, "layers": [0, 2]},
                  {"spec": "FullAttentionSpec", "sliding_window": None, "layers": [1, 3]}]
GEMMA3_GROUPS = ([{"spec": "SlidingWindowSpec", "sliding_window": WINDOW, "layers": [i]} for i in range(5)]
                 + [{"spec": "FullAttentionSpec", "sliding_window": None, "layers": [5]}])


def _lost_saves(res: dict[str, Any]) -> int:
    """Blocks of deferred jobs vLLM evicted before they were pinned in this run (`expired_kept_blocks`: Mamba
    states, sliding-window blocks that left the window, which no request holds), from vLLM's metrics of the
    connector's counters. Whether a job waits that long depends on how fast the puts are, so a pass-2 hit
    may be short by these and no more; no save is given up (`_check_no_save_given_up`)."""
    return int(res["metrics"].get("kvledger_expired_kept_blocks", 0))


def _check_hybrid_run(res: dict[str, Any], *, tp: int, trace: Path, max_tokens: int = MAX_TOKENS,
                      groups: list[dict[str, Any]] = GPT_OSS_GROUPS) -> list[dict[str, Any]]:
    """`_check_run` for a hybrid model, plus: vLLM kept its hybrid KV cache manager on (our connector is
    `SupportsHMA`) and every rank got the KV cache groups ``groups`` (default the gpt-oss-like stand-in's two:
    the sliding-window layers (0, 2) and the full-attention ones (1, 3)).

    Pass 2 must start every prompt from at least its shared prefix (the store's, after reset_prefix_cache),
    unless a rank's load failed after a master RPC timeout (`_check_workers`: a master starved of CPU
    time). With several groups the connector reports a failed load per request and vLLM
    recomputes the whole request without logging it; the connector then skips store calls for its
    unhealthy backoff (1 s, longer than pass 2), so that rank's other loads fail too. Outputs and wrong KV
    are checked either way."""
    _check_outputs(res, None, max_tokens, HYBRID_PROMPTS)
    _check_workers(res, tp=tp, recovery_mark=None)
    assert res["metrics"].get("external_prefix_cache_hits", 0) >= 2 * PREFIX_LEN, res["metrics"]
    cached = [ps["num_cached_tokens"] for ps in res["passes"]]
    failed = [w["connector"]["num_load_blocks_failed"] for w in res["workers"]]
    if any(failed):
        print(f"NOTE: load blocks failed per rank {failed} after master RPC timeouts; cached tokens {cached}")
    else:
        # a block vLLM evicted before its deferred job pinned it costs at most the one prompt it was for its hit
        short = sum(n < PREFIX_LEN for n in cached[1])
        assert short <= _lost_saves(res) and sum(cached[1]) > sum(cached[0]), (cached, res["metrics"])
    _check_at_rest(res)
    _check_no_save_given_up(res)
    events = _check_trace(trace)
    _check_nothing_left(res)

    assert res["disable_hybrid_kv_cache_manager"] is False, "vLLM turned the hybrid KV cache manager off"
    assert HMA_OFF_MARK not in Path(res["log"]).read_text(errors="replace"), f"{HMA_OFF_MARK!r} in {res['log']}"
    for w in res["workers"]:
        assert sorted(w["kv_cache_groups"], key=lambda g: g["layers"]) == groups, w["kv_cache_groups"]
    return events


@REAL_MODEL_COVERS
def test_tp1_hybrid_sliding_window_engine_loads_both_groups_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """A gpt-oss-like hybrid (two KV cache groups: sliding window and full attention) in the real engine,
    TP=1 in-process: the stand-in writes and checks each layer through its own group's block table, a
    sliding-window layer only over the positions its attention reads. Pass 2 loads both groups' blocks
    from the store (asynchronously: vLLM refuses block-level load errors with several groups), and every
    output is the model's.

    A 64-block pool (a request holds about 30: 19 to 22 full-attention blocks, up to 9 in the window) and
    80 generated tokens make vLLM preempt (5 to 9 times in runs here; 40 tokens gave one, which is too
    close to none), resumed requests getting new tables for both groups; each pass adds
    "req-0".."req-5" itself, so pass 2 reuses pass 1's ids after they finished (as in the preemption
    test). Integrity off here: with the tag's CPU cost the saves hold their pins longer and vLLM waits for
    blocks instead of preempting (the scenario needs the preemption); the TP=2 test runs the default tag."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_hybrid_spec(tmp_path, tp=1, mp=0, connector=_connector(mooncake, trace, integrity="off"), num_blocks=64,
                                  max_tokens=HYBRID_PREEMPT_TOKENS, request_ids="fixed"),
                     timeout_s=180, name="tp1-hybrid")
    w = res["workers"][0]
    print(f"tp1 hybrid: start-up {res['startup_s']}s, total {res['total_s']}s, shutdown {res['shutdown_s']}s, "
          f"metrics {res['metrics']}, cached {[ps['num_cached_tokens'] for ps in res['passes']]}, "
          f"counts {w['counts']}, connector {w['connector']}")
    events = _check_hybrid_run(res, tp=1, trace=trace, max_tokens=HYBRID_PREEMPT_TOKENS)
    assert res["metrics"].get("num_preemptions", 0) > 0 and w["counts"].get("resumptions", 0) > 0, \
        "no preemption happened: that part of the scenario is void"
    ids = [f"req-{i}" for i in range(len(HYBRID_PROMPTS))]
    assert [ps["request_ids"] for ps in res["passes"]] == [ids, ids]
    assert Counter(e["req_id"] for e in events if e["action"] == "Finish")["req-0"] == 2


def test_tp2_mp_hybrid_sliding_window_engine_loads_both_groups_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """The same hybrid model at TP=2 with worker processes and EngineCore in its own process: each rank
    stores and loads both groups of its own KV heads, and checks what it loaded. Partial tails on: a
    prompt's tail is a key per group (each staged and tagged), and pass 2 loads all but the last token.
    Every prompt loads all but its last token, except one per deferred block vLLM evicted (`_lost_saves`);
    the block pin cap is above what PIN_CAP jobs pin here, so only the job cap defers saves."""
    trace = tmp_path / "trace.ndjson"
    conn = _connector(mooncake, trace, save_partial_tail=True, max_pinned_blocks=HYBRID_TP2_PIN_BLOCKS)
    res = run_engine(_hybrid_spec(tmp_path, tp=2, mp=1, connector=conn,
                                  shutdown_timeout_s=30), timeout_s=300, name="tp2-hybrid")
    print(f"tp2 hybrid: start-up {res['startup_s']}s, total {res['total_s']}s, shutdown {res['shutdown_s']}s, "
          f"metrics {res['metrics']}, cached {[ps['num_cached_tokens'] for ps in res['passes']]}, "
          f"connectors {[w['connector'] for w in res['workers']]}")
    _check_hybrid_run(res, tp=2, trace=trace)
    if not any(w["connector"]["num_load_blocks_failed"] for w in res["workers"]):
        cached = res["passes"][1]["num_cached_tokens"]
        tails = sum(n == len(p) - 1 for n, p in zip(cached, HYBRID_PROMPTS))  # all but the last token loaded
        assert tails >= len(HYBRID_PROMPTS) - _lost_saves(res), (cached, res["metrics"])


@pytest.mark.parametrize(("tp", "mp"), [pytest.param(1, 0, marks=ONE_VERSION), (2, 1)],
                         ids=["tp1", "tp2-mp"])
def test_gemma3_like_hybrid_engine_loads_every_group_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path, tp: int,
        mp: int) -> None:
    """A Gemma-3-like hybrid (6 layers, five sliding-window layers to one full-attention layer: vLLM plans one
    KV cache group per layer) in the real engine: each group's blocks stored under its own keys and loaded
    in pass 2, each layer checked where its attention reads. A request holds a block per group for its
    window in each sliding group: about 4 times a dense model's blocks (a 400-block pool). At TP 1 a pool of
    GEMMA3_PREEMPT_BLOCKS and GEMMA3_PREEMPT_TOKENS generated tokens make vLLM preempt (11 and 12 times in
    two runs here), and pass 2 reuses pass 1's request ids (integrity off, as in the gpt-oss-like TP 1 run)."""
    trace = tmp_path / "trace.ndjson"
    over: dict[str, Any] = {"num_blocks": 400}
    extra: dict[str, Any] = {"max_pinned_blocks": 400}
    if tp == 1:
        over = {"num_blocks": GEMMA3_PREEMPT_BLOCKS, "max_tokens": GEMMA3_PREEMPT_TOKENS, "request_ids": "fixed",
                "max_model_len": 480}
        extra = {"max_pinned_blocks": GEMMA3_PREEMPT_BLOCKS, "integrity": "off"}
    res = run_engine(_hybrid_spec(tmp_path, tp=tp, mp=mp, connector=_connector(mooncake, trace, **extra),
                                  num_layers=6, full_every=6, shutdown_timeout_s=30, **over),
                     timeout_s=300, name=f"tp{tp}-gemma3")
    w = res["workers"][0]
    print(f"tp{tp} gemma3-like: start-up {res['startup_s']}s, total {res['total_s']}s, metrics {res['metrics']}, "
          f"cached {[ps['num_cached_tokens'] for ps in res['passes']]}, counts {w['counts']}")
    _check_hybrid_run(res, tp=tp, trace=trace, groups=GEMMA3_GROUPS,
                      max_tokens=GEMMA3_PREEMPT_TOKENS if tp == 1 else MAX_TOKENS)
    if tp == 1:
        assert res["metrics"].get("num_preemptions", 0) > 0 and w["counts"].get("resumptions", 0) > 0, \
            "no preemption happened: that part of the scenario is void"
        ids = [f"req-{i}" for i in range(len(HYBRID_PROMPTS))]
        assert [ps["request_ids"] for ps in res["passes"]] == [ids, ids]


#: a Mistral-like model: every layer attends to the last UNIFORM_WINDOW tokens (`full_every` 0), one KV cache group
UNIFORM_WINDOW = 64
UNIFORM_GROUPS = [{"spec": "SlidingWindowSpec", "sliding_window": UNIFORM_WINDOW, "layers": [0, 1]}]


@REAL_MODEL_COVERS
def test_tp1_uniform_sliding_window_engine_loads_its_one_group_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """A model whose every layer has the same sliding window (Mistral-7B-v0.1-like: the config declares
    `sliding_window` without `layer_types`, vLLM copies it into CacheConfig.sliding_window) in the real engine,
    TP=1 in-process: vLLM plans ONE KV cache group with a SlidingWindowSpec, run by its sliding-window
    manager, which puts its null block in the table wherever a block left the window (a connector that takes
    the lone group for full attention pins and loads into the null block and crashes at the first store hit).
    The 300-token prompts
    are longer than the 64-token window; pass 2 (after reset_prefix_cache) loads from the store, every prompt
    from at least its 256-token shared prefix; each layer checks the positions its attention reads; outputs
    are the model's; nothing is left held. The cheapest run that shows it (2 layers, 6 tokens generated)."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_hybrid_spec(tmp_path, tp=1, mp=0, connector=_connector(mooncake, trace),
                                  sliding_window=UNIFORM_WINDOW, full_every=0, num_layers=2, num_blocks=64),
                     timeout_s=180, name="tp1-uniform-sliding")
    w = res["workers"][0]
    print(f"tp1 uniform sliding window: start-up {res['startup_s']}s, total {res['total_s']}s, "
          f"metrics {res['metrics']}, cached {[ps['num_cached_tokens'] for ps in res['passes']]}, "
          f"counts {w['counts']}, connector {w['connector']}")
    _check_hybrid_run(res, tp=1, trace=trace, groups=UNIFORM_GROUPS)  # HMA on, the one group, hits, at rest


#: the KV cache groups vLLM plans for the Jamba-like stand-in (4 layers: Mamba mixers 0 and 2, attention 1 and 3)
MAMBA_GROUPS = [{"spec": "MambaSpec", "sliding_window": None, "layers": [0, 2]},
                {"spec": "FullAttentionSpec", "sliding_window": None, "layers": [1, 3]}]


@pytest.mark.parametrize(("tp", "mp"), [(1, 0), pytest.param(2, 1, marks=ONE_VERSION)], ids=["tp1", "tp2-mp"])
def test_mamba_hybrid_engine_loads_its_state_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path, tp: int,
        mp: int) -> None:
    """A Jamba-like Mamba hybrid (Mamba in vLLM's "align" mode) in the real engine, the hybrid manager on: the
    stand-in aligns the block size as the engine does for a real model (16 -> 32), each mixer writes its
    chunk's final state where align mode keeps it and checks the state a request starts from. The connector
    saves the boundary states vLLM hands off and the attention blocks; pass 2 hits at the prompts' last
    state and loads it with the attention blocks before it; outputs are the model's. At TP 1 a small pool
    and 80 generated tokens make vLLM preempt (the resumed request re-reads its state), and pass 2 reuses
    pass 1's request ids.

    At TP 2 the block pin cap is above what PIN_CAP jobs pin here, so only the job cap defers saves. Deferred
    jobs keeping their state offers are shown by the harness (`test_mamba_hybrid.py`, one job at a time)."""
    trace = tmp_path / "trace.ndjson"
    over: dict[str, Any] = {"mamba": True}
    if tp == 1:
        over.update(num_blocks=64, max_tokens=HYBRID_PREEMPT_TOKENS, request_ids="fixed")
    # TP 1: integrity off, as the gpt-oss-like TP 1 run (preemption needs fast saves)
    extra = {"integrity": "off"} if tp == 1 else {"max_pinned_blocks": HYBRID_TP2_PIN_BLOCKS}
    res = run_engine(_hybrid_spec(tmp_path, tp=tp, mp=mp, connector=_connector(mooncake, trace, **extra),
                                  shutdown_timeout_s=30, **over), timeout_s=300, name=f"tp{tp}-mamba")
    w = res["workers"][0]
    print(f"tp{tp} mamba: start-up {res['startup_s']}s, total {res['total_s']}s, metrics {res['metrics']}, "
          f"cached {[ps['num_cached_tokens'] for ps in res['passes']]}, counts {w['counts']}")
    _check_hybrid_run(res, tp=tp, trace=trace, groups=MAMBA_GROUPS,
                      max_tokens=HYBRID_PREEMPT_TOKENS if tp == 1 else MAX_TOKENS)
    assert all(r["counts"].get("states_checked", 0) > 0 for r in res["workers"])  # loaded or kept states read
    if tp == 1:
        assert res["metrics"].get("num_preemptions", 0) > 0 and w["counts"].get("resumptions", 0) > 0, \
            "no preemption happened: that part of the scenario is void"
        ids = [f"req-{i}" for i in range(len(HYBRID_PROMPTS))]
        assert [ps["request_ids"] for ps in res["passes"]] == [ids, ids]
