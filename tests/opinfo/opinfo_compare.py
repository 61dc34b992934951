"""Eager against compiled: output pytrees, gradients, aliasing, and float32 rounding judged
against a float64 run.

A difference is a :class:`Problem` (where, what kind, how large). Float32 values outside
torch.testing's default tolerance are not yet a mismatch: :func:`within_rounding` accepts them
when compiled is no further from a float64 eager run than a few times eager's own error, which
is how a compiler's reassociated sums and fused kernels are told from wrong results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# torch.testing's defaults (atol, rtol); integers and bool compare exactly.
_TOLERANCES = {
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 1.6e-2),
    torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1e-5, 1.3e-6),
    torch.complex128: (1e-7, 1e-7),
}
# op key -> (atol, rtol, why the default tolerance is wrong for it). Empty: the float64
# arbitration has been enough so far.
LOOSER_TOLERANCES: dict[str, tuple[float, float, str]] = {}
# Compiled may be this many times further from the float64 result than eager is.
_ROUNDING_MULTIPLIER = 3.0


@dataclasses.dataclass
class Problem:
    """One difference between compiled and eager: where, what kind and, for values, how much."""

    where: str
    kind: str  # type, structure, dtype, shape, device, requires_grad, values, aliasing, ...
    message: str
    max_abs: float | None = None
    max_rel: float | None = None
    leaf: int | None = None  # index into the flattened outputs/grads, for float64 arbitration

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _tolerance(dtype: torch.dtype, key: str) -> tuple[float, float]:
    atol, rtol = _TOLERANCES.get(dtype, (0.0, 0.0))
    looser = LOOSER_TOLERANCES.get(key)
    if looser is not None and (dtype.is_floating_point or dtype.is_complex):
        atol, rtol = max(atol, looser[0]), max(rtol, looser[1])
    return atol, rtol


def compare_tensor(
    actual: Any, expected: torch.Tensor, where: str, key: str, check_grad: bool = True
) -> Problem | None:
    """The first difference of ``actual`` (compiled) from ``expected`` (eager)."""
    if not isinstance(actual, torch.Tensor):
        return Problem(where, "type", f"{type(actual).__name__}, eager a Tensor")
    for attr in ("layout", "dtype", "device", "shape"):
        a, e = getattr(actual, attr), getattr(expected, attr)
        if a != e:
            return Problem(where, attr, f"{attr} {a} != eager's {e}")
    if check_grad and actual.requires_grad != expected.requires_grad:
        message = f"requires_grad {actual.requires_grad} != eager's {expected.requires_grad}"
        return Problem(where, "requires_grad", message)
    a, e = actual.detach(), expected.detach()
    if e.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    if not (e.is_floating_point() or e.is_complex()):
        if torch.equal(a, e):
            return None
        differ = (a != e).nonzero()
        worst = (a.to(torch.float64) - e.to(torch.float64)).abs().max().item()
        message = f"{len(differ)} of {e.numel()} elements differ, first at {differ[0].tolist()}"
        return Problem(where, "values", message, max_abs=worst)
    atol, rtol = _tolerance(e.dtype, key)
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    error = (a.to(torch.complex128 if e.is_complex() else torch.float64) - e).abs()
    relative = error / e.abs().clamp_min(1e-30)
    bad = ~close
    max_abs, max_rel = _nanmax(error[bad]), _nanmax(relative[bad])
    first = bad.nonzero()[0].tolist() if e.dim() else []
    message = (
        f"{int(bad.sum())} of {e.numel()} elements differ (max abs {max_abs:.3g}, "
        f"max rel {max_rel:.3g}), first at {first}: {a[tuple(first)].item()!r} vs "
        f"eager {e[tuple(first)].item()!r}"
    )
    return Problem(where, "values", message, max_abs=max_abs, max_rel=max_rel)


def _nanmax(values: torch.Tensor) -> float:
    """Largest value, NaN-aware: a NaN/inf pattern difference is reported as inf."""
    if values.numel() == 0:
        return 0.0
    values = values.to(torch.float64)
    return math.inf if bool(values.isnan().any()) else float(values.max())


def compare_leaves(
    actual: Any, expected: Any, where: str, key: str, check_grad: bool = True
) -> list[Problem]:
    """Compare two output pytrees leaf by leaf; ``Problem.leaf`` indexes the flat leaves."""
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        return [Problem(where, "structure", f"structure {a_spec} != eager's {e_spec}")]
    problems = []
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        path = f"{where}[{i}]" if len(e_leaves) > 1 or e_spec.num_children else where
        if isinstance(e, torch.Tensor):
            problem = compare_tensor(a, e, path, key, check_grad)
        elif type(a) is not type(e):
            problem = Problem(path, "type", f"{type(a).__name__} != {type(e).__name__}")
        elif isinstance(e, float) and _close_floats(a, e):
            problem = None
        else:
            problem = None if a == e else Problem(path, "values", f"{a!r} != eager's {e!r}")
        if problem is not None:
            problem.leaf = i
            problems.append(problem)
    return problems


def _close_floats(a: float, e: float) -> bool:
    return math.isclose(a, e, rel_tol=1.3e-6, abs_tol=1e-5) or (math.isnan(a) and math.isnan(e))


def within_rounding(actual: torch.Tensor, expected: torch.Tensor, reference: Any) -> bool:
    """Compiled is no further from the float64 result than a few times eager's own error (plus
    the usual tolerance): a float32 difference that is rounding, not a wrong result."""
    if not isinstance(reference, torch.Tensor) or reference.shape != expected.shape:
        return False
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a, e, r = (t.detach().to(wide) for t in (actual, expected, reference))
    finite = a.isfinite() & e.isfinite() & r.isfinite()
    if not torch.equal(a[~finite].nan_to_num(0.0), e[~finite].nan_to_num(0.0)):
        return False
    if not torch.equal(a.isnan(), e.isnan()):
        return False
    atol, rtol = _TOLERANCES.get(expected.dtype, (0.0, 0.0))
    eager_error = (e - r).abs()[finite].max().item() if bool(finite.any()) else 0.0
    bound = _ROUNDING_MULTIPLIER * eager_error + atol + rtol * r.abs()
    return bool(((a - r).abs() <= bound)[finite].all())


def alias_problems(
    out_c: Any, out_e: Any, inputs_c: list[torch.Tensor], inputs_e: list[torch.Tensor]
) -> list[Problem]:
    """Outputs that are, or share memory with, an input must do so compiled as in eager."""

    def links(leaf: Any, inputs: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            return [], []
        same = [i for i, t in enumerate(inputs) if t is leaf]
        if not leaf.numel():
            return same, []
        ptr = leaf.untyped_storage().data_ptr()
        shared = [
            i
            for i, t in enumerate(inputs)
            if t.layout == torch.strided and t.numel() and t.untyped_storage().data_ptr() == ptr
        ]
        return same, shared

    problems = []
    a_leaves, e_leaves = tree_flatten(out_c)[0], tree_flatten(out_e)[0]
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=False)):
        (a_is, a_shares), (e_is, e_shares) = links(a, inputs_c), links(e, inputs_e)
        if a_is != e_is:
            message = f"is input {e_is} in eager, input {a_is} compiled"
            problems.append(Problem(f"out[{i}]", "aliasing", message))
        elif a_shares != e_shares:
            message = f"shares memory with inputs {e_shares} in eager, {a_shares} compiled"
            problems.append(Problem(f"out[{i}]", "aliasing", message))
    return problems
