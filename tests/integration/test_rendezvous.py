"""The embedded default across an engine's processes (kvledger_connector/store/rendezvous.py): processes of one engine
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

from kvledger_connector.store.listeners import port_accepts
from tests.integration.conftest import NS_OWNER

ROOT = Path(__file__).resolve().parents[2]
# one process of an engine: acquire the engine's servers, say what it got, release on "release\n"
CHILD = """
import json, sys
from kvledger_connector.store.rendezvous import acquire_shared, release_shared
from kvledger_connector.store.embedded import EmbeddedMooncake
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
    from kvledger_connector.store import rendezvous
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(target))
    with pytest.raises(rendezvous.RendezvousError, match="not a directory"):
        rendezvous.runtime_dir()


@pytest.fixture
def rdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from kvledger_connector.store import rendezvous
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(d))
    return d


class _Started:
    """Test double for `start`: what acquire publishes of servers it starts; none are started (the decision
    under test is whether acquire joins the planted file's master or starts its own)."""
    master_address = "127.0.0.1:1"
    metadata_server = "http://127.0.0.1:1/metadata"
    master_inode = 1


@pytest.fixture
def listening():
    """A listener on 127.0.0.1 standing in for a live owner's master: (port, its socket inode)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1], os.fstat(s.fileno()).st_ino
    s.close()


@pytest.fixture
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield p.pid
    _stop(p)  # type: ignore[arg-type]


@pytest.mark.parametrize("what", ["remote master", "remote metadata", "port not a number", "port 0",
                                  "pid not an int", "not json", "a symlink", "group-writable", "too large",
                                  "pid reused", "no start time", "no master inode", "another master inode",
                                  "master inode not an int"])
def test_a_planted_or_malformed_file_is_never_joined(rdir: Path, listening: tuple[int, int], live_pid: int,
                                                      what: str) -> None:
    """A file a live owner's would be joined (the listener on its master port is the one it records); each
    of these is refused and replaced by this process's own servers, with no exception."""
    from kvledger_connector.store import rendezvous
    listening_port, inode = listening
    good = {**rendezvous.owner_fields(live_pid), "master_address": f"127.0.0.1:{listening_port}",
            "master_inode": inode, "metadata_server": f"http://127.0.0.1:{listening_port}/metadata"}
    path = Path(rendezvous.rendezvous_path("planted"))
    bad = dict(good)
    if what == "remote master":
        bad["master_address"] = f"10.9.8.7:{listening_port}"
    elif what == "remote metadata":
        bad["metadata_server"] = f"http://10.9.8.7:{listening_port}/metadata"
    elif what == "port not a number":
        bad["master_address"] = "127.0.0.1:abc"
    elif what == "port 0":
        bad["master_address"] = "127.0.0.1:0"
    elif what == "pid not an int":
        bad["pid"] = str(live_pid)
    elif what == "pid reused":  # the pid runs, but it is not the process that wrote the file
        bad["start_time"] = good["start_time"] + 1
    elif what == "no start time":  # a file of the format before start times
        del bad["start_time"]
    elif what == "no master inode":  # a file of the format before listener inodes
        del bad["master_inode"]
    elif what == "another master inode":  # the port answers, but not with the listener the owner published
        bad["master_inode"] = inode + 1
    elif what == "master inode not an int":
        bad["master_inode"] = str(inode)
    text = "{not json" if what == "not json" else json.dumps(bad)
    if what == "too large":
        text = json.dumps({**good, "pad": "x" * rendezvous.MAX_FILE_BYTES})
    if what == "a symlink":
        target = rdir.parent / "elsewhere.json"
        target.write_text(json.dumps(good))
        path.symlink_to(target)
    else:
        path.write_text(text)
        path.chmod(0o620 if what == "group-writable" else 0o600)
    # the control: the good file is joined
    control = Path(rendezvous.rendezvous_path("control"))
    control.write_text(json.dumps(good))
    control.chmod(0o600)
    joined = rendezvous.acquire("control", _Started)  # type: ignore[arg-type]
    assert isinstance(joined, rendezvous.AttachedMooncake) and joined.owner_pid == live_pid

    got = rendezvous.acquire("planted", _Started)  # type: ignore[arg-type]
    assert isinstance(got, _Started), got  # started its own, did not attach
    assert not path.is_symlink()
    info = json.loads(path.read_text())
    assert info["pid"] == os.getpid() and info["master_address"] == _Started.master_address
    assert path.stat().st_mode & 0o777 == 0o600
    rendezvous.release("planted")
    assert not path.exists()


def test_a_runtime_dir_others_can_write_is_refused(rdir: Path) -> None:
    from kvledger_connector.store import rendezvous
    rdir.chmod(0o777)
    with pytest.raises(rendezvous.RendezvousError, match=r"mode 0777.*KVLEDGER_RUNTIME_DIR"):
        rendezvous.runtime_dir()
    rdir.chmod(0o700)
    assert rendezvous.runtime_dir() == str(rdir)


def test_a_symlinked_lock_is_refused_by_name(rdir: Path) -> None:
    from kvledger_connector.store import rendezvous
    (rdir / ".lock").symlink_to(rdir.parent / "victim")
    with pytest.raises(rendezvous.RendezvousError, match=r"\.lock.*rendezvous lock"):
        rendezvous.acquire("x", _Started)  # type: ignore[arg-type]
    assert not (rdir.parent / "victim").exists()


def test_a_lock_held_for_good_fails_start_up_with_a_reason(rdir: Path) -> None:
    """A process that holds the directory's lock and never lets go (frozen): acquire gives up after its
    bound with an error naming the lock, instead of hanging the engine's start-up."""
    from kvledger_connector.store import rendezvous
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"), str(rdir / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(rendezvous.RendezvousError, match=r"held the rendezvous lock for 0.2s"):
            rendezvous.acquire("x", _Started, lock_timeout_s=0.2)  # type: ignore[arg-type]
    finally:
        _stop(holder)  # type: ignore[arg-type]
    got = rendezvous.acquire("x", _Started, lock_timeout_s=0.2)  # type: ignore[arg-type]
    assert isinstance(got, _Started)
    rendezvous.release("x")


def test_an_owner_in_another_pid_namespace_is_alive_while_its_master_answers(rdir: Path) -> None:
    """An engine in its own PID namespace shares the runtime directory: its file names pid 1 of that
    namespace, which means nothing here. Its file is neither swept nor replaced while the listener it
    records is on its master port (else the engine would split onto two masters); once it is gone, the
    file is swept."""
    from kvledger_connector.store import rendezvous
    cmd = ["unshare", "--pid", "--kill-child", sys.executable, "-c", NS_OWNER]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        owner = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env)
    except OSError as e:
        pytest.skip(f"unshare cannot run here: {e}")
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().split()
        if not line:
            owner.wait(30)
            pytest.skip(f"no PID namespace could be created: {owner.stderr.read() if owner.stderr else ''}")
        ns_pid, port = int(line[0]), int(line[1])
        assert ns_pid == 1  # the namespace's init: a pid that is this test's own pytest worker or nothing here
        info = json.loads(Path(rendezvous.rendezvous_path("ns-engine")).read_text())
        assert info["pid_ns"] != os.readlink("/proc/self/ns/pid")
        joined = rendezvous.acquire("ns-engine", _Started)  # type: ignore[arg-type]
        assert isinstance(joined, rendezvous.AttachedMooncake) and joined.master_address == f"127.0.0.1:{port}"
    finally:
        _stop(owner)  # type: ignore[arg-type]  (unshare's death kills the namespace's processes)
    from kvledger_connector.store.listeners import port_accepts
    deadline = time.monotonic() + 30  # a hang guard: the namespace's init dies after unshare
    while port_accepts(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = rendezvous.acquire("ns-engine", _Started)  # type: ignore[arg-type]  (its master is gone with it)
    assert isinstance(got, _Started)
    rendezvous.release("ns-engine")


# one process of a TP 2 engine as the connector starts it: the engine's secret, then its servers
SECRET_CHILD = """
import hashlib, json, sys
from kvledger_connector.store.rendezvous import acquire_shared, engine_secret, release_shared
s = engine_secret(sys.argv[1])
h = acquire_shared(sys.argv[1], 2000)
print(json.dumps({"secret": hashlib.sha256(s).hexdigest(), "master": h.master_address}), flush=True)
sys.stdin.readline()
release_shared(sys.argv[1])
print("released", flush=True)
"""


def test_every_process_of_an_engine_reads_one_generated_secret(env: dict[str, str]) -> None:
    """The scheduler's process and two workers' (TP 2) start together: one secret, generated once, read
    by all; another engine gets its own; the owner's shutdown removes it with the rendezvous file."""
    eid = f"engine-{uuid.uuid4().hex[:8]}"
    run = Path(env["KVLEDGER_RUNTIME_DIR"])

    def spawn(engine_id: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", SECRET_CHILD, engine_id], cwd=ROOT, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    procs = [spawn(eid) for _ in range(3)]
    try:
        hellos = [_hello(p) for p in procs]
        assert len({h["secret"] for h in hellos}) == 1 and len({h["master"] for h in hellos}) == 1, hellos
        [key] = run.glob("secret-*.key")
        assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == 32
        other = spawn(f"engine-{uuid.uuid4().hex[:8]}")
        try:
            assert _hello(other)["secret"] != hellos[0]["secret"]
        finally:
            other.communicate("release\n", timeout=60)
        for p in procs:
            p.communicate("release\n", timeout=60)
        assert list(run.glob("secret-*.key")) == [] and list(run.glob("embedded-*.json")) == []
    finally:
        for p in procs:
            _stop(p)


@pytest.mark.parametrize("what", ["group-readable file", "a symlink", "short file", "a directory",
                                  "directory others may enter"])
def test_a_generated_secret_is_refused_unless_private(rdir: Path, what: str) -> None:
    """A secret file that is not this user's private regular file of 32 bytes, or a runtime directory
    others may enter, stops start-up with a named error (never a secret read from it, never a new one
    written over it)."""
    from kvledger.errors import LedgerInputError
    from kvledger_connector.store import rendezvous
    path = Path(rendezvous.secret_path("e"))
    good = rendezvous.engine_secret("e")
    assert len(good) == 32 and rendezvous.engine_secret("e") == good  # generated once, then read
    field = "engine_secret"
    if what == "group-readable file":
        path.chmod(0o640)
    elif what == "a symlink":
        path.unlink()
        (rdir.parent / "planted").write_bytes(b"p" * 32)
        (rdir.parent / "planted").chmod(0o600)
        path.symlink_to(rdir.parent / "planted")
    elif what == "short file":
        path.write_bytes(b"s" * 16)
    elif what == "a directory":
        path.unlink()
        path.mkdir()
    else:
        rdir.chmod(0o711)
        field = rendezvous.RUNTIME_DIR_ENV
    with pytest.raises(LedgerInputError) as e:
        rendezvous.engine_secret("e")
    assert e.value.field == field, e.value
    rdir.chmod(0o700)
