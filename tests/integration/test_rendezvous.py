"""The embedded default across an engine's processes (kvledger_connector/rendezvous.py): processes of one engine
share one private master; another engine gets its own; the owner's exit, clean or SIGKILL, leaves no
server and no rendezvous file behind. Each "process of the engine" is a real subprocess."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvledger_connector.embedded import port_accepts

ROOT = Path(__file__).resolve().parents[2]
# one process of an engine: acquire the engine's servers, say what it got, release on "release\n"
CHILD = """
import json, sys
from kvledger_connector.rendezvous import acquire_shared, release_shared
from kvledger_connector.embedded import EmbeddedMooncake
h = acquire_shared(sys.argv[1], 2000)
print(json.dumps({"master": h.master_address, "metadata": h.metadata_server,
                  "owner": isinstance(h, EmbeddedMooncake),
                  "master_pid": getattr(h, "master_pid", None)}), flush=True)
sys.stdin.readline()
release_shared(sys.argv[1])
print("released", flush=True)
"""


def _spawn(engine_id: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, engine_id], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _hello(p: subprocess.Popen[str]) -> dict[str, object]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"child {p.pid} exited with {p.wait(10)} before answering")
    return dict(json.loads(line))


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(30)


def _port(addr: object) -> int:
    return int(str(addr).rsplit(":", 1)[1])


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "KVLEDGER_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
            "GLOG_minloglevel": "2"}


def test_processes_of_one_engine_share_one_master_and_the_owner_cleans_up(env: dict[str, str]) -> None:
    eid = f"engine-{uuid.uuid4().hex[:8]}"
    procs = [_spawn(eid, env) for _ in range(3)]
    try:
        hellos = [_hello(p) for p in procs]
        assert len({h["master"] for h in hellos}) == 1, hellos
        owners = [i for i, h in enumerate(hellos) if h["owner"]]
        assert len(owners) == 1, hellos
        files = list(Path(env["KVLEDGER_RUNTIME_DIR"]).glob("embedded-*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["pid"] == procs[owners[0]].pid
        other = _spawn(f"engine-{uuid.uuid4().hex[:8]}", env)  # another engine: its own master
        try:
            assert _hello(other)["master"] != hellos[0]["master"]
        finally:
            other.communicate("release\n", timeout=60)
        for i in sorted(range(3), key=lambda i: i == owners[0]):  # attached ones first, owner last
            out, _ = procs[i].communicate("release\n", timeout=60)
            assert "released" in out
        assert not port_accepts(_port(hellos[0]["master"]))
        assert list(Path(env["KVLEDGER_RUNTIME_DIR"]).glob("embedded-*.json")) == []
    finally:
        for p in procs:
            _stop(p)


def test_a_killed_owner_leaves_no_server_and_the_next_engine_sweeps_its_file(env: dict[str, str]) -> None:
    eid = f"engine-{uuid.uuid4().hex[:8]}"
    owner = _spawn(eid, env)
    try:
        h = _hello(owner)
        assert h["owner"] is True
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 10
        while port_accepts(_port(h["master"])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not port_accepts(_port(h["master"])), "master outlived its owner"
        assert len(list(Path(env["KVLEDGER_RUNTIME_DIR"]).glob("embedded-*.json"))) == 1  # left by the crash
        nxt = _spawn(f"engine-{uuid.uuid4().hex[:8]}", env)
        try:
            assert _hello(nxt)["owner"] is True
            names = sorted(p.name for p in Path(env["KVLEDGER_RUNTIME_DIR"]).glob("embedded-*.json"))
            assert len(names) == 1 and eid not in names[0], names  # the dead owner's file was swept
        finally:
            nxt.communicate("release\n", timeout=60)
    finally:
        _stop(owner)


def test_a_runtime_dir_of_another_owner_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger_connector import rendezvous
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(target))
    with pytest.raises(rendezvous.RendezvousError, match="not a directory"):
        rendezvous.runtime_dir()
