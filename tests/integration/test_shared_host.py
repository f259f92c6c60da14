"""Another local user against this user's engine, on one host: what they may create, plant or swap around the
embedded store's runtime directory and the disk tier's directories must not stop the engine from starting nor
be used by it. Each attack runs in a forked child as uid 65534 (nobody); the victim is this process (root)."""
from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.store import rendezvous
from kvledger_connector.store.tier import OWNER_LOCK, make_offload_dir, remove_offload_dir, sweep_offload_dirs

OTHER_UID = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second uid needs root (setuid)")


def as_other_user(act: Callable[[], None]) -> None:
    """Run `act` in a forked child as OTHER_UID (no groups); fail the test when it fails there."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            act()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the other user's step failed ({status})"


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A /tmp of its own (root's, 1777 like /tmp, directly under /tmp so the other user reaches it), as
    tempfile's directory, with no runtime directory setting: the default under test."""
    d = Path(tempfile.mkdtemp(prefix="kvledger-shared-host-", dir="/tmp"))
    d.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    for var in (rendezvous.RUNTIME_DIR_ENV, rendezvous.XDG_ENV, rendezvous.RUNTIME_TOKEN_ENV):
        monkeypatch.delenv(var, raising=False)
    try:
        yield d
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def squat(tmp: Path, names: list[str], kind: str) -> None:
    """As the other user, take every name in `tmp` first: a directory, a file or a link to a directory."""
    def act() -> None:
        for name in names:
            p = tmp / name
            if kind == "directory":
                p.mkdir(mode=0o777)
                p.chmod(0o777)
            elif kind == "file":
                p.write_text("mine")
            else:
                target = tmp / f"{name}.target"
                target.mkdir(mode=0o777)
                p.symlink_to(target)
    as_other_user(act)


def guessable_names(engine_id: str) -> list[str]:
    """What another user can compute: the uid (ps), a chosen engine id (the command line), the hashing (the
    code). Not the token the plugin put into the engine's environment, nor a default engine id."""
    uid = os.geteuid()
    return [f"kvledger-{uid}", f"kvledger-{uid}-{rendezvous_tag_without_token(engine_id)}"]


def rendezvous_tag_without_token(engine_id: str) -> str:
    token = os.environ.pop(rendezvous.RUNTIME_TOKEN_ENV, None)
    try:
        return rendezvous.runtime_tag(engine_id)
    finally:
        if token is not None:
            os.environ[rendezvous.RUNTIME_TOKEN_ENV] = token


@needs_root
@pytest.mark.parametrize("kind", ["directory", "file", "link"])
def test_a_runtime_directory_name_taken_first_by_another_user_does_not_stop_the_engine(
        shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The engine id is one the operator chose (visible in ps); the plugin's token is in the engine's
    environment. Every name the other user can compute is taken first; the engine's rendezvous and secret
    still work, in a private directory of this user's that is none of them."""
    engine_id = "chosen-engine"
    monkeypatch.setenv(rendezvous.RUNTIME_TOKEN_ENV, uuid.uuid4().hex)
    names = guessable_names(engine_id)
    squat(shared_tmp, names, kind)
    secret = rendezvous.engine_secret(engine_id)
    assert len(secret) == rendezvous.SECRET_BYTES and rendezvous.engine_secret(engine_id) == secret
    d = Path(rendezvous.runtime_dir(engine_id))
    assert d.parent == shared_tmp and d.name not in names
    st = d.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


@needs_root
def test_the_embedded_store_starts_and_is_shared_beside_a_squatter(shared_tmp: Path) -> None:
    """The real embedded servers start with the default directory taken, under a default engine id (a random
    UUID, as vLLM makes it) and no token; a second acquire of the engine attaches to the same servers."""
    engine_id = str(uuid.uuid4())
    squat(shared_tmp, [f"kvledger-{os.geteuid()}"], "directory")
    first = rendezvous.acquire_shared(engine_id, 2000)
    try:
        assert isinstance(first, rendezvous.EmbeddedMooncake)
        assert Path(rendezvous.rendezvous_path(engine_id)).is_file()
        assert rendezvous.acquire_shared(engine_id, 2000) is first
        rendezvous.release_shared(engine_id)
    finally:
        rendezvous.release_shared(engine_id)
    assert not Path(rendezvous.rendezvous_path(engine_id)).exists()


@needs_root
def test_xdg_runtime_dir_is_used_only_when_it_is_this_users_private_directory(
        shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    mine = shared_tmp / "xdg-mine"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv(rendezvous.XDG_ENV, str(mine))
    assert rendezvous.runtime_dir("e") == str(mine / "kvledger")
    as_other_user(lambda: (shared_tmp / "xdg-other").mkdir(mode=0o700))
    monkeypatch.setenv(rendezvous.XDG_ENV, str(shared_tmp / "xdg-other"))
    monkeypatch.setattr(rendezvous, "_xdg_warned", False)
    with caplog.at_level(logging.WARNING, logger=rendezvous.__name__):
        d = rendezvous.runtime_dir("e")
    assert Path(d).parent == shared_tmp and d.startswith(str(shared_tmp / f"kvledger-{os.geteuid()}-"))
    assert rendezvous.XDG_ENV in caplog.text


@pytest.fixture
def open_parent(tmp_path: Path) -> Iterator[Path]:
    """A directory every user may write to, without the sticky bit, directly under /tmp."""
    d = Path(tempfile.mkdtemp(prefix="kvledger-open-", dir="/tmp"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def test_a_runtime_directory_under_a_non_sticky_others_writable_directory_is_refused_by_name(
        open_parent: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """There another user may rename our private directory away and put theirs in its place."""
    rt = open_parent / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv(rendezvous.RUNTIME_DIR_ENV, str(rt))
    with pytest.raises(rendezvous.RendezvousError, match=rf"{rendezvous.RUNTIME_DIR_ENV}.*{open_parent}.*0777"):
        rendezvous.runtime_dir()
    open_parent.chmod(0o1777)  # sticky: only an entry's owner may rename it
    assert rendezvous.runtime_dir() == str(rt)


def test_a_tier_directory_under_a_non_sticky_others_writable_directory_is_refused_by_name(
        open_parent: Path) -> None:
    tier = open_parent / "tier"
    tier.mkdir(mode=0o700)
    with pytest.raises(ConfigError) as e:
        make_offload_dir(StoreConfig(disk_offload=True, disk_offload_dir=str(tier)))
    assert e.value.field == "disk_offload_dir" and e.value.value == str(tier) and str(open_parent) in str(e.value)
    assert os.listdir(tier) == []
    open_parent.chmod(0o1777)
    remove_offload_dir(make_offload_dir(StoreConfig(disk_offload=True, disk_offload_dir=str(tier))))


def test_the_plugin_seeds_a_token_every_later_process_of_the_engine_inherits(
        shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM runs the plugin in its first process before it spawns the EngineCore and the workers: they inherit
    the token, so every process of the engine finds the same directory; another engine's token names another."""
    import subprocess
    import sys

    from kvledger_connector import plugin
    plugin.register()
    token = os.environ[rendezvous.RUNTIME_TOKEN_ENV]
    assert len(token) == 32
    plugin.register()
    assert os.environ[rendezvous.RUNTIME_TOKEN_ENV] == token  # a second call keeps it
    code = ("import sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
            "from kvledger_connector.store.rendezvous import runtime_dir; print(runtime_dir('e'))")
    child = subprocess.run([sys.executable, "-c", code, str(shared_tmp)], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).resolve().parents[2])
    assert child.stdout.strip() == rendezvous.runtime_dir("e")
    monkeypatch.setenv(rendezvous.RUNTIME_TOKEN_ENV, uuid.uuid4().hex)
    assert rendezvous.runtime_dir("e") != child.stdout.strip()


def test_a_fifo_owner_lock_does_not_hang_the_tier_sweep(tmp_path: Path) -> None:
    """Before: the sweep opened OWNER_LOCK for reading and waited forever for a FIFO's writer."""
    parent = tmp_path / "tier"
    odd = parent / "kvledger-tier-fifo"
    odd.mkdir(parents=True, mode=0o700)
    os.mkfifo(odd / OWNER_LOCK, 0o600)
    got: list[list[str]] = []
    sweep = threading.Thread(target=lambda: got.append(sweep_offload_dirs(str(parent))), daemon=True)
    sweep.start()
    sweep.join(10)
    hung = sweep.is_alive()
    if hung:  # let the old code's open return, so the thread ends
        os.close(os.open(odd / OWNER_LOCK, os.O_WRONLY | os.O_NONBLOCK))
        sweep.join(10)
    assert not hung, "the sweep hung on a FIFO owner lock"
    assert got == [[]] and odd.is_dir()  # not a directory of a client of ours: left alone


@needs_root
def test_a_tier_directory_the_sweep_cannot_remove_is_reported_not_removed(open_parent: Path) -> None:
    """As an unprivileged user (root removes anything): a dead client's directory holding a directory its
    owner may not write cannot be removed; the sweep says so and does not return it as removed."""
    parent = open_parent / "tier"

    def act() -> None:
        dead = parent / "kvledger-tier-dead"
        (dead / "ro").mkdir(parents=True, mode=0o700)
        (dead / OWNER_LOCK).write_text("")
        (dead / "ro" / "1.bucket").write_bytes(b"x")
        (dead / "ro").chmod(0o500)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("kvledger_connector.store.tier").addHandler(handler)
        gone = sweep_offload_dirs(str(parent))
        if gone or not dead.is_dir():
            raise SystemExit(f"reported removed: {gone}")
        if not any("not removed" in r.getMessage() and str(dead) in r.getMessage() for r in records):
            raise SystemExit("the failed removal was not logged")
    as_other_user(act)
