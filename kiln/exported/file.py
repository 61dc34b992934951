"""The saved-program file: a zip archive whose first member is a version header.

Members (``docs/export-format.md``)::

    kiln-export           {"format": 1, "torch": "2.13.0", "python": "3.11"} (stored first)
    graph.json            the graph and input spec (kiln/exported/graph_format.py)
    weights.safetensors   parameters, buffers and constants, by graph input name
    program.txt           the printed program, for reading (never executed)
    kernels/cpp/*         C++ cache entries: source, shared library, build record
    kernels/triton/*      Triton kernel modules

Zip checks every member's CRC-32, so a damaged or truncated file is detected before any of it
is used; every way reading can fail becomes one :class:`ExportFileError`. Loading writes the
kernel entries into the cache directory, where the builders look first: a library built for
this machine (same source, compiler and CPU) loads without a build, any other is rebuilt from
its source.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import zipfile
import zlib
from pathlib import Path

import torch

from kiln.config import config
from kiln.errors import KilnError

FORMAT = 1
HEADER = "kiln-export"


class ExportFileError(KilnError):
    """A file that is not a saved Kiln program, is damaged, or has another format version."""


def header() -> bytes:
    fields = {"format": FORMAT, "torch": torch.__version__, "python": platform.python_version()}
    return json.dumps(fields).encode()


def write_archive(path: str | os.PathLike[str], members: dict[str, bytes]) -> None:
    """Write ``members`` after the header, atomically (a temporary file renamed)."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent or ".", suffix=".tmp")
    os.close(handle)
    try:
        with zipfile.ZipFile(temporary, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(HEADER, header())
            for name, data in members.items():
                archive.writestr(name, data)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_archive(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every member but the header, after checking the header's format version."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if not names or names[0] != HEADER:
                raise ExportFileError(f"{path} is not a saved Kiln program (no {HEADER} header)")
            fields = json.loads(archive.read(HEADER))
            if fields.get("format") != FORMAT:
                raise ExportFileError(
                    f"{path} has format version {fields.get('format')!r}; this Kiln reads "
                    f"version {FORMAT} (export it again with this Kiln)"
                )
            return {name: archive.read(name) for name in names[1:]}
    except ExportFileError:
        raise
    except FileNotFoundError:
        raise
    except (
        zipfile.BadZipFile,
        OSError,
        EOFError,
        zlib.error,
        NotImplementedError,
        RuntimeError,
    ) as e:
        # (a damaged zip header can name a compression method, a version or encryption)
        raise ExportFileError(f"{path} is damaged or not a saved Kiln program: {e}") from None
    except (ValueError, KeyError, AttributeError) as error:
        raise ExportFileError(f"{path} has a damaged header: {error}") from None


def seed_cache(members: dict[str, bytes]) -> dict[str, str]:
    """Write the ``kernels/`` members into the kernel cache (missing or different files only);
    returns each member's file there."""
    files = {}
    for name, data in members.items():
        kind, _, file_name = name.removeprefix("kernels/").partition("/")
        unsafe = "/" in file_name or file_name.startswith(".")
        if not name.startswith("kernels/") or unsafe or kind not in ("cpp", "triton"):
            continue
        target = files[name] = Path(config.cache_dir) / kind / file_name
        if target.exists() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, target)
    return {name: str(path) for name, path in files.items()}
