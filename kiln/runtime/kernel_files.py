"""Which kernel cache entries a program uses: an event the builders record (``kiln.recording``).

``kiln.export`` listens while a program compiles and copies these files into the saved program;
``kiln.load`` writes them back into the cache directory, so the builders find them there::

    with recording(KernelFiles) as used:
        compiled(x)
    used[0]  # KernelFiles(kind='cpp', paths=('.../cpp/kernels_ab12.cpp', ...), built=False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelFiles:
    """One cache entry: its files, ``kind`` its folder under the cache directory (``cpp``,
    ``triton``), ``built`` whether this process built it (False: found in the cache)."""

    kind: str
    paths: tuple[str, ...]
    built: bool
