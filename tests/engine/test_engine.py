"""The connector inside vLLM 0.32's REAL engine: `LLM` → `EngineCore` → executor → workers.

The model is the only stand-in (`testbed.emu_worker.EmuWorker`, passed as `worker_cls`): everything else —
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
- the connector's trace log is accepted by TLC (conformance.runlog), ending at rest.

Runs: TP=1 in-process (vLLM's default layout, and LHBNC), TP=2 with worker processes and EngineCore in its
own process, and TP=1 with a pool small enough that vLLM preempts.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance import runlog, tracecheck
from connector.embedded import EmbeddedMooncake
from testbed.emu_model import VOCAB, expected_output

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
BLOCK_SIZE = 16
PIN_CAP = 16  # max_inflight_jobs: the trace check's BoundedPins bound


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


def _connector(mc: EmbeddedMooncake, trace: Path) -> dict[str, Any]:
    return {"policy": "recompute", "extra": {
        "master_server_address": mc.master_address, "metadata_server": mc.metadata_server,
        "global_segment_size": "32MB", "local_buffer_size": "4MB", "max_inflight_jobs": PIN_CAP,
        "max_pinned_blocks": 64, "trace_path": str(trace)}}


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


def _check_run(res: dict[str, Any], *, tp: int, trace: Path, baseline: list[list[int]] | None,
               max_tokens: int = MAX_TOKENS) -> None:
    want = [expected_output(p, max_tokens) for p in PROMPTS]
    if baseline is not None:
        assert baseline == want, "the engine without a connector does not produce the emulated model's outputs"
    for n, ps in enumerate(res["passes"]):
        assert ps["outputs"] == want, f"pass {n}: outputs differ from the model's"
    assert res["passes"][1]["reset"]["done"], f"reset_prefix_cache() never succeeded before pass 2: {res['passes'][1]}"

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
        assert c["num_load_blocks_failed"] == 0, f"{who} failed load blocks: {c}"
        assert c["num_saves_run"] > 0, f"{who} saved nothing: {c}"
        assert not c["pending_work"], f"{who} has pending connector work at the end"

    # pass 2 starts from an empty local cache: its hits are the store's
    hits = res["metrics"].get("external_prefix_cache_hits", 0)
    assert hits >= len(PROMPTS) * BLOCK_SIZE, f"vLLM counted {hits} tokens loaded from the store"
    assert sum(res["passes"][1]["num_cached_tokens"]) > sum(res["passes"][0]["num_cached_tokens"])

    assert res["at_rest"]["done"], f"blocks still held at the end (reset_prefix_cache failed): {res['at_rest']}"
    eng = res["engine"]
    if eng is not None:  # EngineCore in the driver's process: its pool and pins are readable
        assert eng["free_blocks"] == eng["num_blocks"] - 1 and not eng["held_blocks"], eng
        assert not eng["pinned_jobs"] and eng["load_pins"] == 0, eng
        assert eng["jobs_opened"] == eng["jobs_released"] > 0, eng

    events = tracecheck.read_log(trace)
    v = runlog.check_events(events, pin_cap=PIN_CAP, expect_rest=True)
    assert v.accepted, f"{v.line(trace.name)} [log kept: {trace}]"


@pytest.mark.parametrize("layout", [None, "LHBNC"], ids=["default-layout", "LHBNC"])
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
    assert not res["stragglers"], f"engine processes left after exit (log {res['log']})"


def test_tp2_mp_engine_loads_prefixes_from_the_store(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    """MultiprocExecutor with 2 worker processes (gloo TP group), EngineCore in its own process
    (VLLM_ENABLE_V1_MULTIPROCESSING=1): three processes append to ONE trace file. Their events interleave
    in the file in real-time order; each process writes and flushes an event before any message that
    depends on it leaves the process, so the file order respects causality (`seq` restarts per process
    and is not used by the check)."""
    trace = tmp_path / "trace.ndjson"
    # vLLM's client gives EngineCore 5 s to exit; its workers need about 4 s here (interpreter teardown,
    # with or without a connector), after which EngineCore still has to shut the scheduler-side connector
    # down: a longer bound lets it (else vLLM force-kills EngineCore mid-teardown)
    res = run_engine(_spec(tmp_path, tp=2, mp=1, connector=_connector(mooncake, trace), shutdown_timeout_s=30),
                     timeout_s=300, name="tp2")
    print(f"tp2: start-up {res['startup_s']}s, total {res['total_s']}s, shutdown {res['shutdown_s']}s, "
          f"metrics {res['metrics']}")
    _check_run(res, tp=2, trace=trace, baseline=baseline)
    assert not res["stragglers"], f"engine processes left after exit (log {res['log']})"


def test_tp1_engine_with_preemptions_keeps_kv_right(
        mooncake: EmbeddedMooncake, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """A 16-block pool and 40 generated tokens per request: vLLM preempts running requests (their blocks
    go back to the pool while store jobs may still pin them) and resumes them with new block tables. Every
    resumed request is re-checked from position 0 by the worker; stale store jobs of old generations are
    reported and run nothing."""
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, tp=1, mp=0, connector=_connector(mooncake, trace), num_blocks=16,
                           max_tokens=40, max_model_len=128), timeout_s=180, name="tp1-preempt")
    print(f"tp1 preemptions: total {res['total_s']}s, metrics {res['metrics']}, "
          f"counts {res['workers'][0]['counts']}, connector {res['workers'][0]['connector']}")
    assert res["metrics"].get("num_preemptions", 0) > 0, "no preemption happened: the scenario is void"
    assert res["workers"][0]["counts"].get("resumptions", 0) > 0
    _check_run(res, tp=1, trace=trace, baseline=None, max_tokens=40)
    assert not res["stragglers"], f"engine processes left after exit (log {res['log']})"
