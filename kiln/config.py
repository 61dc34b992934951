"""Kiln's configuration: the one module that reads environment variables.

``KILN_LOG``   comma-separated logging topics (graph, graph_breaks, recompiles, guards, kernels).
``KILN_DEBUG_DIR``  where graphs and kernels are dumped (default: none).
``KILN_STRICT``  "1" makes backend failures raise instead of falling back to eager.
``KILN_CACHE_DIR``  where built kernels are cached on disk (default: ``~/.cache/kiln``).
``KILN_COMPILE_THREADS``  threads compiling GPU kernels before their first launch (default 8).
``KILN_COMPILE_WORKERS``  ``auto`` (default) compiles GPU kernels in persistent worker
                          processes (one per core, at most 16), started by ``kiln.compile``
                          once CUDA is in use or by the first CUDA graph; a number: that many
                          workers; ``threads``: in this process, on ``KILN_COMPILE_THREADS``.
``KILN_CODEGEN``  force one kernel code generator: ``triton`` (on CPU: Triton's interpreter),
                  ``cpp`` or ``evaluate`` (PyTorch ops; the scheduler's oracle).
``KILN_CPU_MATMUL``  ``blas`` or ``onednn`` forces the library of float32 CPU matmuls (default:
                     measured once per machine, :mod:`kiln.ops.cpu_matmul`).
``KILN_ARTIFACT_CACHE``  "0" turns off the artifact cache (captures kept on disk for the next
                         process, ``kiln/capture/driver/artifact.py``); ``KILN_ARTIFACT_CACHE_MB``
                         bounds its size (default 1024; least recently used files go first).
``KILN_NATIVE_GUARDS``  "0" keeps every tensor guard in Python (default: guard sets with many
                        tensors check them in a C++ extension built once per machine).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field


def _topics(raw: str) -> frozenset[str]:
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


@dataclass
class Config:
    log_topics: frozenset[str] = field(
        default_factory=lambda: _topics(os.environ.get("KILN_LOG", ""))
    )
    debug_dir: str | None = field(default_factory=lambda: os.environ.get("KILN_DEBUG_DIR") or None)
    strict: bool = field(default_factory=lambda: os.environ.get("KILN_STRICT", "") == "1")
    cache_dir: str = field(
        default_factory=lambda: (
            os.environ.get("KILN_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
        )
    )
    # the kernel code generator for every device ("triton", "cpp", "evaluate"); empty: Triton
    # on CUDA, C++ on CPU. "triton" on CPU runs kernels in Triton's interpreter (CI).
    codegen: str = field(default_factory=lambda: os.environ.get("KILN_CODEGEN", ""))
    # GPU kernels compile before their first launch in torch-free worker processes
    # (compile_workers "auto"), or on this many threads of this process ("threads"; 1: one
    # after another).
    compile_threads: int = field(
        default_factory=lambda: int(os.environ.get("KILN_COMPILE_THREADS", "8"))
    )
    compile_workers: str = field(
        default_factory=lambda: os.environ.get("KILN_COMPILE_WORKERS", "auto")
    )
    cpu_matmul: str = field(default_factory=lambda: os.environ.get("KILN_CPU_MATMUL", "auto"))
    artifact_cache: bool = field(
        default_factory=lambda: os.environ.get("KILN_ARTIFACT_CACHE", "1") != "0"
    )
    artifact_cache_bytes: int = field(
        default_factory=lambda: int(os.environ.get("KILN_ARTIFACT_CACHE_MB", "1024")) << 20
    )
    native_guards: bool = field(
        default_factory=lambda: os.environ.get("KILN_NATIVE_GUARDS", "1") != "0"
    )


config = Config()


def logger(topic: str) -> logging.Logger:
    """The logger of one topic; it logs at INFO when the topic is named in ``KILN_LOG``."""
    log = logging.getLogger(f"kiln.{topic}")
    if topic in config.log_topics or "all" in config.log_topics:
        log.setLevel(logging.INFO)
        if not logging.getLogger().handlers and not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[kiln.%(name)s] %(message)s"))
            log.addHandler(handler)
    return log
