"""Launching a built Triton kernel with as little host time as possible.

A model's call launches every kernel of its program (ResNet-50 inference: 106 a call, BERT:
187), so the host time of one launch multiplies. Three paths, fastest first:

1. **Direct**: when every pointer is 16-byte aligned (what the buffer plan allocates),
   ``TritonLauncher.__call__`` checks the alignment with one ``or`` of the data pointers and
   calls Triton's C launch function itself, with the arguments recorded from one launch
   through Triton's own Python launcher (see :func:`_c_launch`).
2. **Compiled**: another specialization (a misaligned view): the compiled kernel's
   launcher, bound once per specialization (:func:`_direct_runner`).
3. **Slow**: the first launch, an interpreter launch, or anything the faster paths cannot
   vouch for: ``kernel[grid](...)``, which binds and checks every argument.

Measured on the H100's host (``benchmarks/launch_overhead.py``): ``kernel[grid]`` 21 us a
launch, the compiled path 11.9 us.

A kernel that draws random numbers reads its int64 seed through a pointer (``seed_ptr``, not
specialized on alignment), so the seed is one more tensor argument, last: a 1-element int64
tensor on the kernel's device. A CUDA graph bakes scalar arguments in, but a replay reads the
seed tensor afresh, which its runner refreshes in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.config import logger
from kiln.errors import BackendError
from kiln.ir.symbolic import bounded
from kiln.runtime.triton_interpret import interpret_mode

if TYPE_CHECKING:
    from kiln.codegen.sources import TritonSource

# FMA contraction on, as nvcc does for eager's kernels; explicit, because Triton 3.10 changes
# the default (and 3.9 warns when it is left unset)
OPTIONS = {"enable_fp_fusion": True}

_log = logger("kernels")


class SizedLauncher:
    """Launches a kernel written in symbolic sizes (``TritonSource.sizes``):
    ``launch(*tensors, [seed], *sizes)``, the sizes' values last. The binary is one for every
    size (sizes are not specialized); each distinct set of values gets a
    :class:`TritonLauncher` with its grid and its own fast paths."""

    seed_as_tensor = True

    def __init__(self, source: TritonSource, path: Path, function: Any) -> None:
        self.source, self.path, self.function = source, path, function
        self.precompile_error: str | None = None  # (sized kernels have no second form)
        self.count = len(source.sizes)
        text = source.grid_text or str(source.grid[0])
        self.grid_code = compile(text, f"<grid of {source.kernel_name}>", "eval")
        self.by_sizes: dict[tuple[int, ...], TritonLauncher] = {}
        self.model: TritonLauncher | None = None  # one whose C launch call was recorded
        self.__name__ = source.kernel_name

    def __call__(self, *arguments: Any) -> None:
        sizes = arguments[-self.count :]
        launcher = self.by_sizes.get(sizes)
        if launcher is None:
            launcher = bounded(self.by_sizes)[sizes] = self._launcher(sizes)
        launcher(*arguments[: -self.count])
        if self.model is None and launcher.replay is not None:
            self.model = launcher

    def _launcher(self, sizes: tuple[int, ...]) -> TritonLauncher:
        """The launcher of new sizes: their grid, and, once some size's launch has been
        recorded, that record's C call with the new grid (sizes below 2**31 run the same
        binary, and the call's other arguments do not depend on the grid), so that text
        generation, a new length every token, never takes Triton's slow path."""
        programs = eval(self.grid_code, {}, dict(zip(self.source.sizes, sizes, strict=True)))
        grid = (int(programs), 1, 1)
        launcher = TritonLauncher(self.source, self.path, self.function, sizes, grid)
        model = self.model
        if model is None or model.replay is None or model.compiled is None:
            return launcher
        if not grid[0] or not all(-(2**31) <= size < 2**31 for size in sizes):
            return launcher
        recorded = model.replay
        replay = Replay(recorded.c_function, grid, recorded.fixed, recorded.packed)
        replay.bind(recorded.hooks, recorded.stream, recorded.device)
        launcher.launched = True
        launcher.aligned = _direct_runner(model.compiled, grid)  # (under launch hooks)
        launcher.aligned_device = model.aligned_device
        launcher.replay = replay
        return launcher


def _version(text: str) -> tuple[int, int]:
    parts = [*text.split("+")[0].split("."), "0", "0"][:2]
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


class TritonLauncher:
    """Launches one kernel: ``launch(*tensors)`` in kernel-argument order, then, when the
    kernel draws numbers, the seed: an int64 tensor of one element on the kernel's device
    (positionally, or as ``seed=``)."""

    seed_as_tensor = True  # what the host program passes (kiln/codegen/wrapper.py)

    def __init__(
        self,
        source: TritonSource,
        path: Path,
        function: Any,
        sizes: tuple[int, ...] = (),
        grid: tuple[int, int, int] | None = None,
    ) -> None:
        self.source = source
        self.path = path
        self.function = function
        self.specialized = len(source.arguments)  # the pointers Triton specializes on
        self.count = self.specialized + int(source.has_seed)  # the seed's tensor last
        self.grid = grid or source.grid
        self.constexprs = source.constexprs
        # (a kernel in symbolic sizes: their values, passed after the tensors, as the
        # constexprs are: see SizedLauncher)
        self.sizes = sizes
        self.constexpr_values = (*sizes, *source.constexprs.values())
        self.launched = False
        self.fast: dict[tuple[Any, ...], Any] = {}  # specialization -> compiled kernel runner
        self.fast_ok = not source.interpret and _fast_launch_supported()
        # path 1: the all-aligned specialization's runner and its device
        self.aligned: Callable[..., None] | None = None
        self.aligned_device = -1
        # once the aligned runner has recorded Triton's C call: made here, in one frame
        self.replay: Replay | None = None
        # Runs the kernel another way (PyTorch ops) when Triton cannot compile it for the GPU:
        # a compiler bug must cost speed, never the program.
        self.fallback: Callable[..., None] | None = None
        self.failed: str | None = None  # why the fallback runs instead
        self.precompile_error: str | None = None  # how precompiling it failed
        self.compiled: Any = None  # the all-aligned specialization's binary, once launched
        self.__name__ = source.kernel_name

    def __call__(self, *arguments: Any, seed: Any = None) -> None:
        aligned = self.aligned
        if aligned is not None and seed is None and len(arguments) == self.count:
            pointers = 0
            for tensor in arguments:  # (a misaligned seed: path 2, which finds this runner)
                pointers |= tensor.data_ptr()
            if not pointers & 15 and _get_device() == self.aligned_device:
                r = self.replay
                if r is None:
                    aligned(*arguments, *self.constexpr_values)
                    return
                # a profiler's launch hooks (see _hook_set), inline: this runs every launch
                enter, leave = r.hooks.launch_enter_hook, r.hooks.launch_exit_hook
                if (enter is not None and getattr(enter, "calls", True)) or (
                    leave is not None and getattr(leave, "calls", True)
                ):
                    aligned(*arguments, *self.constexpr_values)
                elif r.packed:
                    stream = r.stream(r.device)
                    r.c_function(*r.grid, stream, *r.fixed, (*arguments, *self.constexpr_values))
                else:
                    stream = r.stream(r.device)
                    r.c_function(*r.grid, stream, *r.fixed, *arguments, *self.constexpr_values)
                return
        self._call(arguments, seed)

    def _replayed(self, replay: Replay) -> None:
        self.replay = replay

    def _call(self, arguments: tuple[Any, ...], seed: Any) -> None:
        if seed is not None:
            arguments = (*arguments, seed)
        if self.failed is not None and self.fallback is not None:  # (set only with a fallback)
            self.fallback(*arguments)
            return
        self._check(arguments)
        if self.grid[0] == 0:
            return
        if self.source.interpret:
            with interpret_mode():
                self._launch(arguments)
            return
        if self.fast_ok and self.launched:
            key = _specialization(arguments[: self.specialized])
            runner = self.fast.get(key)
            if runner is not None:
                try:
                    runner(*arguments, *self.constexpr_values)
                    return
                except Exception as error:  # the slow path re-checks everything
                    _log.info("fast launch of %s failed (%s); using kernel[grid]", self.path, error)
                    self.fast_ok = False
                    self.aligned = None
        try:
            compiled = self._launch(arguments)
        except BackendError as error:
            if self.fallback is None or self.source.interpret or self.launched:
                raise
            self.failed = str(error).splitlines()[0]
            how = getattr(self.fallback, "description", "as PyTorch ops")
            warnings.warn(f"kiln: {self.failed}; it runs {how} instead", stacklevel=2)
            self._call(arguments, None)
            return
        if self.fast_ok and compiled is not None and hasattr(compiled, "__getitem__"):
            try:
                key = _specialization(arguments[: self.specialized])
                aligned = all(key[0])
                runner = _direct_runner(compiled, self.grid, self._replayed if aligned else None)
                self.fast[key] = runner
                if aligned:
                    self.aligned, self.aligned_device = runner, key[1]
                    self.compiled = compiled
            except Exception:  # keep the slow path
                self.fast_ok = False

    def _check(self, arguments: tuple[Any, ...]) -> None:
        """Raise TypeError unless ``arguments`` are the kernel's tensors (and seed tensor)."""
        name, has_seed = self.source.kernel_name, self.source.has_seed
        if len(arguments) != self.count:
            raise TypeError(
                f"kernel {name} takes {self.specialized} tensors"
                f"{' and a seed tensor' if has_seed else ''}, got {len(arguments)} arguments"
            )
        if has_seed and not isinstance(arguments[-1], torch.Tensor):
            raise TypeError(
                f"kernel {name} reads its seed through a pointer: pass an int64 tensor of one "
                f"element on its device, not {type(arguments[-1]).__name__}"
            )

    def _launch(self, arguments: tuple[Any, ...]) -> Any:
        kwargs: dict[str, Any] = dict(self.constexprs)
        if not self.source.interpret:
            kwargs.update(OPTIONS, num_warps=self.source.num_warps)
            if self.source.num_stages:
                kwargs["num_stages"] = self.source.num_stages
        if self.launched:
            return self.function[self.grid](*arguments, *self.sizes, **kwargs)
        try:
            result = self.function[self.grid](*arguments, *self.sizes, **kwargs)
        except Exception as error:
            what = "run in the interpreter" if self.source.interpret else "compile or launch"
            raise BackendError(
                f"Triton kernel {self.source.kernel_name} failed to {what} "
                f"(source: {self.path}): {type(error).__name__}: {error}"
            ) from error
        self.launched = True
        return result


def _fast_launch_supported() -> bool:
    """Whether ``CompiledKernel[grid](*bound_args)`` takes the same arguments as
    ``JITFunction.run`` passes to the launcher (Triton 3.3 and later, through 3.9)."""
    import triton

    return (3, 3) <= _version(triton.__version__) < (4, 0)


def _specialization(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """What Triton specializes a compiled kernel on, for our arguments: each pointer's 16-byte
    alignment (the seed's pointer, marked ``do_not_specialize``, is left out) and the device."""
    aligned = tuple([t.data_ptr() % 16 == 0 for t in tensors])
    return (aligned, _current_device())


def _no_cuda_device() -> int:
    return -1


# the current CUDA device, read once a launch: the builtin itself, no Python frame
_get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", _no_cuda_device)


def _current_device() -> int:
    device = _get_device()
    return device if device >= 0 else torch.cuda.current_device()


def _hook_holder() -> Any:
    """Where this Triton keeps its launch enter/exit hooks (set by its profiler)."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None:
        return runtime
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook is set: not None, and (Triton 3.5 and later keep a ``HookChain``,
    never None) with something in its chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_runner(
    compiled: Any,
    grid: tuple[int, int, int],
    on_replay: Callable[[Replay], None] | None = None,
) -> Callable[..., None]:
    """A launch of ``compiled`` that does what ``compiled[grid](*args)`` does, with less Python
    per call. It takes the kernel's tensors (the seed's last), then its constexpr values, which
    Triton's launcher ignores (they are baked into the binary).

    Its first call goes through Triton's Python launcher (the current stream, the compiled
    launcher with the kernel's handle and metadata, the scratch allocations) and records what
    that passes to the C launch function; later calls make that C call themselves when the
    record shows it is the same every time but for the stream and the tensors
    (:func:`_c_launch`), and hand that call to ``on_replay``. With a profiler's launch hooks
    set, or on a Triton without these attributes, it takes Triton's own runner."""
    runner: Callable[..., None] = compiled[grid]  # loads the binary, as Triton's path does
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_stream is None or run is None or function is None or packed is None:
        return runner
    hooks = _hook_holder()
    device = _current_device()
    gx, gy, gz = grid
    replay: Replay | None = None
    probed = False

    def launch(*args: Any) -> None:
        nonlocal replay, probed
        if _hook_set(hooks.launch_enter_hook) or _hook_set(hooks.launch_exit_hook):
            runner(*args)
            return
        if replay is not None:
            replay(args)
            return
        stream = raw_stream(device)
        if probed:
            run(gx, gy, gz, stream, function, packed, None, None, None, *args)
            return
        probed = True
        replay = _c_launch(run, (gx, gy, gz, stream, function, packed), args)
        if replay is not None:
            replay.bind(hooks, raw_stream, device)
            if on_replay is not None:
                on_replay(replay)

    return launch


def _c_launch(run: Any, head: tuple[Any, ...], args: tuple[Any, ...]) -> Replay | None:
    """Launch once through Triton's Python launcher ``run`` (a ``CudaLauncher``) while
    recording the arguments it passes to its C launch function. When those are the grid, the
    stream, then values fixed for this kernel (function handle, flags, metadata, no scratch
    buffers), then the kernel's arguments (spread, or as one tuple), return the
    :class:`Replay` of that C call; else None (Triton's launcher stays).

    The layout differs between Triton releases (3.6 spreads the arguments at the end, 3.9
    passes a tuple and two signature descriptions), which is why it is read from a real launch
    rather than written down."""
    c_function = getattr(run, "launch", None)
    scratch = getattr(run, "global_scratch_size", None), getattr(run, "profile_scratch_size", 0)
    if c_function is None or scratch != (0, 0) or getattr(run, "gsan_enabled", False):
        run(*head, None, None, None, *args)
        return None
    calls: list[tuple[Any, ...]] = []

    def record(*c_args: Any) -> Any:
        calls.append(c_args)
        return c_function(*c_args)

    run.launch = record
    try:
        run(*head, None, None, None, *args)
    finally:
        run.launch = c_function
    if len(calls) != 1:
        return None
    return _replay(c_function, calls[0], head, args)


def _replay(
    c_function: Callable[..., Any],
    recorded: tuple[Any, ...],
    head: tuple[Any, ...],
    args: tuple[Any, ...],
) -> Replay | None:
    """The C call of ``recorded`` with the stream (position 3) and the launch's arguments
    (tensors, constexpr values: the C function skips the constexprs) replaced; None when
    ``recorded`` does not have that shape."""
    gx, gy, gz, stream = head[:4]
    if tuple(recorded[:4]) != (gx, gy, gz, stream) or recorded[4] is not head[4]:
        return None
    count = len(args)
    tail = recorded[-1]
    spread = len(recorded) > 5 + count and all(
        a is b for a, b in zip(recorded[len(recorded) - count :], args, strict=True)
    )
    packed = (
        isinstance(tail, tuple)
        and len(tail) == count
        and all(a is b for a, b in zip(tail, args, strict=True))
    )
    if spread:
        fixed = recorded[4 : len(recorded) - count]
    elif packed:
        fixed = recorded[4:-1]
    else:
        return None
    if any(isinstance(value, torch.Tensor) for value in fixed):
        return None  # a per-launch buffer: not ours to reuse

    return Replay(c_function, (gx, gy, gz), fixed, packed=not spread)


class Replay:
    """Triton's C launch call of one kernel: ``c_function(grid..., stream, *fixed, arguments)``
    with the arguments spread (Triton 3.6) or as one tuple (``packed``, Triton 3.9)."""

    def __init__(
        self,
        c_function: Callable[..., Any],
        grid: tuple[int, int, int],
        fixed: tuple[Any, ...],
        packed: bool,
    ) -> None:
        self.c_function = c_function
        self.grid = grid
        self.fixed = fixed
        self.packed = packed
        self.hooks: Any = None
        self.stream: Callable[[int], int] = lambda device: 0
        self.device = 0

    def bind(self, hooks: Any, stream: Callable[[int], int], device: int) -> None:
        """Where to read the launch hooks; the current stream of ``device``."""
        self.hooks, self.stream, self.device = hooks, stream, device

    def __call__(self, arguments: tuple[Any, ...]) -> None:
        stream = self.stream(self.device)
        if self.packed:
            self.c_function(*self.grid, stream, *self.fixed, arguments)
        else:
            self.c_function(*self.grid, stream, *self.fixed, *arguments)
