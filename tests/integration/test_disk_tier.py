"""Mooncake's disk tier through `MooncakeStore`, with the real master (offload on) on loopback and real files:
a working set four times the memory segment written and read back byte-exact, most of it from disk; the
bound on the tier's files; what a master restart leaves; a directory others may write refused by name; and
upstream's ``enable_offload`` mapped onto ``disk_offload`` (docs/disk-tier.md).

Each test starts its own master (killed by pid at the end) and writes 1 MiB objects into a 16 MiB segment, the
smallest Mooncake's setup() takes. A put into a segment still full of objects not yet written to disk
fails with NO_AVAILABLE_HANDLE until the client's next heartbeat writes them: the tests retry it, bounded
(`put_all`), as a worker would have to (docs/disk-tier.md, "Backpressure").
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvledger.counts import Counts
from kvledger_connector.config import ConfigError, StoreConfig
from kvledger_connector.store.contract import StoreCode
from kvledger_connector.store.tier import (OWNER_LOCK, make_offload_dir, offload_environment, remove_offload_dir,
                                           sweep_offload_dirs)
from kvledger_connector.store.client import MooncakeStore, StoreUnavailableError
from kvledger_connector.store.embedded import EmbeddedMooncake
from testbed.procs import wait_until

SEGMENT = 16 << 20
OBJECT = 1 << 20
N = 4 * SEGMENT // OBJECT  # the working set: four times the memory segment
PUT_BOUND_S = 30.0  # the whole pass's puts, retries included (measured ~4-5 s)


@pytest.fixture
def tier_master() -> Iterator[EmbeddedMooncake]:
    # a short lease lets objects read or checked a moment ago be evicted from memory within the test
    with EmbeddedMooncake(rpc_timeout_ms=2000, lease_ttl_ms=500, disk_offload=True, supervise=True,
                          stats=Counts()) as mc:
        yield mc


@pytest.fixture
def tier_dir(tmp_path: Path) -> str:
    d = tmp_path / "tier"
    d.mkdir(mode=0o700)
    return str(d)


def tier_config(directory: str, **changes: object) -> StoreConfig:
    return StoreConfig(global_segment_size=SEGMENT, local_buffer_size=4 << 20, disk_offload=True,
                       disk_offload_dir=directory, **changes)  # type: ignore[arg-type]


def payload(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (N, OBJECT), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def put_all(store: MooncakeStore, keys: list[str], src: torch.Tensor) -> int:
    """Put every key, retrying one that finds the segment full until the tier has made room (bounded by
    PUT_BOUND_S for the whole pass); the number of retries."""
    deadline = time.monotonic() + PUT_BOUND_S
    retries = 0
    for i, key in enumerate(keys):
        while True:
            code = store.batch_put([key], [[src[i].data_ptr()]], [[OBJECT]])[0]
            if code != StoreCode.NO_AVAILABLE_HANDLE or time.monotonic() > deadline:
                break
            retries += 1
            time.sleep(0.05)
        assert code == 0, f"put {key}: {StoreCode.label(code)} after {retries} retries"
    return retries


def get_all(store: MooncakeStore, keys: list[str], dst: torch.Tensor) -> list[int]:
    return store.batch_get(keys, [[dst[i].data_ptr()] for i in range(len(keys))], [[OBJECT]] * len(keys))


def master_metric(mc: EmbeddedMooncake, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{mc.metrics_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the master's /metrics")


def files_under(d: str) -> tuple[int, int]:
    """(files, bytes) under `d`."""
    n = size = 0
    for root, _, names in os.walk(d):
        for name in names:
            n += 1
            size += os.path.getsize(os.path.join(root, name))
    return n, size


def test_a_working_set_four_times_the_segment_is_read_back_from_disk_byte_exact(
        tier_master: EmbeddedMooncake, tmp_path: Path) -> None:
    named = str(tmp_path / "made" / "tier")  # absent: created private
    staging = 16 << 20  # the owner's buffer for reads from disk: one batch's disk-resident objects must fit
    store = MooncakeStore.connect(tier_config(named, disk_offload_staging_size=staging), embedded=tier_master)
    mine = store.offload_dir
    try:
        assert os.stat(named).st_mode & 0o777 == 0o700
        assert mine is not None and os.path.dirname(mine) == named
        assert os.stat(mine).st_mode & 0o777 == 0o700  # the client's own directory: private
        src, dst = payload(1), torch.zeros(N, OBJECT, dtype=torch.uint8)
        store.register_buffer(src.data_ptr(), src.nbytes)
        store.register_buffer(dst.data_ptr(), dst.nbytes)
        keys = [f"tier-{i}" for i in range(N)]
        put_all(store, keys, src)  # pass 1: every object stored (memory holds a quarter of them)
        disk_reads_before = master_metric(tier_master, "file_cache_hit_nums_")
        assert store.batch_is_exist(keys) == [1] * N  # pass 2: every key answers as present
        per_batch = staging // OBJECT // 2
        for a in range(0, N, per_batch):
            part = keys[a:a + per_batch]
            assert get_all(store, part, dst[a:a + per_batch]) == [OBJECT] * len(part)
        assert int((dst != src).sum()) == 0  # 0 wrong bytes
        # at least the objects that cannot be in memory were read from disk
        from_disk = master_metric(tier_master, "file_cache_hit_nums_") - disk_reads_before
        assert from_disk >= N - SEGMENT // OBJECT, from_disk
        assert files_under(mine)[1] >= (N - SEGMENT // OBJECT) * OBJECT
        # one batch whose disk-resident objects outgrow the staging buffer: those keys fail, never wrong bytes
        dst.zero_()
        got = get_all(store, keys, dst)
        assert set(got) <= {OBJECT, int(StoreCode.BUFFER_OVERFLOW)}, sorted(set(got))
        assert got.count(StoreCode.BUFFER_OVERFLOW) >= N - SEGMENT // OBJECT - staging // OBJECT
        assert all(torch.equal(dst[i], src[i]) for i, g in enumerate(got) if g == OBJECT)
    finally:
        closed = store.close()
    assert closed and not os.path.exists(mine)  # removed with its client


def test_the_disk_bound_evicts_files_and_leaves_misses_never_wrong_bytes(
        tier_master: EmbeddedMooncake, tier_dir: str) -> None:
    bound = 24 << 20
    store = MooncakeStore.connect(tier_config(tier_dir, disk_offload_size=bound), embedded=tier_master)
    try:
        src, dst = payload(2), torch.zeros(N, OBJECT, dtype=torch.uint8)
        store.register_buffer(src.data_ptr(), src.nbytes)
        store.register_buffer(dst.data_ptr(), dst.nbytes)
        keys = [f"bound-{i}" for i in range(N)]
        put_all(store, keys, src)
        assert store.offload_dir is not None
        assert files_under(store.offload_dir)[1] <= bound + 2 * OBJECT  # one object's bucket and its meta over
        got = get_all(store, keys, dst)
        hits = [i for i, g in enumerate(got) if g == OBJECT]
        assert set(got) <= {OBJECT, int(StoreCode.OBJECT_NOT_FOUND)}, sorted(set(got))
        assert N // 4 <= len(hits) < N  # the segment and the bound's worth, not the whole set
        assert all(torch.equal(dst[i], src[i]) for i in hits)
    finally:
        store.close()


#: free space Mooncake's bucket backend keeps on the tier's file system (0.3.13, measured: it logs "Actual disk
#: space too low ... deficit" and evicts its own older buckets to keep it)
FS_RESERVE = 256 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of FS_RESERVE + 24 MiB, private: the tier's file system fills up long before `disk_offload_size`.
    Skipped where this process may not mount (it needs root)."""
    import subprocess
    where = tmp_path / "small-fs"
    where.mkdir(mode=0o700)
    size = (FS_RESERVE >> 20) + 24
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_file_system_that_fills_up_below_the_bound_keeps_what_fits_and_never_reads_wrong_bytes(
        tier_master: EmbeddedMooncake, small_fs: Path) -> None:
    """The tier's file system fills up far below `disk_offload_size`: Mooncake keeps FS_RESERVE free, evicting
    its own older files, and an object it cannot write stays in memory alone. Puts go on (no segment pinned by
    unwritten objects), and pass 2 reads more than memory holds, each read whole and exact or a miss."""
    store = MooncakeStore.connect(tier_config(str(small_fs / "tier")), embedded=tier_master)
    mine = store.offload_dir
    try:
        assert mine is not None
        src, dst = payload(5), torch.zeros(N, OBJECT, dtype=torch.uint8)
        store.register_buffer(src.data_ptr(), src.nbytes)
        store.register_buffer(dst.data_ptr(), dst.nbytes)
        keys = [f"fills-{i}" for i in range(N)]
        put_all(store, keys, src)  # every put stored, within PUT_BOUND_S
        _, on_disk = files_under(mine)
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        assert on_disk <= 24 << 20 and free >= FS_RESERVE - 2 * OBJECT, (on_disk, free)
        got: list[int] = []
        for a in range(0, N, 8):
            got += get_all(store, keys[a:a + 8], dst[a:a + 8])
        assert set(got) <= {OBJECT, int(StoreCode.OBJECT_NOT_FOUND)}, sorted(set(got))
        hits = [i for i, g in enumerate(got) if g == OBJECT]
        assert all(torch.equal(dst[i], src[i]) for i in hits)  # 0 wrong bytes
        assert len(hits) > SEGMENT // OBJECT, got  # the disk kept some: more than memory alone holds
        print(f"\n[disk tier] a full file system: {on_disk >> 20} MiB written, {len(hits)}/{N} read back exact")
    finally:
        closed = store.close()
    assert closed and not os.path.exists(mine)


def test_objects_on_disk_outlive_a_master_restart_and_the_restart_is_counted(
        tier_master: EmbeddedMooncake, tier_dir: str) -> None:
    """A restarted master knows nothing; the client re-mounts its segment and re-announces the objects in
    its tier's files, so every object written to disk is found again, byte-exact. The restart is counted
    into the sink the master was given."""
    store = MooncakeStore.connect(tier_config(tier_dir), embedded=tier_master)
    try:
        src, dst = payload(3), torch.zeros(N, OBJECT, dtype=torch.uint8)
        store.register_buffer(src.data_ptr(), src.nbytes)
        store.register_buffer(dst.data_ptr(), dst.nbytes)
        keys = [f"restart-{i}" for i in range(N)]
        put_all(store, keys, src)
        assert store.offload_dir is not None
        # wait (bounded) until every object has been written: one bucket and one meta file each
        mine = store.offload_dir
        assert wait_until(lambda: files_under(mine)[0] >= 2 * N, 15.0)
        tier_master.kill_master()
        assert tier_master.wait_restarts(1, 30.0)
        assert tier_master.stats.total("master_restarts") == 1 and tier_master.restarts == 1
        assert wait_until(lambda: store.batch_is_exist(keys) == [1] * N, 30.0, 0.25)
        assert get_all(store, keys, dst) == [OBJECT] * N
        assert int((dst != src).sum()) == 0
    finally:
        store.close()


def test_a_supervised_holder_writes_the_tier_for_requesters_without_a_segment(
        tier_master: EmbeddedMooncake, tier_dir: str) -> None:
    """Upstream's standalone-store topology: a `mooncake_client` owns the segment and the tier; our client
    only requests (global_segment_size 0) and writes no files of its own."""
    holder_cfg = tier_config(tier_dir)
    holder_dir = make_offload_dir(holder_cfg)
    tier_master.start_holder(SEGMENT, offload_env=offload_environment(holder_cfg, holder_dir))
    store = MooncakeStore.connect(tier_config(tier_dir).replace(global_segment_size=0), embedded=tier_master)
    try:
        assert store.offload_dir is None
        src, dst = payload(4), torch.zeros(N, OBJECT, dtype=torch.uint8)
        store.register_buffer(src.data_ptr(), src.nbytes)
        store.register_buffer(dst.data_ptr(), dst.nbytes)
        keys = [f"holder-{i}" for i in range(N)]
        put_all(store, keys, src)
        assert get_all(store, keys, dst) == [OBJECT] * N
        assert int((dst != src).sum()) == 0
        assert files_under(holder_dir)[1] >= (N - SEGMENT // OBJECT) * OBJECT
    finally:
        store.close()


def test_every_lookup_grants_a_lease_that_keeps_the_key_in_memory(tier_master: EmbeddedMooncake) -> None:
    """There is no lease-free existence check (docs/disk-tier.md, "Leases"): after `batch_is_exist` finds a
    key, a remove without force is refused (-706) until the master's lease (0.5 s here) runs out."""
    store = MooncakeStore.connect(StoreConfig(global_segment_size=SEGMENT, local_buffer_size=4 << 20),
                                  embedded=tier_master)
    try:
        buf = torch.ones(4096, dtype=torch.uint8)
        store.register_buffer(buf.data_ptr(), buf.nbytes)
        for call in ("batch_is_exist", "batch_get"):
            key, twin = f"lease-{call}", f"lease-{call}-twin"
            assert store.batch_put([key, twin], [[buf.data_ptr()]] * 2, [[buf.nbytes]] * 2) == [0, 0]
            # the twin, put with it and never looked up, is removable once any lease from the put is over
            assert wait_until(lambda: store.remove(twin) == 0, 10.0, 0.05)
            if call == "batch_is_exist":
                assert store.batch_is_exist([key]) == [1]
            else:
                assert store.batch_get([key], [[buf.data_ptr()]], [[buf.nbytes]]) == [buf.nbytes]
            assert store.remove(key) == StoreCode.OBJECT_HAS_LEASE, call
            assert wait_until(lambda: store.remove(key) == 0, 10.0, 0.05)  # the lease runs out
    finally:
        store.close()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_others_may_write_is_refused_by_name(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(ConfigError) as e:
        MooncakeStore.connect(tier_config(str(d)).with_addresses("127.0.0.1:1", "http://127.0.0.1:1/metadata"))
    assert e.value.field == "disk_offload_dir" and e.value.value == str(d) and "others" in str(e.value)
    assert os.listdir(d) == []  # nothing made in it


def test_a_link_or_another_users_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="not a directory"):
        MooncakeStore.connect(tier_config(str(link)).with_addresses("127.0.0.1:1", "http://127.0.0.1:1/metadata"))
    if os.geteuid() != 0 and os.path.isdir("/"):
        with pytest.raises(ConfigError, match="owned by uid"):
            MooncakeStore.connect(tier_config("/").with_addresses("127.0.0.1:1", "http://127.0.0.1:1/metadata"))


def test_directories_of_clients_killed_without_closing_are_swept_by_the_next_client(tmp_path: Path) -> None:
    """A client killed before its close leaves its tier directory, whose files no one reads again: the next
    client's `make_offload_dir` removes it. A live client's directory (its process holds OWNER_LOCK), an
    unlocked one younger than the grace (a client between making and locking it), other names, links and
    files stay."""
    import signal
    import subprocess
    import sys
    parent = tmp_path / "tier"
    cfg = tier_config(str(parent))
    code = ("import sys, time\nfrom kvledger_connector.config import StoreConfig\n"
            "from kvledger_connector.store.tier import make_offload_dir\n"
            f"print(make_offload_dir(StoreConfig(disk_offload=True, disk_offload_dir={str(parent)!r})), flush=True)\n"
            "time.sleep(600)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        killed_dir, live_dir = (p.stdout.readline().strip() for p in procs)  # type: ignore[union-attr]
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(30)
        (Path(killed_dir) / "1.bucket").write_bytes(b"x" * 4096)  # a file the dead client wrote
        young = parent / "kvledger-tier-young"
        young.mkdir(mode=0o700)  # no OWNER_LOCK yet, just made
        old = parent / "kvledger-tier-old"
        old.mkdir(mode=0o700)
        os.utime(old, (time.time() - 3600, time.time() - 3600))  # no OWNER_LOCK for an hour
        other = parent / "someone-else"
        other.mkdir(mode=0o700)
        (parent / "kvledger-tier-link").symlink_to(other)
        mine = make_offload_dir(cfg)
        try:
            left = sorted(os.listdir(parent))
            assert os.path.basename(killed_dir) not in left and "kvledger-tier-old" not in left
            assert {os.path.basename(live_dir), os.path.basename(mine), "kvledger-tier-young", "someone-else",
                    "kvledger-tier-link"} == set(left), left
            assert os.listdir(mine) == [OWNER_LOCK]
        finally:
            remove_offload_dir(mine)
        assert not os.path.exists(mine)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    assert sweep_offload_dirs(str(parent)) == [live_dir]  # its process is gone now


def test_a_master_without_the_tier_refuses_a_tier_client_by_code(tier_dir: str) -> None:
    with EmbeddedMooncake(rpc_timeout_ms=2000) as plain:
        with pytest.raises(StoreUnavailableError) as e:
            MooncakeStore.connect(tier_config(tier_dir), embedded=plain)
    assert e.value.code == StoreCode.UNABLE_OFFLOAD and "--enable_offload" in str(e.value)
    assert os.listdir(tier_dir) == []  # the client's directory went with it


def test_upstream_enable_offload_turns_the_tier_on(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"enable_offload": True, "disk_offload_dir": str(tmp_path), "mode": "embedded"}))
    path.chmod(0o600)
    cfg = StoreConfig.from_sources(None, env={"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.disk_offload and cfg.disk_offload_dir == str(tmp_path)
    # with a segment the tier needs a directory; a consumer-only worker (standalone-store) needs none
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources({"enable_offload": True}, env={})
    assert e.value.field == "disk_offload_dir"
    cfg = StoreConfig.from_sources({"enable_offload": True, "mode": "standalone-store", "global_segment_size": 0,
                                    "master_server_address": "127.0.0.1:50051",
                                    "metadata_server": "http://127.0.0.1:8080/metadata"}, env={})
    assert cfg.disk_offload and cfg.disk_offload_dir is None


@pytest.mark.parametrize("extra, field", [
    ({"disk_offload": True, "disk_offload_dir": "relative/dir"}, "disk_offload_dir"),
    ({"disk_offload_dir": "/somewhere"}, "disk_offload_dir"),
    ({"disk_offload": True, "disk_offload_dir": "/x", "global_segment_size": "8MB"}, "global_segment_size"),
    ({"disk_offload": "yes"}, "disk_offload"),
    ({"disk_offload_size": "1MB"}, "disk_offload_size"),
    ({"disk_offload_staging_size": 0}, "disk_offload_staging_size"),
    ({"disk_offload_heartbeat_s": 0}, "disk_offload_heartbeat_s"),
    ({"disk_offload_heartbeat_s": 61}, "disk_offload_heartbeat_s"),
])
def test_bad_tier_settings_are_refused_by_name(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_sources(extra, env={})
    assert e.value.field == field and f"{field}=" in str(e.value)
