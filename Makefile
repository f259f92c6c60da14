# kvledger — every target does its own set-up (idempotent, seconds when done).
SHELL := /bin/bash
PY    := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONDONTWRITEBYTECODE := 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup verify verify-deep witness test test-vllm033 test-fast gen diagram bench demo demo-standin fuzz clean

setup:
	@scripts/setup.sh

# The main job: TLC model check (fixed design passes, legacy design and mutants fail as expected),
# the witnesses (no invariant holds vacuously), then conformance (replay of TLC behaviours against the
# real connector, trace validation).
verify: setup
	$(PY) -m conformance.verify

verify-deep: setup
	$(PY) -m conformance.model_check --deep

# verify's witness stage alone: TLC must reach the hazard of every invariant in a CI config.
witness: setup
	$(PY) -m conformance.witness

# A failing suite's failed tests are repeated last (scripts/summarized.sh): what its processes print while
# they exit would bury pytest's summary in a log's tail.
SUMMARIZED = scripts/summarized.sh

# The whole suite (scripts/tracks.sh: each command's output printed whole when it ends, every command run
# even after a failure, a status line per command at the end). First two tracks side by side, one per core:
# vLLM 0.32's integration and unit suites; 0.32's model and conformance suites, the pure core again under
# python -O (safety checks must raise, never assert) and 0.33's suites but the engine's. Then the engine
# suites of 0.32 and 0.33 alone: an engine's busy-polling processes beside another suite starve its
# Mooncake master for seconds. 0.32's (vLLM's CPU build) runs real models (tests/engine/test_real_*.py) and
# the stand-in worker only where a real model cannot; 0.33's (the CUDA wheel: no real model) the stand-in. Each pytest run names its slowest tests. The disk tier's suites run on the
# second track, the shorter one.
PYTEST = -m pytest -q -rfE -p no:cacheprovider --durations=12
TIER = tests/integration/test_disk_tier.py tests/integration/test_disk_tier_connector.py
test: setup
	scripts/tracks.sh "$(PY) $(PYTEST) tests/integration tests/unit $(TIER:%=--ignore=%)" -- \
		"$(PY) $(PYTEST) tests/model tests/conformance" "$(PY) -O $(PYTEST) tests/unit" "$(PY) $(PYTEST) $(TIER)" \
		"$(TEST033) $(SUITES033)" == "$(PY) $(PYTEST) tests/engine" "$(TEST033) tests/engine"

# vLLM 0.33.0 (.venv033, layered on .venv by setup): the suites of vLLM's connector API, Scheduler/BlockPool,
# KV cache planning and allocation, the harness and the real engine. The fault/bounds/replay suites run on 0.32 only.
TEST033 = env KVLEDGER_EXPECT_VLLM=0.33.0 .venv033/bin/python $(PYTEST)
SUITES033 = tests/integration/test_vllm_versions.py tests/unit/test_scheduler.py tests/unit/test_refcount_property.py \
	tests/integration/test_connector_e2e.py tests/integration/test_sync_loads.py tests/integration/test_connector_worker.py \
	tests/integration/test_kv_layouts.py tests/integration/test_keys.py tests/integration/test_connector_config.py \
	tests/integration/test_replicated_kv.py tests/integration/test_hybrid_kv.py tests/integration/test_mamba_hybrid.py
test-vllm033: setup
	$(SUMMARIZED) $(TEST033) $(SUITES033) tests/engine

gen: setup
	$(PY) -m spec.gen

diagram: setup
	$(PY) -m spec.diagram

bench: setup
	$(PY) -m bench

# A real model (random weights, vLLM's CPU build) with and without the connector: tokens from the store,
# outputs equal (testbed/real_demo.py). The stand-in workload through vLLM's real engine at TP=2 with faults
# and a trace check: make demo-standin; the in-process harness demo over vLLM's Scheduler that `make verify`
# checks: python -m testbed.demo
demo: setup
	$(PY) -m testbed.real_demo

demo-standin: setup
	$(PY) -m testbed.engine_demo

fuzz: setup
	$(PY) -m pytest -q tests/conformance -k fuzz --hypothesis-profile=fuzz -s

clean:
	rm -rf .tlc-out .tlctmp states
