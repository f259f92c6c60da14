"""Files the operator hands the connector by path (a secret, a weights version): read only when they are
this user's regular file, opened without following a link, that no one else may write (or, for a secret,
read). Anyone else on the host who could write such a file could choose our keys or forge our tags."""
from __future__ import annotations

import os
import stat

from kvledger.errors import LedgerInputError


def read_own_file(field_: str, path: str, *, max_bytes: int, private: bool) -> bytes:
    """At most `max_bytes` bytes of `path`, or `LedgerInputError(field_, path)` saying why not. `private`:
    no one else may read it either (mode 0600 or stricter); otherwise no one else may write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
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
        blob = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(blob) > max_bytes:
        raise LedgerInputError(field_, path, f"holds more than {max_bytes} bytes")
    return blob
