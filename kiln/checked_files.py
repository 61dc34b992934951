"""Cache files that detect damage: a magic string, the SHA-256 of the payload, the payload,
written atomically (a temporary file renamed over the old one, so concurrent writers never
leave a partial file). Reading a damaged file warns, removes it and answers None: the caller
rebuilds what it held. Used by the artifact cache (``capture/driver/artifact.py``) and the
compiled-code cache (``code_cache.py``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from pathlib import Path


def read_checked(path: Path, magic: bytes) -> bytes | None:
    """The payload stored at ``path``; None when there is none or it is damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = data[len(magic) + 32 :]
    if data[: len(magic)] != magic or hashlib.sha256(payload).digest() != data[len(magic) :][:32]:
        warnings.warn(f"kiln: cache file {path} is damaged; rebuilding it", stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # (least recently used goes first)
    return payload


def write_checked(path: Path, magic: bytes, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(handle, "wb") as file:
        file.write(magic + hashlib.sha256(payload).digest() + payload)
    os.replace(temporary, path)
