"""One OpInfo sample through ``kiln.compile``: the generated function, the runs, the category.

See ``sweep.py`` for the categories and the command line; this module is what a worker
process (and the CI test) runs for one (op, form, dtype) task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import keyword
import linecache
import os
import signal
import threading
import traceback
import types
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from opinfo_compare import Problem, alias_problems, compare_leaves, compare_tensor, within_rounding
from torch.utils._pytree import tree_flatten

import kiln

CATEGORIES = (
    "pass",
    "break",
    "fallback",
    "random",
    "skip",
    "mismatch",
    "error",
    "crash",
    "timeout",
)
FAILING = ("mismatch", "error", "crash", "timeout")
DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}
PHASES = ("forward", "backward")
SAMPLE_TIMEOUT_S = 120  # one in-process sample; the pool's per-op timeout is separate
# Random ops OpInfo's metadata does not reveal: op key -> reason.
EXTRA_RANDOM: dict[str, str] = {}


@dataclasses.dataclass
class Record:
    """One result row; ``sample`` is None for a skip that covers the whole (op, dtype)."""

    op: str
    variant: str
    form: str  # "function" (op.op) or "inplace" (op.inplace_variant)
    dtype: str
    phase: str
    sample: int | None
    category: str
    detail: str = ""
    args: str = ""
    reasons: list[str] = dataclasses.field(default_factory=list)
    error: dict[str, Any] | None = None  # mismatches: where, kind, max_abs, max_rel

    @property
    def key(self) -> str:
        return f"{self.op}.{self.variant}" if self.variant else self.op


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work for a worker: samples ``start..`` of one op, form and dtype."""

    op: str
    form: str
    dtype: str
    limit: int | None = None  # the first ``limit`` samples; None: all
    start: int = 0  # the first (sample, phase) unit to run: 2 * sample + phase


class SampleTimeout(BaseException):
    """Raised by the alarm; a BaseException so capture's ``except Exception`` cannot eat it."""


# ---------------------------------------------------------------------------------------------
# The database


def op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


_OPS: dict[str, Any] = {}


def ops() -> dict[str, Any]:
    """Every OpInfo by key (``name`` or ``name.variant_test_name``), in op_db's order."""
    if not _OPS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db
        _OPS.update((op_key(op), op) for op in op_db)
    return _OPS


def random_reason(op: Any) -> str | None:
    """Why this op's values cannot be compared with eager's, from OpInfo's metadata: ops that
    draw random numbers are wrapped in ``wrapper_set_seed`` for PyTorch's own comparisons."""
    if op.has_nondeterministic_output:
        return "output is uninitialized memory (OpInfo.has_nondeterministic_output)"
    code = getattr(op.op, "__code__", None)
    if code is not None and "wrapper_set_seed" in code.co_names:
        return "random stream differs from eager's"
    return EXTRA_RANDOM.get(op_key(op))


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------
# One function per sample


@dataclasses.dataclass
class SampleCall:
    fn: types.FunctionType
    tensors: list[torch.Tensor]  # the sample's own tensors: only ever cloned
    args: str  # short description of the call's arguments


class _Source:
    """Renders a sample's arguments as Python expressions: tensors become parameters, other
    values constants of the function's globals (capture guards them as constants)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.constants: dict[str, Any] = {}

    def expr(self, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            for i, known in enumerate(self.tensors):
                if known is value:
                    return f"t{i}"
            self.tensors.append(value)
            return f"t{len(self.tensors) - 1}"
        if type(value) in (list, tuple) and _has_tensor(value):
            inner = ", ".join(self.expr(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner},)"
        if type(value) is dict and _has_tensor(value):
            items = ", ".join(f"{self.expr(k)}: {self.expr(v)}" for k, v in value.items())
            return "{" + items + "}"
        name = f"c{len(self.constants)}"
        self.constants[name] = value
        return name


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0])


def build_call(op_callable: Callable[..., Any], sample: Any, label: str) -> SampleCall:
    """``def sample_fn(t0, t1, ...): return op(<input>, *<args>, **<kwargs>)``."""
    source = _Source()
    parts = [source.expr(sample.input), *(source.expr(a) for a in sample.args)]
    for name, value in sample.kwargs.items():
        if name.isidentifier() and not keyword.iskeyword(name):
            parts.append(f"{name}={source.expr(value)}")
        else:
            parts.append(f"**{{{name!r}: {source.expr(value)}}}")
    params = ", ".join(f"t{i}" for i in range(len(source.tensors)))
    text = f"def sample_fn({params}):\n    return op({', '.join(parts)})\n"
    filename = f"<opinfo {label}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    scope: dict[str, Any] = {"op": op_callable, **source.constants}
    exec(compile(text, filename, "exec"), scope)
    return SampleCall(scope["sample_fn"], source.tensors, describe(sample))


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.layout != torch.strided:
            flags = f" {str(value.layout).removeprefix('torch.')}"
        else:
            flags = "" if value.is_contiguous() else " nc"
        return f"{dtype}{list(value.shape)}{flags}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_short(v) for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def describe(sample: Any) -> str:
    """``float32[5, 5], (float32[5],), {alpha=2}``: enough to find the sample again."""
    parts = [_short(sample.input)]
    if sample.args:
        parts.append(_short(tuple(sample.args)))
    if sample.kwargs:
        parts.append(_short(sample.kwargs))
    return ", ".join(parts)[:300]


def clone_inputs(
    tensors: list[torch.Tensor], requires_grad: bool, float64: bool = False
) -> list[torch.Tensor]:
    """Fresh leaves with the sample's values, layouts and storage sharing; with
    ``requires_grad`` those the sample marks keep requiring grad (``float64``: floating tensors
    converted, layouts not kept, for the reference run)."""
    storages: dict[tuple[int, str], Any] = {}
    copies = []
    for original in tensors:
        tensor = original.detach()
        if float64 and tensor.is_floating_point():
            copy = tensor.to(torch.float64)
        elif float64 and tensor.is_complex():
            copy = tensor.to(torch.complex128)
        elif tensor.layout != torch.strided or tensor.is_conj() or tensor.is_neg():
            copy = tensor.clone()
        else:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), str(tensor.device))
            if key[0] == 0 or key not in storages:
                storages[key] = storage.clone()
            copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            copy.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())
        if requires_grad and original.requires_grad:
            copy.requires_grad_()
        copies.append(copy)
    return copies


# ---------------------------------------------------------------------------------------------
# Running one sample


@contextlib.contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    """Raise :class:`SampleTimeout` after ``seconds`` (main thread only; elsewhere a no-op)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"sample ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call(fn: Callable[..., Any], args: list[Any], seed: int) -> tuple[Any, Exception | None]:
    torch.manual_seed(seed)
    try:
        return fn(*args), None
    except Exception as error:
        return None, error


def _exception(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return (text[0] if text else type(error).__name__)[:400]


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


@dataclasses.dataclass
class _Run:
    """One side (eager, compiled or float64 eager) of a sample: inputs, outputs, grads."""

    inputs: list[torch.Tensor]
    out: Any = None
    error: Exception | None = None
    grads: list[torch.Tensor | None] | None = None
    grad_error: Exception | None = None


def _forward(
    fn: Callable[..., Any], call: SampleCall, backward: bool, seed: int, float64: bool = False
) -> _Run:
    run = _Run(clone_inputs(call.tensors, backward, float64))
    run.out, run.error = _call(fn, run.inputs, seed)
    return run


def _backward(run: _Run, sample: Any, cotangents: list[torch.Tensor]) -> None:
    """Gradients of every input that requires grad, for the eager outputs' cotangents."""
    try:
        outputs = _differentiable(sample.output_process_fn_grad(run.out))
        if len(outputs) != len(cotangents):
            raise RuntimeError(f"{len(outputs)} outputs require grad, eager had {len(cotangents)}")
        cotangents = [c.to(t.dtype) for c, t in zip(cotangents, outputs, strict=True)]
        wanted = [t for t in run.inputs if t.requires_grad]
        run.grads = list(torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True))
    except Exception as error:
        run.grad_error = error


def _cotangents(sample: Any, eager: _Run, seed: int) -> tuple[list[torch.Tensor] | None, str]:
    """One random cotangent per eager output that requires grad, or why there is nothing to
    differentiate."""
    outputs = _differentiable(sample.output_process_fn_grad(eager.out))
    if not outputs:
        return None, "no eager output requires grad"
    if not any(t.requires_grad for t in eager.inputs):
        return None, "no input requires grad"
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in outputs], ""


def run_sample(op: Any, form: str, dtype: str, index: int, sample: Any, phase: str) -> Record:
    """Run one sample eagerly and compiled and classify it (see the module docstring)."""
    key = op_key(op)
    callable_ = op.op if form == "function" else op.inplace_variant
    call = build_call(callable_, sample, f"{key} {form} {dtype} #{index} {phase}")
    record = Record(op.name, op.variant_test_name, form, dtype, phase, index, "pass", "", call.args)
    backward = phase == "backward"
    seed = _seed(key, form, dtype, index)
    eager = _forward(call.fn, call, backward, seed)
    cotangents, nothing = None, ""
    if backward and eager.error is None:
        try:
            cotangents, nothing = _cotangents(sample, eager, seed)
        except Exception as error:
            eager.error = error
        if cotangents is not None:
            _backward(eager, sample, cotangents)

    kiln.reset()
    compiled_fn = kiln.compile(call.fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _forward(compiled_fn, call, backward, seed)
        if cotangents is not None and compiled.error is None:
            _backward(compiled, sample, cotangents)
    interpreted = [str(w.message) for w in caught if "reference interpreter" in str(w.message)]
    fallbacks = [f"{r.reason.name}: {r.detail}"[:300] for r in kiln.counters.fallbacks]
    fallbacks += [f"INTERPRETER: {m}"[:300] for m in interpreted]
    breaks = [f"{r.reason.name}: {r.detail}"[:300] for r in kiln.counters.graph_breaks]

    reference = _Reference(call, sample, seed, cotangents)
    _classify(record, op, eager, compiled, reference)
    if record.category == "pass" and reference.explained:
        record.detail = "float32 rounding, judged against float64: " + ", ".join(
            reference.explained
        )
    if record.category == "pass" and nothing:
        record.category, record.detail = "skip", nothing
    if record.category in ("pass", "skip") and fallbacks:
        record.category, record.reasons = "fallback", fallbacks
    elif record.category in ("pass", "skip") and breaks:
        record.category, record.reasons = "break", breaks
    elif record.category in ("random", "mismatch", "error"):
        record.reasons = (fallbacks + breaks)[:8]
    return record


def _classify(record: Record, op: Any, eager: _Run, compiled: _Run, reference: _Reference) -> None:
    """Set the record's category and detail from the two runs (breaks and fallbacks aside)."""
    if eager.error is not None or compiled.error is not None:
        _classify_errors(record, eager.error, compiled.error, "")
        return
    key = record.key
    outputs = compare_leaves(compiled.out, eager.out, "out", key)
    inputs_after = compare_leaves(compiled.inputs, eager.inputs, "input", key, check_grad=False)
    problems = [p for p in outputs if not reference.explains(p, compiled.out, eager.out, "out")]
    problems += alias_problems(compiled.out, eager.out, compiled.inputs, eager.inputs)
    problems += [
        p for p in inputs_after if not reference.explains(p, compiled.inputs, eager.inputs, "input")
    ]
    if not problems and (eager.grad_error is not None or compiled.grad_error is not None):
        _classify_errors(record, eager.grad_error, compiled.grad_error, "backward: ")
        return
    if not problems and eager.grads is not None and compiled.grads is not None:
        problems = _grad_problems(compiled.grads, eager.grads, key)
        problems = [
            p for p in problems if not reference.explains(p, compiled.grads, eager.grads, "grad")
        ]
    if not problems:
        return
    random = random_reason(op)
    if random is not None:
        problems = [p for p in problems if p.kind != "values"]
        if not problems:  # only the values differed: they are random numbers
            record.category, record.detail = "random", random
            return
    first = problems[0]
    record.category = "mismatch"
    record.detail = f"{first.where}: {first.message}"[:500]
    record.error = first.as_dict() | {"count": len(problems)}
    if reference.error:
        record.error["float64"] = reference.error


def _classify_errors(
    record: Record, eager: Exception | None, compiled: Exception | None, stage: str
) -> None:
    if eager is not None and compiled is not None and type(eager) is type(compiled):
        record.detail = f"{stage}both raised {_exception(eager)}"
    elif eager is not None and compiled is None:
        record.category = "mismatch"
        record.detail = f"{stage}eager raised {_exception(eager)}; compiled did not"
    elif compiled is not None:
        record.category = "error"
        record.detail = f"{stage}{_exception(compiled)}"
        if eager is not None:
            record.detail += f" (eager raised {type(eager).__name__})"
        record.error = {"raised_at": _where_raised(compiled)}


def _grad_problems(
    compiled: list[torch.Tensor | None], eager: list[torch.Tensor | None], key: str
) -> list[Problem]:
    problems = []
    for i, (a, e) in enumerate(zip(compiled, eager, strict=True)):
        where = f"grad[{i}]"
        if e is None:
            if a is not None and bool(a.detach().ne(0).any()):
                problems.append(Problem(where, "grad", "compiled gives a gradient, eager none"))
            continue
        problem = Problem(where, "grad", "no gradient compiled") if a is None else None
        problem = problem or compare_tensor(a, e, where, key, check_grad=False)
        if problem is not None:
            problem.leaf = i
            problems.append(problem)
    return problems


def _where_raised(error: BaseException) -> str:
    """The innermost kiln frame of a traceback: where to start looking."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f"{os.sep}kiln{os.sep}" in f.filename]
    if not (mine or frames):
        return ""
    frame = (mine or frames)[-1]
    return f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"


class _Reference:
    """The sample run eagerly in float64, made on first use: it tells a float32 rounding
    difference from a wrong result."""

    def __init__(
        self, call: SampleCall, sample: Any, seed: int, cotangents: list[torch.Tensor] | None
    ) -> None:
        self.call, self.sample, self.seed, self.cotangents = call, sample, seed, cotangents
        self.run: _Run | None = None
        self.error = ""
        self.explained: list[str] = []  # differences it showed to be rounding

    def explains(self, problem: Problem, actual: Any, expected: Any, side: str) -> bool:
        if problem.kind != "values" or problem.leaf is None:
            return False
        a = tree_flatten(actual)[0][problem.leaf]
        e = tree_flatten(expected)[0][problem.leaf]
        if not isinstance(e, torch.Tensor) or e.dtype not in (torch.float32, torch.complex64):
            return False
        if self.run is None:
            backward = self.cotangents is not None
            self.run = _forward(self.call.fn, self.call, backward, self.seed, float64=True)
            if self.run.error is None and self.cotangents is not None:
                _backward(self.run, self.sample, self.cotangents)
            failure = self.run.error or self.run.grad_error
            self.error = f"no float64 reference: {_exception(failure)}" if failure else ""
        source = {"out": self.run.out, "input": self.run.inputs, "grad": self.run.grads}[side]
        if self.error or source is None:
            return False
        leaves = tree_flatten(source)[0]
        if problem.leaf < len(leaves) and within_rounding(a, e, leaves[problem.leaf]):
            self.explained.append(f"{problem.where} max abs {problem.max_abs:.3g}")
            return True
        return False


# ---------------------------------------------------------------------------------------------
# Running one task (op, form, dtype)


def tasks_for(key: str, full: bool, limit: int | None) -> list[Task]:
    op = ops()[key]
    forms = ["function", "inplace"] if full and op.inplace_variant is not None else ["function"]
    return [
        Task(key, form, dtype, limit)
        for form in forms
        for dtype in (DTYPES if full else ["float32"])
    ]


def run_task(
    task: Task,
    progress: Callable[[int, str], None] | None = None,
    sample_timeout: float | None = SAMPLE_TIMEOUT_S,
) -> Iterator[Record]:
    """Every record of one task, in order; ``progress(unit, args)`` is called before each
    unit (``2 * sample + phase``) with the sample's description."""
    op = ops()[task.op]
    dtype = DTYPES[task.dtype]
    base = Record(op.name, op.variant_test_name, task.form, task.dtype, "forward", None, "skip")
    differentiable = task.dtype == "float32" and op.supports_autograd and task.form == "function"
    if not op.supports_dtype(dtype, "cpu"):
        yield dataclasses.replace(base, detail=f"OpInfo lists no {task.dtype} support on CPU")
        return
    function = task.form == "function" and task.start == 0
    if task.dtype == "float32" and function and not differentiable:
        yield dataclasses.replace(
            base, phase="backward", detail="OpInfo.supports_autograd is False"
        )
    torch.manual_seed(_seed(task.op, task.dtype))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = list(op.sample_inputs("cpu", dtype, requires_grad=differentiable))
    except Exception as error:
        yield dataclasses.replace(base, detail=f"sample generator raised {_exception(error)}")
        return
    samples = samples[: task.limit] if task.limit is not None else samples
    phases = PHASES if differentiable else PHASES[:1]
    for unit in range(task.start, 2 * len(samples)):
        index, phase = divmod(unit, 2)
        if phase >= len(phases):
            continue
        if progress is not None:
            progress(unit, describe(samples[index]))
        try:
            with _alarm(sample_timeout), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record = run_sample(op, task.form, task.dtype, index, samples[index], PHASES[phase])
        except SampleTimeout as error:
            record = dataclasses.replace(
                base, phase=PHASES[phase], sample=index, category="timeout", detail=str(error)
            )
        except Exception as error:  # the sweep itself failed: say so, never lose the rest
            record = dataclasses.replace(
                base,
                phase=PHASES[phase],
                sample=index,
                category="error",
                detail=f"sweep: {_exception(error)}",
                error={"traceback": _where_raised(error)},
            )
        yield record
