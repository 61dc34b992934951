"""Build and load C++ kernels: source -> shared library (cached on disk) -> Python callables.

``build(source, name)`` compiles one translation unit with g++ into a shared library under
``<cache_dir>/cpp/`` and loads it with ctypes. The file name carries the sha256 of the source,
the flag plans, the compiler version and the host CPU, so a second process (or a second
identical graph) loads the cached library without compiling. The generated ``.cpp`` stays next
to the ``.so`` for users to read; a ``.json`` beside them records the flags that worked and the
library's own sha256, which is checked before loading (a damaged entry is rebuilt). Builds
write to a temporary file and rename it, under a lock file, so concurrent processes never see
half a library.

Flags, tried in order: ``-O3 -march=native -fopenmp`` with libmvec math; then ``-O2`` without
``-march=native`` or libmvec; then without OpenMP (one warning: kernels run on one thread).
``-fno-math-errno`` (``sqrtf``) and ``-fno-trapping-math`` (``floorf``, blends) let more loops
vectorize and change no result: NaN stays NaN, only errno and FP exception flags go. There is
no ``-ffast-math``, which would break NaN semantics. ``-fno-tree-pre``: GCC 12's partial
redundancy elimination turns a NaN test of a select (a max pool's ``isnan`` of a ReLU) into
branches and leaves the loop scalar, with a mispredicted branch per element (a max pool over
channels-last rows: 22 ms, 0.5 ms without it); elsewhere it changed nothing measurable
(``benchmarks/cpp_flags.py``, RESULTS.md).

``load_kernels(library)`` (a :class:`~kiln.codegen.sources.CppSource`) gives one callable per
kernel taking CPU tensors in kernel-argument order (then the seed as an int) and passing their
data pointers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from kiln.codegen.sources import CppSource
from kiln.config import config, logger
from kiln.errors import CompilerNotFoundError, IndexOutOfBounds, KernelBuildError
from kiln.recording import record
from kiln.runtime.kernel_files import KernelFiles

COMPILER = "g++"
COMMON_FLAGS = (
    "-shared",
    "-fPIC",
    "-std=c++17",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-tree-pre",
    "-Wl,-z,defs",
)
FLAG_PLANS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp", "-DKILN_SIMD_MATH"),
    ("-O2", "-fopenmp"),
    ("-O2",),  # no OpenMP: the pragmas are ignored, kernels run on one thread
)
BUILD_TIMEOUT_S = 600
STDERR_LINES = 40

_log = logger("kernels")
_warned_no_openmp = False

Launcher = Callable[..., None]


def cpp_compiler_available() -> bool:
    """Whether a C++ compiler is on PATH (the backend warns once and falls back when not)."""
    return shutil.which(COMPILER) is not None


def _compiler() -> str:
    path = shutil.which(COMPILER)
    if path is None:
        raise CompilerNotFoundError(
            f"no C++ compiler: {COMPILER!r} is not on PATH, so C++ kernels cannot be built "
            "(install g++, or use the eager backend)"
        )
    return path


@functools.lru_cache(maxsize=8)
def compiler_version(compiler: str) -> str:
    """The compiler's identity for cache keys (its first ``--version`` line and target)."""
    result = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=60
    )
    machine = subprocess.run(
        [compiler, "-dumpmachine"], capture_output=True, text=True, check=False, timeout=60
    )
    first = result.stdout.splitlines()[0] if result.stdout else ""
    return f"{first} {machine.stdout.strip()}"


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """The CPU model and features (``-march=native`` code must not load on another CPU that
    shares the cache directory)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def cache_key(source: str, compiler: str) -> str:
    """sha256 of the source, the flag plans, the compiler and the host CPU."""
    digest = hashlib.sha256()
    parts = (source, repr(COMMON_FLAGS), repr(FLAG_PLANS), compiler_version(compiler))
    for part in (*parts, host_identity()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def build(
    source: str,
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    symbols: Sequence[str] = (),
) -> ctypes.CDLL:
    """The loaded library of ``source`` (built, or found in the cache). ``symbols`` are the
    functions it must export; a cached library that lacks one, fails to load or whose bytes
    changed is rebuilt. A compile error raises :class:`~kiln.errors.KernelBuildError`."""
    compiler = _compiler()
    directory = Path(cache_dir if cache_dir is not None else config.cache_dir) / "cpp"
    directory.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_]", "_", name)[:40] or "kernels"
    stem = directory / f"{safe}_{cache_key(source, compiler)[:32]}"
    _copy_to_debug_dir(source, safe)
    library = _load_cached(stem, symbols)
    built = False
    if library is None:
        with _locked(stem):
            library = _load_cached(stem, symbols)  # another process may have built it meanwhile
            if library is None:
                _compile(compiler, source, stem)
                library, built = _load_cached(stem, symbols), True
    if library is None:
        raise KernelBuildError(f"the library built from {stem}.cpp does not load")
    paths = tuple(str(stem.with_suffix(suffix)) for suffix in (".cpp", ".so", ".json"))
    record(KernelFiles("cpp", paths, built))
    return library


def _copy_to_debug_dir(source: str, name: str) -> None:
    if config.debug_dir:
        directory = Path(config.debug_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.cpp").write_text(source)


def _load_cached(stem: Path, symbols: Sequence[str]) -> ctypes.CDLL | None:
    library_path = stem.with_suffix(".so")
    meta_path = stem.with_suffix(".json")
    if not library_path.exists() or not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("sha256") != _file_hash(library_path):
            raise OSError("the library's sha256 differs from the one recorded at build time")
        library = ctypes.CDLL(str(library_path))
        for symbol in symbols:
            getattr(library, symbol)
    except (OSError, ValueError, AttributeError) as error:
        _log.info("rebuilding damaged cache entry %s: %s", library_path, error)
        for path in (library_path, meta_path):
            path.unlink(missing_ok=True)
        return None
    _log.info("loaded %s (%s)", library_path, " ".join(meta.get("flags", [])))
    return library


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def _locked(stem: Path) -> Iterator[None]:
    """An exclusive lock on ``stem.lock`` while building (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(stem.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _compile(compiler: str, source: str, stem: Path) -> None:
    """Compile with the first flag plan that works; the ``.so`` appears by an atomic rename."""
    global _warned_no_openmp
    source_path = stem.with_suffix(".cpp")
    _write_atomically(source_path, source.encode())
    failures: list[str] = []
    for flags in FLAG_PLANS:
        handle, temporary = tempfile.mkstemp(dir=stem.parent, prefix=stem.name, suffix=".so")
        os.close(handle)
        command = [compiler, *flags, *COMMON_FLAGS, str(source_path), "-o", temporary, "-lm"]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S
            )
            if result.returncode != 0:
                failures.append(result.stderr or result.stdout)
                continue
            digest = _file_hash(Path(temporary))
            os.replace(temporary, stem.with_suffix(".so"))
        finally:
            Path(temporary).unlink(missing_ok=True)
        meta = {"flags": [*flags, *COMMON_FLAGS], "sha256": digest, "compiler": compiler}
        _write_atomically(stem.with_suffix(".json"), json.dumps(meta).encode())
        _log.info("built %s with %s", stem.with_suffix(".so"), " ".join(flags))
        if "-fopenmp" not in flags and not _warned_no_openmp:
            _warned_no_openmp = True
            warnings.warn(
                "kiln: C++ kernels are built without OpenMP (the compiler rejected -fopenmp); "
                "they run on one thread",
                stacklevel=3,
            )
        return
    raise KernelBuildError(
        f"{COMPILER} could not compile the generated kernels in {source_path}:\n"
        + _trim(failures[0])
    )


def _trim(text: str) -> str:
    lines = text.strip().splitlines()
    if len(lines) > STDERR_LINES:
        lines = [*lines[:STDERR_LINES], f"... ({len(lines) - STDERR_LINES} more lines)"]
    return "\n".join(line[:400] for line in lines)


def load_kernels(
    library: CppSource, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, Launcher]:
    """Build ``library`` (from :func:`~kiln.codegen.cpp.cpp_library`) and give each entry's
    callable: ``launch(*tensors[, seed])`` with CPU tensors in kernel-argument order. Argument
    types are set once, so a call costs a few microseconds. A kernel in symbolic sizes takes
    their values last, as ints."""
    symbols = [entry.name for entry in library.entries]
    built = build(library.source, library.name, cache_dir, symbols)
    launchers: dict[str, Launcher] = {}
    for entry in library.entries:
        function = getattr(built, entry.name)
        count, has_seed = entry.argument_count, entry.has_seed
        integers = int(has_seed) + entry.sizes  # (the seed, then symbolic sizes' values)
        function.argtypes = [ctypes.c_void_p] * count + [ctypes.c_int64] * integers
        function.restype = None
        launch = _launcher(function, entry.name, count, integers)
        if entry.checks_indices:
            status = (ctypes.c_int64 * 3).in_dll(built, "kiln_index_error")
            launch = _index_checked(launch, status)
        launchers[entry.name] = launch
    return launchers


def _launcher(function: Callable[..., None], name: str, count: int, integers: int) -> Launcher:
    expected = count + integers

    def launch(*arguments: torch.Tensor | int) -> None:
        if len(arguments) != expected:
            raise TypeError(f"kernel {name} takes {expected} arguments, got {len(arguments)}")
        pointers = [tensor.data_ptr() for tensor in arguments[:count]]  # type: ignore[union-attr]
        if integers:
            function(*pointers, *arguments[count:])
        else:
            function(*pointers)

    launch.__name__ = name
    return launch


def _index_checked(launch: Launcher, status: ctypes.Array[ctypes.c_int64]) -> Launcher:
    """``launch``, raising eager's IndexError when the kernel met a gathered index outside its
    dimension (the prelude's ``kiln_checked_index`` records the first one in ``status``)."""

    def checked(*arguments: torch.Tensor | int) -> None:
        launch(*arguments)
        if status[0]:
            index, size = status[1], status[2]
            status[0] = 0
            raise IndexOutOfBounds.of(index, size)

    checked.__name__ = launch.__name__
    return checked
