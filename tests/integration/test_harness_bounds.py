"""Every wait in the integration machinery is bounded (a hang fails its test with a diagnosis):
the harness's step loop, and a store client's close."""
from __future__ import annotations

import threading
import time

import pytest

from kvledger_connector.config import StoreConfig
from testbed.harness import Harness, HarnessStallError, shared_prefix_prompts

ASYNC = {"sync_load_max_tokens": 0}  # every load on the load threads: the request waits for remote KV


class GatedGet:
    """Test double around the real store: `batch_get` blocks until `gate` is set (bounded by 30 s), so a
    load never finishes while the test wants it not to."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def batch_get(self, *a):
        self.gate.wait(30)
        return self.inner.batch_get(*a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_load_that_never_finishes_stalls_the_harness_with_a_diagnosis(store_config: StoreConfig):
    prompts = shared_prefix_prompts(6, num_prefixes=6, prefix_len=48, suffix_len=8, seed=23)
    gate = threading.Event()
    # async loads: a sync one that never finishes holds the step itself (the store's own call deadline bounds it)
    with Harness(store_config, num_blocks=14, stall_timeout_s=2.0, extra=ASYNC) as h:
        for i, p in enumerate(prompts):
            h.add_request(f"req-{i}", p, 8)
        h.run()  # stores every prefix
        for w in h.workers:
            w.worker_side.io.store = GatedGet(w.worker_side.io.store, gate)
        for i, p in enumerate(prompts):  # most prefixes left vLLM's cache: they are loaded from the store
            h.add_request(f"req-{i}", p, 8)
        t0 = time.monotonic()
        try:
            with pytest.raises(HarnessStallError) as e:
                h.run()
        finally:
            gate.set()
        assert time.monotonic() - t0 < 30  # the stall bound, not run()'s 240 s or the gate's 30 s
        assert "no progress" in str(e.value) and "load pins=" in str(e.value)
        assert "load pins=0" not in str(e.value)  # it names what it waits for
        h.run()  # released: everything finishes and drains
        assert h.garbage == [] and h.check_at_rest() == []
        for i, p in enumerate(prompts):
            assert h.stats.outputs[f"req-{i}"] == h.expected_output(p, 8)


def test_stall_timeout_must_be_positive(store_config: StoreConfig):
    with pytest.raises(ValueError, match="stall_timeout_s=0"):
        Harness(store_config, stall_timeout_s=0)


class _SlowCloseRaw:
    """Test double for the raw Mooncake client: close() blocks for `delay` seconds (a wedged unmount)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.closed = threading.Event()

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def close(self) -> int:
        time.sleep(self.delay)
        self.closed.set()
        return 0


def test_store_close_is_bounded_and_says_so(caplog):
    from kvledger_connector.store.client import MooncakeStore

    cfg = StoreConfig(master_server_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata")
    store = MooncakeStore(_SlowCloseRaw(5.0), cfg)
    t0 = time.monotonic()
    assert store.close(timeout_s=0.3) is False
    assert time.monotonic() - t0 < 3.0
    assert "did not finish in 0.3s" in caplog.text and "127.0.0.1:1" in caplog.text
    t1 = time.monotonic()
    # idempotent: a second close does not wait again and repeats the first one's answer (it never finished)
    assert store.close() is False and time.monotonic() - t1 < 1.0
    quick = MooncakeStore(_SlowCloseRaw(0.0), cfg)
    assert quick.close(timeout_s=5.0) is True and quick._raw.closed.is_set()


def test_servers_die_with_a_killed_owner(tmp_path):
    """A test run killed by SIGKILL (no atexit, no fixture teardown) leaves no master or metadata server:
    they are started with a parent-death signal."""
    import os
    import signal
    import subprocess
    import sys

    code = ("from kvledger_connector.store.embedded import EmbeddedMooncake\n"
            "import time\n"
            "mc = EmbeddedMooncake()\n"
            "print(mc.master_pid, mc.metadata_pid, flush=True)\n"
            "time.sleep(120)\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=repo,
                             env={**os.environ, "PYTHONPATH": repo})
    try:
        line = owner.stdout.readline()  # type: ignore[union-attr]
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, line
        for pid in pids:
            os.kill(pid, 0)  # running
    finally:
        owner.kill()
        owner.wait(10)
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    for pid in alive:  # do not leave them behind if the check fails
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"servers outlived their killed owner: {alive}"


def _running(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
