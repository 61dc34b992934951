"""``Options``: how one ``kiln.compile`` call compiles, carried through every stage.

``kiln.compile(fn, backend=..., mode=..., fullgraph=..., dynamic=..., options={...})`` builds
one ``Options``; capture keys its caches by it (the same function compiled with other options
gets its own entries), and the pipeline hands it to the backend, the code generator and the
host program. Environment variables (read in :mod:`kiln.config`) only set the defaults:
``KILN_STRICT`` for ``strict``, ``KILN_CODEGEN`` for ``codegen``, ``KILN_CPU_MATMUL`` for
``cpu_matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kiln.config import config

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CODEGENS = ("", "triton", "cpp", "evaluate")
CPU_MATMULS = ("auto", "blas", "onednn")


@dataclass(frozen=True)
class Options:
    """One compile's choices. Frozen and hashable: capture's caches are keyed by it."""

    backend: str = "kiln"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    recompile_limit: int = 8
    # Raise where Kiln would fall back (a backend failure, a capture error eager would not
    # raise) instead of warning and running eagerly.
    strict: bool = field(default_factory=lambda: config.strict)
    # The kernel code generator for every device ("triton", "cpp", "evaluate"); empty: Triton
    # on CUDA, C++ on CPU. "triton" on CPU runs kernels in Triton's interpreter (tests, CI).
    codegen: str = field(default_factory=lambda: config.codegen)
    # The library of float32 CPU matmuls: "auto" (measured once per machine), "blas", "onednn".
    cpu_matmul: str = field(default_factory=lambda: config.cpu_matmul)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES[1:]}")
        if self.codegen not in CODEGENS:
            raise ValueError(f"unknown codegen {self.codegen!r}; expected one of {CODEGENS[1:]}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(
                f"unknown cpu_matmul {self.cpu_matmul!r}; expected one of {CPU_MATMULS}"
            )

    @classmethod
    def of(cls, extra: dict[str, Any] | None, **arguments: Any) -> Options:
        """``kiln.compile``'s arguments plus its ``options`` dict (the fields after
        ``dynamic``), checked: an unknown key is an error naming the known ones."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)} - set(arguments)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown options: {unknown} (known: {sorted(known)})")
        return cls(**arguments, **extra)
