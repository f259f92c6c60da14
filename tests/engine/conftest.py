"""Engine fixtures: a Mooncake master on 127.0.0.1 (stopped by pid) and `run_engine`, which runs one vLLM
engine (testbed/engine_run.py) in a subprocess with a hard timeout, so a hung engine fails its test instead
of stalling CI.

The subprocess gets its own session: on timeout the whole process group (the engine, its EngineCore and
worker processes) is sent SIGTERM, then SIGKILL, by that group's id. After the driver exits, any process
still in its session or group is a straggler (`result["stragglers"]`: pids and command lines).

`on_barrier(n)`: for specs with a `barrier` (testbed/engine_run.py), called in the test's process while the
engine waits before pass n (e.g. to restart the Mooncake master), then the engine is let go.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.store.embedded import EmbeddedMooncake
from testbed.procs import group_alive, kill_group, mooncake_servers, session_members

ROOT = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "ENGINE_RUN_RESULT "  # testbed.engine_run.RESULT_PREFIX (not imported: it would load vLLM here)

#: the environment the reference run of vLLM's engine on a CPU-only machine needs
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@pytest.fixture(scope="module")
def mooncake() -> Iterator[EmbeddedMooncake]:
    """One master + metadata server for the module's engines (each test uses its own model dir, which
    is part of every key, so tests never share keys)."""
    with mooncake_servers(rpc_timeout_ms=2000) as mc:
        yield mc


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """The engine's whole process group (vLLM's own shutdown gives workers 5 s)."""
    kill_group(proc.pid, grace_s=grace_s, done=lambda: proc.poll() is not None)


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


@pytest.fixture(scope="module")
def run_engine(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """run_engine(spec, timeout_s=, name=, env=, on_barrier=, expect_exit=) -> the driver's result dict (+
    "log", "stragglers", "barriers"); the spec and the engine's log are kept in a temp dir named after `name`;
    `env` adds environment variables. `expect_exit`: the engine is expected to stop without a result (a
    refusal): {"rc", "log", "stragglers"} instead of a failed test."""
    def run(spec: dict[str, Any], *, timeout_s: float, name: str = "engine",
            env: dict[str, str] | None = None,
            on_barrier: Callable[[int], str | None] | None = None, expect_exit: bool = False) -> dict[str, Any]:
        where = tmp_path_factory.mktemp(name)
        spec_path = where / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log = where / "engine.log"
        env = {**os.environ, **ENGINE_ENV, **(env or {}),
               "VLLM_ENABLE_V1_MULTIPROCESSING": str(spec.get("mp", 0))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "testbed.engine_run", str(spec_path)], cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            barrier = spec.get("barrier")
            pending = sorted(barrier.get("passes", ())) if barrier else []
            barriers: dict[int, float] = {}
            deadline = time.monotonic() + timeout_s
            try:
                while (rc := proc.poll()) is None:
                    if time.monotonic() > deadline:
                        _kill_group(proc)
                        pytest.fail(f"{name}: engine still running after {timeout_s}s (killed); log {log}:\n"
                                    f"{_tail(log)}", pytrace=False)
                    if pending and Path(barrier["dir"], f"before-pass-{pending[0]}").exists():
                        n = pending.pop(0)
                        t0 = time.monotonic()
                        note = on_barrier(n) if on_barrier is not None else None
                        barriers[n] = round(time.monotonic() - t0, 2)
                        Path(barrier["dir"], f"go-pass-{n}").write_text(note or "")
                    time.sleep(0.1)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        # processes of the engine still alive 3 s after the driver exited (its session and group outlive it)
        deadline = time.monotonic() + 3.0
        while (stragglers := session_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if stragglers or group_alive(proc.pid):
            _kill_group(proc)
        if expect_exit:  # an engine the test expects to refuse or fail: its exit status and log are the result
            return {"rc": rc, "log": str(log), "stragglers": stragglers}
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(RESULT_PREFIX)]
        if rc != 0 or not lines:
            pytest.fail(f"{name}: engine exited {rc} without a result; log {log}:\n{_tail(log)}", pytrace=False)
        result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX):])
        result["log"] = str(log)
        result["stragglers"] = stragglers
        result["barriers"] = barriers
        return result
    return run
