"""Shutting the worker side down under load never crashes the process.

Measured on mooncake-transfer-engine-non-cuda: closing a `MooncakeDistributedStore` while another thread is
inside one of its calls, or calling it after `close()`, kills the process inside Mooncake (SIGSEGV here,
SIGABRT in other runs of the same teardown), so the connector must never do either. `WorkerSide.shutdown`
is bounded and may leave a thread inside a store call (a hung master); `MooncakeStore.close` then leaks
the client instead of closing it under that call.

Each scenario runs in a child process (this file run as a script) so a crash shows as a failed test with
the child's output, not a dead pytest. The child uses real parts only: the session's mooncake_master, real
`MooncakeStore` clients, `WorkerSide` with vLLM-allocated KV caches (testbed.kvcache); the hung-master case
stops a private master with SIGSTOP.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BS, LAYERS, HEADS, HD, NBLOCKS = 16, 2, 2, 8, 32
LAYOUT = "LBNHC"


# ---------------------------------------------------------------------------------------------- child
def _engine(tmp: str):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    from testbed.harness import write_model_dir
    from testbed.kvcache import attention_specs, build_kv_cache_config

    model = write_model_dir(tmp, num_layers=LAYERS, num_kv_heads=HEADS, head_size=HD)
    vc = VllmConfig(model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                             dtype="float32", seed=0, max_model_len=256),
                    cache_config=CacheConfig(block_size=BS), parallel_config=ParallelConfig(tensor_parallel_size=1),
                    device_config=DeviceConfig("cpu"))
    specs = attention_specs(LAYERS, block_size=BS, num_kv_heads=HEADS, head_size=HD)
    return vc, build_kv_cache_config(vc, specs, NBLOCKS, LAYOUT)


def _worker(engine, store, cfg, salt: str, **cfg_changes):
    from kvledger_connector.connector import key_layout
    from kvledger_connector.shape.block_shape import BlockShape
    from kvledger_connector.shape.keys import KeyBuilder
    from kvledger_connector.shape.kvlayout import plan_block_copies
    from kvledger_connector.config import ConnectorConfig
    from kvledger_connector.worker.side import WorkerSide
    from testbed.kvcache import allocate

    vc, kv_cfg = engine
    config = cfg.replace(**cfg_changes) if cfg_changes else cfg
    layout = dataclasses.replace(key_layout(vc, kv_cfg, 0), model=f"shutdown-{salt}")
    ws = WorkerSide(ConnectorConfig(store=config, block_size=BS, load_threads=2), store=store,
                    shape=BlockShape.of_keys([KeyBuilder(layout, config.max_key_bytes)]), tp_rank=0, max_requests=64)
    caches = allocate(kv_cfg, LAYOUT)
    ws.register_kv_caches(plan_block_copies(caches, layout=LAYOUT, block_size=BS, num_blocks=NBLOCKS))
    return ws, caches


def _drive(ws, salt: str, stop: threading.Event) -> None:
    """The model runner's side: every step saves 4 blocks and loads the previous step's 4, until `stop`."""
    import hashlib

    from kvledger_connector.metadata import DropNotice, KVLedgerConnectorMetadata, LoadSpec, SaveSpec

    def h(i: int) -> bytes:
        return hashlib.sha256(f"{salt}/{i}".encode()).digest()

    step = 0
    while not stop.is_set():
        ids = tuple(1 + (4 * step + j) % (NBLOCKS - 1) for j in range(4))
        prev = tuple(1 + (4 * (step - 1) + j) % (NBLOCKS - 1) for j in range(4))
        loads = [LoadSpec(f"l{step}", prev, tuple(h(4 * (step - 1) + j) for j in range(4)))] if step else []
        ws.end_step(KVLedgerConnectorMetadata(
            step=step, loads=loads, drops=[DropNotice(f"s{step - 1}", None, True)] if step else [],
            saves=[SaveSpec(f"s{step}", step, 0, 0, 4, ids, tuple(h(4 * step + j) for j in range(4)))]))
        ws.take_report()
        step += 1
        time.sleep(0.001)


def _one_shutdown(engine, cfg, it: int, rng: random.Random) -> dict:
    """One client and worker: load, then shutdown racing the load (sometimes from two threads, sometimes with
    the store closed at the same time), then close the store."""
    from kvledger_connector.store.client import MooncakeStore

    t0 = time.monotonic()
    store = MooncakeStore.connect(cfg)
    salt = f"{os.getpid()}-{it}"
    ws, _caches = _worker(engine, store, cfg, salt, store_queue_size=4, load_queue_size=4)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(ws, salt, stop), daemon=True)
    driver.start()
    time.sleep(rng.uniform(0.02, 0.15))
    timeout = rng.choice([0.0, 0.005, 0.05, 5.0])
    extra = []
    if it % 3 == 1:  # a second shutdown from another thread, at once
        extra.append(threading.Thread(target=ws.shutdown, args=(timeout,)))
    if it % 3 == 2:  # the store's owner closes the client while the threads are still running calls
        extra.append(threading.Thread(target=store.close, kwargs={"timeout_s": 5.0}))
    stop.set()
    for t in extra:
        t.start()
    t1 = time.monotonic()
    clean = ws.shutdown(timeout)
    shutdown_s = time.monotonic() - t1
    for t in extra:
        t.join(30)
    driver.join(30)
    again = ws.shutdown(0.0)  # idempotent: repeats the first result
    t2 = time.monotonic()
    closed = store.close(timeout_s=5.0)
    close_s = time.monotonic() - t2
    for t in ws._threads:  # the threads end on their own once their calls return
        t.join(10)
    return {"it": it, "secs": round(time.monotonic() - t0, 2), "shutdown_s": round(shutdown_s, 3),
            "close_s": round(close_s, 3), "timeout": timeout, "clean": clean, "again": again, "closed": closed,
            "leaked": store.stats.total("store_close_leaked"), "left_running": ws.num_threads_left_running,
            "alive_after": sum(t.is_alive() for t in ws._threads), "calls_inside": store.calls_inside,
            "driver_alive": driver.is_alive(), "errors": [e for e in ws.steps.errors if "still running" not in e]}


def child_stress(args: argparse.Namespace) -> None:
    import tempfile

    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.client import MooncakeStore

    engine = _engine(tempfile.mkdtemp(prefix="shutdown-model-"))
    base = StoreConfig(global_segment_size=0, local_buffer_size=1 << 20, rpc_timeout_ms=2000).with_addresses(
        args.master, args.metadata)
    holder = MooncakeStore.connect(base.replace(global_segment_size=64 << 20))  # where the puts land
    rng = random.Random(args.seed)
    results: list[dict] = []
    lock = threading.Lock()
    its = iter(range(args.iterations))

    def lane() -> None:
        lrng = random.Random(rng.random())
        for it in its:  # a shared iterator: the lanes split the iterations between them
            r = _one_shutdown(engine, base, it, lrng)
            with lock:
                results.append(r)

    lanes = [threading.Thread(target=lane) for _ in range(args.lanes)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()
    holder.close()
    print("RESULTS " + json.dumps(results), flush=True)


def child_hung(args: argparse.Namespace) -> None:
    """A store call that does not return within shutdown's bound (master stopped with SIGSTOP): shutdown
    gives up on the thread, close leaks the client instead of closing it under the call, and once the
    master answers again the call returns on the still-open client and the thread ends."""
    import tempfile

    from kvledger_connector.config import StoreConfig
    from kvledger_connector.store.embedded import EmbeddedMooncake
    from kvledger_connector.metadata import KVLedgerConnectorMetadata, SaveSpec
    from kvledger_connector.store.client import MooncakeStore

    engine = _engine(tempfile.mkdtemp(prefix="shutdown-model-"))
    # the RPC timeout is the window in which the poll below must see the call inside: long enough that a
    # poller starved on a loaded machine still sees it (the call returns at SIGCONT, so it costs no time)
    with EmbeddedMooncake(rpc_timeout_ms=20000) as mc:
        cfg = StoreConfig(global_segment_size=16 << 20, local_buffer_size=1 << 20,
                          rpc_timeout_ms=20000).with_addresses(mc.master_address, mc.metadata_server)
        store = MooncakeStore.connect(cfg)
        ws, _caches = _worker(engine, store, cfg, "hung")
        os.kill(mc.master_pid, signal.SIGSTOP)
        try:
            ws.end_step(KVLedgerConnectorMetadata(step=0, saves=[SaveSpec("r", 0, 0, 0, 1, (1,), (b"k" * 32,))]))
            t0 = time.monotonic()
            while store.calls_inside == 0 and time.monotonic() < t0 + 15:
                time.sleep(0.005)
            inside, waited = store.calls_inside, time.monotonic() - t0
            clean = ws.shutdown(0.2)
            closed = store.close(timeout_s=0.4)
        finally:
            os.kill(mc.master_pid, signal.SIGCONT)
        for t in ws._threads:
            t.join(15)
        out = {"inside": inside, "clean": clean, "left_running": ws.num_threads_left_running, "closed": closed,
               "leaked": store.stats.total("store_close_leaked"), "alive_after": sum(t.is_alive() for t in ws._threads),
               "calls_inside_after": store.calls_inside, "waited_s": round(waited, 3),
               # why, if no call was seen inside: what the save's store calls answered
               "errors": ws.steps.errors[-4:], "last_exception": repr(store.last_exception)}
        print("RESULTS " + json.dumps(out), flush=True)
        if out["calls_inside_after"] == 0:  # cleanup only: the leaked client, now idle, leaves while the master
            store.raw.close()              # runs (destroyed later, it retries the unmount for ~45 s)


def main() -> None:
    import faulthandler

    faulthandler.enable()
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["stress", "hung"])
    p.add_argument("--master", default="")
    p.add_argument("--metadata", default="")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--lanes", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    (child_stress if args.scenario == "stress" else child_hung)(args)


# ---------------------------------------------------------------------------------------------- tests
def _run_child(*argv: str, timeout: float) -> dict | list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, __file__, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    # a negative code is the signal that killed the child (SIGSEGV -11, SIGABRT -6): the crash under test
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{tail}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, f"no results from the child:\n{tail}"
    return json.loads(line[-1][len("RESULTS "):])


def test_shutdown_under_load_many_times_never_crashes(mooncake) -> None:
    """30 shutdowns racing a driver, some from two threads at once, some with the store closed at the same
    time; bounds from 0 s (threads certainly still inside calls) to 5 s. Six at a time: a client's close
    takes ~1 s of waiting on the master. Before the fix (close under a live call, or a call slipping past
    the closed check) the child died with SIGSEGV within the first few iterations."""
    n = 30
    results = _run_child("stress", "--master", mooncake.master_address, "--metadata", mooncake.metadata_server,
                         "--iterations", str(n), "--lanes", "6", "--seed", "12", timeout=300)
    assert len(results) == n
    for r in results:
        if r["it"] % 3 == 1:  # two at once: the one that waited may give up before the first finishes
            assert r["again"] or not r["clean"], r
        else:  # a repeated shutdown answers what the first one did
            assert r["again"] == r["clean"], r
        assert r["alive_after"] == 0 and not r["driver_alive"], r  # every thread ended in the end
        assert r["calls_inside"] == 0, r
        assert r["errors"] == [], r
        # close fails by leaking, or by Mooncake's unmount through the master outlasting the close's 5 s bound
        # (a machine busy with another suite starves the master: the client is then abandoned, never crashed)
        assert r["closed"] == (r["leaked"] == 0) or (not r["closed"] and r["close_s"] >= 5.0), r
        if r["clean"]:
            assert r["left_running"] == 0, r
    # the race under test happened: some shutdowns gave up on threads still running
    assert any(not r["clean"] for r in results), results


def test_close_leaks_the_client_rather_than_close_it_under_a_hung_call() -> None:
    r = _run_child("hung", timeout=120)
    assert r["inside"] == 1, r  # the store thread is inside batch_is_exist on the stopped master
    assert r["clean"] is False and r["left_running"] == 1, r
    assert r["closed"] is False and r["leaked"] == 1, r
    assert r["alive_after"] == 0 and r["calls_inside_after"] == 0, r  # the call returned, the thread ended


if __name__ == "__main__":
    main()
