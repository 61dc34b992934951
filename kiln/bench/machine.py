"""The machine a benchmark runs on: its device, its description, its compiler caches.

Every benchmark records where it ran (date, card or CPU, versions), since absolute times only
compare within one machine; and every cold-start number needs compiler caches that are
really empty, which :func:`use_fresh_compiler_caches` provides.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import platform
import shutil
import tempfile

import torch

from kiln.bench.arguments import UsageError


def resolve_device(requested: str | None) -> str:
    """The device to run on: ``requested`` checked against this machine, or the GPU when there
    is one. Raises :class:`UsageError` for a device that is not here."""
    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UsageError(f"unknown device {requested!r} (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {requested}: no CUDA GPU is available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {requested}: only {torch.cuda.device_count()} GPU(s)")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {requested!r} (use cpu, cuda or cuda:N)")
    return str(device)


def environment(device: str, threads: int | None = None) -> dict[str, str]:
    """Where and with what the numbers were measured."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device, threads),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "torchvision": _version("torchvision"),
    }


def device_name(device: str, threads: int | None = None) -> str:
    """The card (``NVIDIA H100 80GB HBM3``) or the CPU model and its thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            ]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} threads (torch uses {threads or torch.get_num_threads()})"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def use_fresh_compiler_caches() -> str:
    """Point Inductor's and Triton's disk caches (of this process and its children) at a new
    empty folder, removed at exit, so the next ``torch.compile`` is a cold start; returns the
    folder."""
    folder = tempfile.mkdtemp(prefix="kiln-bench-caches-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    return folder


def use_threads(threads: int | None) -> None:
    """Set torch's CPU thread count (``None`` keeps torch's choice)."""
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be positive, got {threads}")
    torch.set_num_threads(threads)
