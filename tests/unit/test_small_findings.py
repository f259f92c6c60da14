"""Small hardening rules, each checked where it lives: the spec check's duplicate search is linear and its
sizes bounded (it runs on the model runner's thread), integrity 'off' is said once, and an operator's secret
file too weak to survive an offline guess from its public fingerprint is refused by name."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from kvledger.errors import LedgerInputError
from kvledger_connector import metadata
from kvledger_connector.metadata import LoadSpec, SaveSpec, check_load_spec, check_save_spec
from kvledger_connector.shape import integrity
from kvledger_connector.shape.integrity import IntegrityKey, read_secret

HASH = b"h" * 32


def test_a_spec_naming_24000_ids_twice_is_refused_in_linear_time() -> None:
    """Before: each id of the duplicate report was counted with list.count (16,000 ids took 3 s)."""
    ids = tuple(range(1, 12_001)) * 2
    spec = LoadSpec("r", ids, (HASH,) * len(ids))
    t0 = time.perf_counter()
    with pytest.raises(LedgerInputError) as e:
        check_load_spec(spec, num_blocks=None, num_groups=1)
    took = time.perf_counter() - t0
    assert took < 1.0, f"{took:.2f}s"
    assert e.value.field == "LoadSpec 'r' block_ids" and e.value.value == list(range(1, 9))
    assert "12000 ids in all" in str(e.value)


def test_a_spec_past_the_size_bounds_is_refused_naming_the_field() -> None:
    n = metadata.MAX_SPEC_BLOCK_IDS + 1
    with pytest.raises(LedgerInputError) as e:
        check_load_spec(LoadSpec("r", tuple(range(1, n + 1)), (HASH,) * n), num_blocks=None, num_groups=1)
    assert e.value.field == "LoadSpec 'r' block_ids" and e.value.value == f"{n} ids"
    long_hash = b"h" * (metadata.MAX_BLOCK_HASH_BYTES + 1)
    with pytest.raises(LedgerInputError) as e:
        check_save_spec(SaveSpec("s", 1, 0, 0, 1, (3,), (long_hash,)))
    assert e.value.field == "SaveSpec job 1 ('s') block_hashes" and e.value.value == f"{len(long_hash)} bytes"
    check_save_spec(SaveSpec("s", 1, 0, 0, 1, (3,), (b"h" * metadata.MAX_BLOCK_HASH_BYTES,)))


def test_integrity_off_is_said_once_naming_the_setting(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(integrity, "_off_warned", threading.Event(), raising=False)
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        for _ in range(3):
            key = IntegrityKey.resolve("off", None, embedded=True, generated=lambda: b"", device="cpu")
            assert not key.enabled
    said = [r for r in caplog.records if "integrity 'off'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        IntegrityKey.resolve("checksum", None, embedded=False, generated=lambda: b"", device="cpu")
    assert "integrity 'off'" not in caplog.text


def _secret(tmp_path: Path, name: str, blob: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("what, blob, reason", [
    ("16 random bytes", os.urandom(16), "holds 16 bytes"),
    ("one byte repeated", b"a" * 32, "1 distinct byte values"),
    ("a digit string", b"1234" * 8 + b"5", "5 distinct byte values"),
    ("a repeated pattern", b"0123456789abcdef" * 2, "repeats a 16-byte pattern"),
], ids=["short", "one-byte", "digits", "pattern"])
def test_a_secret_file_too_weak_for_its_public_fingerprint_is_refused_by_name(
        tmp_path: Path, what: str, blob: bytes, reason: str) -> None:
    path = _secret(tmp_path, "weak", blob)
    with pytest.raises(LedgerInputError, match=reason) as e:
        read_secret(path)
    assert e.value.field == "integrity_secret_file" and e.value.value == path, what


@pytest.mark.parametrize("blob", [os.urandom(32), os.urandom(16).hex().encode(), os.urandom(4096)],
                         ids=["32-random", "32-hex", "4096-random"])
def test_a_random_secret_file_is_read(tmp_path: Path, blob: bytes) -> None:
    assert IntegrityKey.of("mac", _secret(tmp_path, "good", blob)).secret == blob
