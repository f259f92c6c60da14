"""Files the operator hands the connector by path (a secret, a weights version, the ``MOONCAKE_CONFIG_PATH``
settings; the trace it writes): used only when they are this user's regular file, opened without following a
link, that no one else may write (or, for a secret, read), read up to a size bound. Anyone else on the host
who could write such a file could choose our keys, forge our tags, or point us at their master with
integrity off; a link planted at the trace's path would have us append to the file it names. A directory of
ours is only as safe as the directories above it: whoever may rename entries in one of them can swap ours for
theirs (`unsafe_ancestor`)."""
from __future__ import annotations

import os
import stat
from typing import TextIO

from kvledger.errors import LedgerInputError


def _own_fd(field_: str, path: str, flags: int, *, private: bool) -> int:
    """`path` opened with `flags`, without following a link, and checked: this user's regular file that no
    one else may write (`private`: nor read). `LedgerInputError(field_, path)` saying why not."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except FileNotFoundError:
        raise LedgerInputError(field_, path, "not found") from None
    except OSError as e:
        raise LedgerInputError(field_, path, f"cannot be opened without following links: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LedgerInputError(field_, path, "is not a regular file")
        if st.st_uid != os.geteuid():
            raise LedgerInputError(field_, path, f"is owned by uid {st.st_uid}, not this user ({os.geteuid()})")
        mode = stat.S_IMODE(st.st_mode)
        if private and mode & 0o077:
            raise LedgerInputError(field_, path, f"has mode {mode:04o}: others may read it; chmod 600")
        if mode & 0o022:
            raise LedgerInputError(field_, path, f"has mode {mode:04o}: others may write it; chmod go-w")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own_file(field_: str, path: str, *, max_bytes: int, private: bool) -> bytes:
    """At most `max_bytes` bytes of `path`, or `LedgerInputError(field_, path)` saying why not. `private`:
    no one else may read it either (mode 0600 or stricter); otherwise no one else may write it."""
    fd = _own_fd(field_, path, os.O_RDONLY, private=private)
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= max_bytes:  # a read may return less than asked
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise LedgerInputError(field_, path, f"holds more than {max_bytes} bytes")
    return b"".join(chunks)


def append_own_file(field_: str, path: str) -> TextIO:
    """`path` opened to append text (created mode 0600 when absent), checked as `read_own_file` checks a
    file others may read: a link planted there would otherwise have us write where it points."""
    return os.fdopen(_own_fd(field_, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, private=False), "a",
                     encoding="utf-8")


def unsafe_ancestor(path: str) -> str | None:
    """Why a directory above `path` lets another user replace it, or None: each directory from `path`'s real
    parent up to / must be owned by root or this user and, when others may write to it, be sticky (as /tmp
    is: there only an entry's owner may rename or remove it)."""
    me = os.geteuid()
    d = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            st = os.stat(d)
        except OSError as e:
            return f"its ancestor {d!r} cannot be read: {e.strerror or e}"
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, me):
            return f"its ancestor {d!r} is owned by uid {st.st_uid}, who may replace what is in it"
        if mode & 0o002 and not mode & stat.S_ISVTX:
            return (f"its ancestor {d!r} has mode {mode:04o}: others may write to it without the sticky bit, "
                    f"so another user may replace what is in it")
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
