"""Output types of externs by running them without data, symbolic sizes included.

An extern's meta runs its PyTorch function on stand-ins without data (meta tensors, or
FakeTensors for any function): :func:`meta_by_running`. With symbolic sizes in the operands or
attributes, :func:`_symbolic_meta` runs it at several bindings of the symbols and fits each
output size with a constant, a symbol, ``a * term + b`` or ``term // d``; a size nothing fits
specializes the symbols (guarded), so the types are always right for the sizes they accept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from kiln.errors import TraceError
from kiln.ir.op import ImplFn, MetaFn, Op
from kiln.ir.specialize import sizes_in, substitute_deep
from kiln.ir.symbolic import Dim, Sym, Symbol, substitute
from kiln.ir.types import TensorType


def _stand_in(operand: Any, device: str | None = None) -> Any:
    """A tensor without data of ``operand``'s type, on ``device`` or the operand's own device;
    non-tensors pass through."""
    if not isinstance(operand, TensorType):
        return operand
    sizes = [size for size in operand.shape if isinstance(size, int)]
    if len(sizes) != operand.rank:
        raise NotImplementedError(f"symbolic sizes reached an extern's stand-in: {operand}")
    return torch.empty(sizes, dtype=operand.dtype, device=device or operand.device)


def run_abstractly(impl: ImplFn, attrs: Any, operands: Sequence[Any], *, fake: bool) -> Any:
    """``impl``'s result on stand-ins without data for ``operands`` (types, scalars, None).

    The stand-ins are meta tensors, cheap and enough for a kernel whose outputs live on its
    inputs' device; with ``fake``, FakeTensors on the operands' own devices, for any function
    (one may move tensors between devices). Autocast is off: a prim's dtypes are explicit.
    A function that writes to an operand in place is rejected: a node must be pure.
    """
    with contextlib.ExitStack() as stack:
        # Inference-mode stand-ins have no version counter, which the purity check reads.
        stack.enter_context(torch.inference_mode(False))
        if fake:
            stack.enter_context(FakeTensorMode())
            stack.enter_context(torch._C._DisableAutocast())
        stand_ins = [_stand_in(operand, None if fake else "meta") for operand in operands]
        versions = [t._version for t in stand_ins if isinstance(t, torch.Tensor)]
        try:
            result = impl(attrs, *stand_ins)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            raise TraceError(
                f"data-dependent result: the result of {error} depends on tensor data"
            ) from error
    if versions != [t._version for t in stand_ins if isinstance(t, torch.Tensor)]:
        raise RuntimeError("writes to an operand in place (translate it to a pure op)")
    return result


def _device_of(op: Op, operands: Sequence[Any]) -> torch.device:
    devices = {o.device for o in operands if isinstance(o, TensorType)}
    if len(devices) > 1:
        listed = ", ".join(sorted(map(str, devices)))
        raise RuntimeError(f"{op.printed_name}: operands on several devices ({listed})")
    return devices.pop() if devices else torch.device("cpu")


def meta_by_running(op: Op, impl: ImplFn, *, fake: bool = False) -> MetaFn:
    """The meta function of an extern: run ``impl`` on tensors without data, read the outputs.

    Outputs of meta tensors get the operands' device; ``fake`` runs on FakeTensors instead (see
    :func:`run_abstractly`). What torch raises there (``TypeError``, ``RuntimeError``)
    propagates; the graph builder reports it as an error of ``op``.
    """

    def meta(attrs: Any, *operands: Any) -> TensorType | tuple[TensorType, ...]:
        device = _device_of(op, operands) if not fake else None
        if any(isinstance(o, TensorType) and o.is_symbolic for o in operands) or any(
            isinstance(size, Sym) for size in sizes_in(attrs)
        ):
            return _symbolic_meta(impl, attrs, operands, device, fake)
        result = run_abstractly(impl, attrs, operands, fake=fake)
        types = tuple(
            TensorType(tuple(t.shape), t.dtype, device or t.device)
            for t in (result if isinstance(result, tuple) else (result,))
        )
        return types if isinstance(result, tuple) else types[0]

    return meta


def hint_values(attrs: Any, types: Sequence[TensorType]) -> dict[str, int]:
    sizes = [d for t in types for d in t.shape] + sizes_in(attrs)
    return {s.name: s.hint for size in sizes if isinstance(size, Sym) for s in size.symbols()}


def _symbolic_meta(
    impl: ImplFn, attrs: Any, operands: Sequence[Any], device: Any, fake: bool
) -> TensorType | tuple[TensorType, ...]:
    """The output types of an extern with symbolic sizes in, found by running it at bindings
    of the symbols: the captured sizes, and each size scaled twice by a factor of its own. An
    output size is the constant or the symbol (or product of two) that fits the runs, else
    ``a * term + b`` for such a term fitting three runs; a size nothing fits specializes the
    symbols (guarded), so the types are always right."""
    sizes = [d for o in operands if isinstance(o, TensorType) for d in o.shape]
    sizes += sizes_in([o for o in operands if not isinstance(o, TensorType)]) + sizes_in(attrs)
    symbols: dict[str, Symbol] = {}
    for size in sizes:
        if isinstance(size, Sym):
            symbols.update((symbol.name, symbol) for symbol in size.symbols())
    first = {name: symbol.hint for name, symbol in symbols.items()}
    # Symbol i scaled by the i-th prime p, then by p * p: a size keeps every divisor it had
    # (glu's halving, a split into heads), and no two terms (symbols and products of two)
    # grow alike, so a size that fits one term fits no other.
    factors = _primes(len(first))
    bindings = [first] + [
        {name: hint * factors[i] ** power for i, (name, hint) in enumerate(sorted(first.items()))}
        for power in (1, 2)
    ]

    def run(binding: dict[str, int]) -> Any:
        bound = [
            o.with_(shape=tuple(substitute(d, binding) for d in o.shape))
            if isinstance(o, TensorType)
            else substitute_deep(o, binding)
            for o in operands
        ]
        return run_abstractly(impl, substitute_deep(attrs, binding), bound, fake=fake)

    result = run(first)
    runs: list[Any] = [result if isinstance(result, tuple) else (result,)]
    for binding in bindings[1:]:
        try:
            grown = run(binding)
            runs.append(grown if isinstance(grown, tuple) else (grown,))
        except Exception:  # (the grown sizes break a constraint of the call: specialize)
            runs.append(None)
    terms: list[Any] = [Sym.symbol(n, s.hint, s.low, s.high) for n, s in symbols.items()]
    terms += [a * b for a in terms for b in terms]
    types = []
    for index, tensor in enumerate(runs[0]):
        shape: list[Any] = []
        for dim, size in enumerate(tensor.shape):
            values = [None if r is None else int(r[index].shape[dim]) for r in runs]
            match = _fitting(terms, bindings, values)
            if match is None:
                for symbol in symbols.values():  # nothing fits: these sizes only
                    int(Sym.symbol(symbol.name, symbol.hint, symbol.low, symbol.high))
                match = int(size)
            shape.append(match)
        types.append(TensorType(tuple(shape), tensor.dtype, device or tensor.device))
    return tuple(types) if isinstance(result, tuple) else types[0]


def _primes(count: int) -> list[int]:
    found: list[int] = []
    candidate = 2
    while len(found) < count:
        if all(candidate % p for p in found):
            found.append(candidate)
        candidate += 1
    return found


def _fitting(
    terms: Sequence[Sym], bindings: Sequence[dict[str, int]], values: Sequence[int | None]
) -> Dim | None:
    """The size that takes ``values[i]`` at ``bindings[i]`` (None: that run failed): a constant
    or a term fitting every run, else ``a * term + b`` (integers ``a``, ``b``) or
    ``term // d`` (glu's halving) fitting three; None if none does."""
    known = [
        (binding, value)
        for binding, value in zip(bindings, values, strict=True)
        if value is not None
    ]
    if len(known) < 2:
        return None
    size = known[0][1]
    if all(value == size for _, value in known):
        return size
    for term in terms:
        if all(term.evaluate(binding) == value for binding, value in known):
            return term
    if len(known) < 3:
        return None
    wanted = [value for _, value in known]
    for term in terms:
        at = [term.evaluate(binding) for binding, _ in known]
        slope, rest = divmod(wanted[1] - size, at[1] - at[0])
        offset = size - slope * at[0]
        if slope and not rest and [slope * a + offset for a in at] == wanted:
            return term * slope + offset
        divisor = next((d for d in range(2, 9) if [a // d for a in at] == wanted), None)
        if divisor is not None:
            return term // divisor
    return None
