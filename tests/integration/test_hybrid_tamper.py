"""A tampered store under a hybrid model: vLLM's real Scheduler with its hybrid KV cache manager on,
the harness's gpt-oss-like stand-in (4 layers alternating a 64-token sliding window and full attention: two
KV cache groups), a 48-block pool, a real Mooncake master. Another store client overwrites every stored value
with same-size random bytes at the steps that park a request in WAITING_FOR_REMOTE_KVS, after the lookup and
before the load (`testbed.faults.run_pass_with_a_tampered_store`). The integrity tag turns each forged object
into a load error; with two groups a failed load is reported per request (vLLM's ``failed_recving``).

The stall it found: under ``recompute`` vLLM sets such a request's computed tokens to 0, frees all its blocks
when it promotes it, and leaves it at the head of its queue of KV-holding requests (``kv_holding_waiting``),
where it must now fit its whole prompt. A request parked behind it holds the blocks it needs, and is never
looked at, though its own load has finished: ``schedule()`` stops at the head every step (running 0, no
connector pin held, the parked request's blocks never freed). Two requests parked in one step are enough.
The connector answers such a request's next lookup "not yet" once (`requeue_after_failed_load`): vLLM moves
it to its plain waiting queue and the parked requests go on.

The fault table's tamper row for the other model shapes, under both policies: a Mamba hybrid (the state
key at a hit's end forged too) and the TP-shared layout (a block stored as several keys, one of them forged:
the block is not loaded, reported per block).
"""
from __future__ import annotations

import random

import pytest

from kvledger_connector.config import StoreConfig
from testbed.faults import run_pass_with_a_tampered_store
from testbed.harness import Harness, shared_prefix_prompts

W = 64
BS = 16
NUM_BLOCKS = 48
STALL_S = 10.0  # a stall fails the test in this long (the harness's HarnessStallError), never hangs it

# Two prompts of their own prefixes, 267 and 323 tokens: their second pass parks both loads in one step
# (16 + 4 and 20 + 4 blocks of the two groups); once the first load fails, the first request needs more than
# the 23 blocks the second one leaves free
TWO = [p[:n] for p, n in zip(shared_prefix_prompts(2, num_prefixes=2, prefix_len=256, suffix_len=67, seed=5),
                             (267, 323))]
# The operator's run, smaller: 4 shared prefixes, prompts of 17 to 24 blocks (there 60 of them, 4 rounds)
_rng = random.Random(0)
MANY = [p[:256 + _rng.randrange(1, 131)]
        for p in shared_prefix_prompts(8, num_prefixes=4, prefix_len=256, suffix_len=130, seed=0)]


def _hybrid(store_config: StoreConfig, **kw) -> Harness:
    return Harness(store_config, sliding_window=W, block_size=BS, num_layers=4, num_blocks=NUM_BLOCKS,
                   stall_timeout_s=STALL_S, **kw)


def _mismatches(h: Harness) -> int:
    return sum(w.stats.total("integrity_mismatches") for w in h.workers)


def test_a_request_whose_load_failed_whole_does_not_stall_a_parked_load_behind_it(store_config: StoreConfig):
    tp_size = 1
    with _hybrid(store_config, tp_size=tp_size) as h:
        h.run_pass(TWO, 4, tag="a")
        h.scheduler.reset_prefix_cache()  # pass b's hits come from the store
        # outputs, S7 (no wrong KV read) and rest (no block, pin or load left) checked by run_pass
        log = run_pass_with_a_tampered_store(h, TWO, 4, "b", rounds=1)
        (step, overwritten, parked), = log.rounds
        assert parked == 2  # both loads parked in the step the store was tampered in
        # every stored key of both prompts on every rank: each full block's full-attention key (16 + 20), the
        # sliding-window keys of the window behind each prompt's hit (4 + 4)
        assert overwritten == tp_size * (16 + 20 + 4 + 4)
        assert _mismatches(h) > 0 and h.stats.load_error_blocks == 0  # per request, not per block
        assert sorted(h.stats.finished) == ["a-0", "a-1", "b-0", "b-1"]
        assert h.garbage == [] and h.check_at_rest() == []


def test_repeated_tampering_under_recompute_finishes_every_request_with_the_models_outputs(
        store_config: StoreConfig):
    with _hybrid(store_config, tp_size=2) as h:
        h.run_pass(MANY, 4, tag="a")
        h.scheduler.reset_prefix_cache()
        log = run_pass_with_a_tampered_store(h, MANY, 4, "b", rounds=4)  # outputs, S7, rest checked
        assert len(log.rounds) == 4 and log.keys_overwritten > 0
        assert _mismatches(h) > 0
        assert sum(r.startswith("b-") for r in h.stats.finished) == len(MANY)
        assert h.garbage == [] and h.check_at_rest() == []


def test_tampering_under_fail_ends_the_requests_whose_loads_failed_and_rests(store_config: StoreConfig):
    with _hybrid(store_config, tp_size=2, policy="fail") as h:
        h.run_pass(TWO, 4, tag="a")
        h.scheduler.reset_prefix_cache()
        log = run_pass_with_a_tampered_store(h, TWO, 4, "b", rounds=1, check_outputs=False)
        assert [parked for _, _, parked in log.rounds] == [2] and _mismatches(h) > 0
        finished = {r: why for r, why in h.stats.finished.items() if r.startswith("b-")}
        assert sorted(finished) == ["b-0", "b-1"]
        assert all("error" in why.lower() for why in finished.values()), finished  # both loads read forged bytes
        assert h.garbage == [] and h.check_at_rest() == []


def _finished_b(h: Harness) -> dict[str, str]:
    return {r: why for r, why in h.stats.finished.items() if r.startswith("b-")}


MAMBA_PROMPTS = shared_prefix_prompts(4, num_prefixes=2, prefix_len=96, suffix_len=37, seed=11)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_tampered_store_under_a_mamba_hybrid_is_a_load_error_never_a_stall(store_config: StoreConfig,
                                                                             policy: str):
    """The Jamba-like stand-in (Mamba in "align" mode beside attention): every object forged, state keys too.
    Under recompute every request ends with the model's outputs; under fail the ones whose loads read forged
    bytes end with an error; none reads wrong KV or state, nothing is held at the end."""
    with Harness(store_config, mamba=True, num_layers=4, num_blocks=96, max_num_batched_tokens=64,
                 policy=policy, stall_timeout_s=STALL_S) as h:
        h.run_pass(MAMBA_PROMPTS, 4, tag="a")
        h.scheduler.reset_prefix_cache()
        log = run_pass_with_a_tampered_store(h, MAMBA_PROMPTS, 4, "b", rounds=2,
                                             check_outputs=policy == "recompute")
        assert log.rounds and log.keys_overwritten > 0 and _mismatches(h) > 0
        finished = _finished_b(h)
        assert len(finished) == len(MAMBA_PROMPTS)
        if policy == "fail":
            assert any("error" in why.lower() for why in finished.values()), finished
        assert h.garbage == [] and h.check_at_rest() == []


TP_SHARED_HEADS = 4  # the model's KV heads; each rank holds 2 at TP 2, a key per head


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_one_forged_key_of_a_block_stored_as_several_fails_the_block(store_config: StoreConfig, policy: str):
    """The TP-shared layout (``kv_heads_per_key`` 1): a block is one key per KV head. Only each block's first
    head is forged: the block is not loaded (its other keys load fine), reported per block; under recompute
    vLLM recomputes from it, under fail the request ends with an error."""
    # every load asynchronous (under "fail" too): the forger acts while a request waits for its load
    with Harness(store_config, tp_size=2, num_kv_heads=TP_SHARED_HEADS // 2, num_blocks=48, policy=policy,
                 extra={"kv_heads_per_key": 1, "sync_load_max_tokens": 0}, stall_timeout_s=STALL_S) as h:
        assert len(h.workers[0].worker_side.steps.block_shape().builders) == 2  # two keys per block on each rank
        h.run_pass(TWO, 4, tag="a")
        h.scheduler.reset_prefix_cache()
        log = run_pass_with_a_tampered_store(h, TWO, 4, "b", rounds=1, parts=frozenset({0}),
                                             check_outputs=policy == "recompute")
        assert log.keys_overwritten > 0 and _mismatches(h) > 0
        assert h.stats.load_error_blocks > 0  # one full-attention group: failed blocks reported by block
        finished = _finished_b(h)
        assert sorted(finished) == ["b-0", "b-1"]
        if policy == "fail":
            assert all("error" in why.lower() for why in finished.values()), finished
        assert h.garbage == [] and h.check_at_rest() == []
