"""Which library runs float32 matmuls on this CPU: PyTorch's BLAS (``torch.mm``) or oneDNN.

PyTorch's CPU ``mm`` and ``addmm`` call the BLAS it was built with (MKL in the x86 wheels).
MKL picks its code path by CPU vendor: on AMD processors it runs a slower path than the chip
allows, while oneDNN, which PyTorch also ships, uses every vector extension it finds. On the
AMD EPYC (AVX-512) CI machine, one thread, the matmuls of the CPU benchmark models took
(``torch.mm`` / oneDNN, microseconds): 256x128x384 238 / 114, 512x512x128 629 / 290,
2048x512x128 2487 / 1097; on Intel CPUs MKL is the fast one. oneDNN also costs about 12 us a
call more, so it only pays above a size: 128x128x128 read 41 / 29 us, 64x64x64 6.5 / 14 us.

The choice is measured, not guessed: once per machine, thread count and PyTorch version, a
256x256x256 product runs through both (interleaved, best of several) and oneDNN is chosen when
it takes at most ``FASTER`` of ``torch.mm``'s time. The answer is cached on disk next to the
built kernels, so later processes do not measure again. ``KILN_CPU_MATMUL`` forces a choice
(``blas`` or ``onednn``).

oneDNN's float32 products accumulate in float32 like MKL's, in another order: results differ
from eager's by rounding (about 1e-6 relative), as two BLAS builds would.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable

import torch

from kiln.config import config, logger

_log = logger("kernels")

FASTER = 0.8  # oneDNN is used when it needs at most this share of torch.mm's time
MIN_FLOPS = 2 * 128**3  # smaller products: oneDNN's fixed cost per call outweighs its speed
_CHOICES: dict[tuple[str, int], bool] = {}


def onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fused linear (``x @ w.T + b``), or None where this PyTorch has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def use_onednn(m: int, k: int, n: int, choice: str = "auto") -> bool:
    """Whether an ``m x k`` by ``k x n`` float32 product on the CPU should run through
    oneDNN rather than ``torch.mm``; ``choice`` ("blas", "onednn") forces the library."""
    if 2 * m * k * n < MIN_FLOPS or not torch.backends.mkldnn.enabled:
        return False
    if choice in ("blas", "onednn"):
        return choice == "onednn" and onednn_linear() is not None
    return onednn_is_faster()


def onednn_is_faster() -> bool:
    """The measured choice for this machine and thread count (cached in memory and on disk)."""
    key = (_machine(), torch.get_num_threads())
    if key in _CHOICES:
        return _CHOICES[key]
    path = os.path.join(config.cache_dir, "cpu_matmul.json")
    name = f"{key[0]}-{key[1]}"
    known = _read(path)
    if name not in known:
        known[name] = _measure()
        _write(path, known)
    _CHOICES[key] = bool(known[name])
    return _CHOICES[key]


@functools.cache
def _machine() -> str:
    """The CPU model and its flags, the PyTorch version: what the answer depends on."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))][:2]
        flags = "".join(lines)
    except OSError:
        flags = platform.processor()
    text = f"{flags}|{platform.machine()}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _measure() -> bool:
    linear = onednn_linear()
    if linear is None:
        return False
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator)
    w = torch.randn(256, 256, generator=generator)
    calls = {
        "blas": lambda: torch.mm(a, w.t()),
        "onednn": lambda: linear(a, w, None, "none", [], ""),
    }
    best = dict.fromkeys(calls, float("inf"))
    with torch.no_grad():
        for _ in range(2):  # warm up (oneDNN builds its kernel on the first call)
            for call in calls.values():
                call()
        for _ in range(5):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(3):
                    call()
                best[name] = min(best[name], time.perf_counter() - start)
    chosen = best["onednn"] <= FASTER * best["blas"]
    _log.info(
        "float32 matmul on this CPU: torch.mm %.0f us, oneDNN %.0f us (256^3): %s",
        best["blas"] / 3 * 1e6,
        best["onednn"] / 3 * 1e6,
        "oneDNN" if chosen else "torch.mm",
    )
    return chosen


def _read(path: str) -> dict[str, bool]:
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, ValueError):
        return {}  # absent or corrupt: measured again
    return data if isinstance(data, dict) else {}


def _write(path: str, data: dict[str, bool]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as file:
            json.dump(data, file)
        os.replace(temporary, path)
    except OSError:
        pass  # an unwritable cache only means measuring again next process
