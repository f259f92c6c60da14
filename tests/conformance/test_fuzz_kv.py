"""Stateful fuzzing of the real system with TLC's graph of KVLedger as the oracle: kvledger's
ledgers on vLLM's BlockPool, torch KV rows and a real Mooncake master (tests/conformance/kv/
MC_replay_tiny.cfg: every store fault kind, one preemption). Each fuzzed move must be an edge of the
graph from the current state (or be refused, changing nothing, where there is none), and S1-S3,
S5-S8 are checked on the implementation after every step (S4 through the oracle's comparison of
live sets, offsets and skip flags). Derandomized under the ci profile; `make fuzz` (profile fuzz)
runs longer with a printed seed: rerun with `--hypothesis-seed=SEED` to replay."""
from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
from hypothesis import seed, settings
from hypothesis.stateful import run_state_machine_as_test

from conformance.engine import export as ex
from conformance import mutants
from conformance.engine.fuzz import OracleError, oracle_machine
from conformance.kvdriver import KVDriver
from kvledger.errors import LedgerInvariantError

ROOT = Path(__file__).resolve().parents[2]
CFG = Path(__file__).parent / "kv" / "MC_replay_tiny.cfg"


@pytest.fixture(scope="module")
def kv_graph() -> ex.Export:
    graph, _ = ex.dump_graph(ROOT / "tla", "KVLedger", str(CFG))
    return ex.Export("KVLedger", str(CFG), graph, [], ex.cfg_constants(CFG))


def _machine(exp: ex.Export, backend):
    return oracle_machine(exp, lambda: KVDriver(backend, exp.consts))


def test_fuzz_kvledger_oracle(kv_graph: ex.Export, mooncake_backend, request) -> None:
    machine = _machine(kv_graph, mooncake_backend)
    # every fault kind and every action of the model is in the universe of moves
    names = {a["name"] for a in machine.universe}
    assert {"Admit", "EmitStore", "Preempt", "Receive", "DmaRead", "Put", "Report", "Collect", "Load",
            "HandleLoadErrors", "Evict", "StoreFail", "StoreRestart", "DropGeneration"} <= names
    prof = settings()
    if prof.derandomize:  # CI: fixed, about a minute
        run_state_machine_as_test(machine, settings=settings(prof, max_examples=60, stateful_step_count=40))
        return
    s = request.config.getoption("hypothesis_seed", None)
    s = int(s) if s is not None else random.randrange(1 << 32)
    print(f"\n[fuzz] KVLedger oracle, seed {s}: replay with "
          f"pytest tests/conformance/test_fuzz_kv.py --hypothesis-profile=fuzz --hypothesis-seed={s}")
    run_state_machine_as_test(seed(s)(machine), settings=settings(prof, stateful_step_count=60))


def test_fuzz_kvledger_finds_no_pin_mutant(kv_graph: ex.Export, mooncake_backend) -> None:
    machine = _machine(kv_graph, mooncake_backend)
    with contextlib.ExitStack() as stack:
        for obj, attr, make in mutants.MUTANTS["no_pin"]:
            stack.enter_context(mutants.patched(obj, attr, make))
        with pytest.raises((OracleError, LedgerInvariantError)):
            run_state_machine_as_test(machine, settings=settings(max_examples=200, stateful_step_count=40))
