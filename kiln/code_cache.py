"""Generated Python compiled once per machine: the code objects of guard functions, host
programs, head functions and Triton kernel modules kept on disk beside the artifact cache
(``<cache_dir>/artifacts/c-<key>.kart``, evicted with it), so that a warm start unmarshals them
instead of compiling the sources again (GPT-2's warm start on the H100 spent 0.22 s in
``compile``; Python's own ``__pycache__`` is off where ``PYTHONDONTWRITEBYTECODE`` is set).

The key hashes the source and the interpreter's bytecode version; code read back is renamed to
the file name asked for (host programs' names carry a serial number for their tracebacks). A
file holds a SHA-256 of the marshalled code (``checked_files.py``): a damaged file
(unmarshalling arbitrary bytes can crash the interpreter) is never loaded, only reported and
compiled over. Off with the artifact cache (``KILN_ARTIFACT_CACHE=0``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import marshal
import types
from pathlib import Path

from kiln.checked_files import read_checked, write_checked
from kiln.config import config

_MAGIC = b"KILNCODE1" + importlib.util.MAGIC_NUMBER


def compiled(source: str | bytes, filename: str) -> types.CodeType:
    """``compile(source, filename, "exec")``, from the disk when this machine compiled it."""
    if not config.artifact_cache:
        return compile(source, filename, "exec", dont_inherit=True)
    text = source.encode() if isinstance(source, str) else source
    digest = hashlib.sha256(_MAGIC + text).hexdigest()[:40]
    path = Path(config.cache_dir) / "artifacts" / f"c-{digest}.kart"
    payload = read_checked(path, _MAGIC)
    if payload is not None:
        with contextlib.suppress(ValueError, EOFError, TypeError):  # (another Python's code)
            code = marshal.loads(payload)
            if isinstance(code, types.CodeType):
                return _renamed(code, filename)
    code = compile(source, filename, "exec", dont_inherit=True)
    with contextlib.suppress(OSError):  # (a read-only cache: compiled every time)
        write_checked(path, _MAGIC, marshal.dumps(code))
    return code


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects nested in it reporting ``filename``."""
    if code.co_filename == filename:
        return code
    consts = tuple(
        _renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)
