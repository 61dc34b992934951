"""Registry rows of the extern prims: ops that PyTorch's own kernels run.

Kiln generates no code for an extern; a backend calls the torch kernel. Each extern's meta runs
its impl on meta tensors (:func:`meta_by_running`), so output types are PyTorch's by
construction. The impls add only what makes a prim strict: the matmul family, convolution and
attention take operands of one floating dtype (translations convert), and ``cumsum`` keeps its
dtype (torch promotes integers to int64; the prim takes float or int64 only).

``extern`` is the escape hatch for any torch function: ``Slot(i)`` in its ``args``/``kwargs``
marks where tensor operand ``i`` goes, and its outputs are the tensors of the function's result,
flattened with pytree. :func:`extern_call` emits one from graph values while a graph is built::

    t2 = mm(t0, t1)
    t3, t4 = sort(t0, dim=1, descending=False, stable=False)
    t5, t6 = extern(t0, fn=torch.aminmax, args=(Slot(index=0),), kwargs={'dim': 1})

VJP rules sit next to each row's impl. The matmul family, cumsum, sort and topk differentiate
in prims; convolution, attention and ``extern`` differentiate through an extern node calling a
module-level function of this file (:func:`convolution_backward`, :func:`sdpa_backward`,
:func:`extern_backward`), which PyTorch's own autograd computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    FakeTensor,
)

from kiln.errors import KilnError
from kiln.ir.builder import emit, require_builder
from kiln.ir.graph import Value
from kiln.ir.op import ImplFn, Op, OpDef, Sample, SampleFn, Tag, register
from kiln.ir.specialize import substitute_deep
from kiln.ir.types import FLOATING, Shape, TensorType, carries_gradient, hint_shape, same_shape
from kiln.ops import prims
from kiln.ops.attrs import (
    ConvolutionAttrs,
    CumsumAttrs,
    ExternAttrs,
    GemmAttrs,
    Slot,
    SortAttrs,
    TopkAttrs,
)
from kiln.ops.extern_meta import hint_values, meta_by_running, run_abstractly
from kiln.ops.extern_shapes import EXTERN_FORMULAS, extern_result_types, with_formula
from kiln.ops.sampling import FLOATS, make_tensor

INT64 = frozenset({torch.int64})
# A sample case: the shapes of the operands (None: an absent optional operand) and the attrs.
Case = tuple[tuple[tuple[int, ...] | None, ...], Any]
# vjp(attrs, inputs, outputs, grads) -> one gradient (or None) per input; see kiln.autodiff.rules.
Grads = tuple[Value | None, ...]
VjpFn = Callable[[Any, Sequence[Any], Sequence[Value], Sequence[Value | None]], Grads]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# the checks that make externs strict


def check_floats(op: Op, *operands: torch.Tensor | None) -> None:
    """The tensor operands (None: absent) share one floating dtype; prims do not promote."""
    tensors = [o for o in operands if o is not None]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op.printed_name}: expected a tensor operand, got {tensor!r}")
        if tensor.dtype not in FLOATING:
            raise TypeError(f"{op.printed_name}: takes floating tensors, got {_name(tensor.dtype)}")
        if tensor.dtype != tensors[0].dtype:
            raise TypeError(
                f"{op.printed_name}: operand dtypes {_name(tensors[0].dtype)} and "
                f"{_name(tensor.dtype)} differ (prims do not promote)"
            )


def _check_dim(op: Op, dim: int) -> None:
    if not isinstance(dim, int) or dim < 0:
        raise IndexError(f"{op.printed_name}: dim must be a non-negative int, got {dim!r}")


def shape_samples(cases: Sequence[Case]) -> SampleFn:
    """Samples with a fresh random tensor of the sampled dtype for every shape in ``cases``."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        return [
            Sample(
                tuple(None if s is None else make_tensor(s, dtype, device) for s in shapes),
                attrs,
            )
            for shapes, attrs in cases
        ]

    return samples


def extern(
    op: Op,
    impl: ImplFn,
    *,
    attrs: type | None,
    dtypes: frozenset[torch.dtype],
    samples: SampleFn,
    doc: str,
    vjp: VjpFn,
    fake: bool = False,
) -> OpDef:
    """Register an extern prim computed by ``impl``; its meta runs ``impl`` without data."""
    return register(
        OpDef(
            op,
            meta=with_formula(op, meta_by_running(op, impl, fake=fake)),
            impl=impl,
            attrs=attrs,
            tags=frozenset({Tag.EXTERN}),
            dtypes=dtypes,
            samples=samples,
            vjp=vjp,
            doc=doc,
        )
    )


# ---------------------------------------------------------------------------------------------
# helpers of the VJP rules


def _is_float(operand: Any) -> bool:
    return isinstance(operand, Value) and carries_gradient(operand.type.dtype)


def _transposed(x: Value) -> Value:
    """``x`` with its last two dims swapped."""
    dims = list(range(x.type.rank))
    dims[-2:] = dims[-1], dims[-2]
    return prims.permute(x, dims=tuple(dims))


def _scaled(x: Value, factor: Any) -> Value:
    """``x * factor``, skipped for a factor of 1 as autograd's ``maybe_multiply`` skips it."""
    return x if factor == 1 else prims.mul(x, factor)


def _sum_to(grad: Value, shape: Shape) -> Value:
    """``grad`` summed to ``shape``, which broadcasts to its shape (autograd's ``sum_to``)."""
    lead = grad.type.rank - len(shape)
    sizes = grad.type.shape
    dims = (*range(lead), *(lead + i for i, n in enumerate(shape) if n == 1 != sizes[lead + i]))
    summed = prims.sum(grad, dims=dims) if dims else grad
    return summed if same_shape(summed.type.shape, shape) else prims.reshape(summed, shape=shape)


def _zeros(like: Value) -> Value:
    kind = like.type
    return prims.full(shape=kind.shape, value=0, dtype=kind.dtype, device=kind.device)


def grad_leaf(tensor: Any) -> Any:
    """A fresh autograd leaf of ``tensor``'s value (requiring grad when floating)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    leaf = tensor.clone() if tensor.is_inference() else tensor.detach()
    return leaf.requires_grad_(carries_gradient(tensor.dtype))


def autograd_grads(
    outputs: Sequence[torch.Tensor], leaves: Sequence[Any], grads: Sequence[Any]
) -> Any:
    """The gradients of ``leaves`` that require grad, zeros where none flows."""
    wrt = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    pairs = [
        (o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad
    ]
    if not pairs:
        return tuple(torch.zeros_like(leaf) for leaf in wrt)
    return torch.autograd.grad(
        [o for o, _ in pairs],
        wrt,
        [g for _, g in pairs],
        allow_unused=True,
        materialize_grads=True,
    )


def _spread(inputs: Sequence[Any], grads: Any) -> Grads:
    """``grads`` (one per floating tensor of ``inputs``, in order) as one entry per input."""
    return spread_to([_is_float(item) for item in inputs], grads)


def spread_to(wanted: Sequence[bool], grads: Any) -> Grads:
    """``grads`` (one per true entry of ``wanted``, in order) as one entry per position."""
    found = iter(grads if isinstance(grads, list | tuple) else [grads])
    spread = tuple(next(found) if want else None for want in wanted)
    assert next(found, None) is None, f"more gradients than the {sum(wanted)} wanted"
    return spread


# ---------------------------------------------------------------------------------------------
# matmul family


def _matmul_impl(op: Op, fn: Callable[..., torch.Tensor]) -> ImplFn:
    def impl(attrs: GemmAttrs | None, *operands: torch.Tensor) -> torch.Tensor:
        check_floats(op, *operands)
        scaling = {} if attrs is None else {"beta": attrs.beta, "alpha": attrs.alpha}
        return fn(*operands, **scaling)

    return impl


def _matmul_grads(a: Value, b: Value, g: Value) -> tuple[Value, Value]:
    """The gradients of ``a @ b`` (2-d or batched 3-d): ``g @ bT`` and ``aT @ g``."""
    product = prims.bmm if a.type.rank == 3 else prims.mm
    return product(g, _transposed(b)), product(_transposed(a), g)


def _matmul_vjp(attrs: None, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    a, b = inputs
    return _matmul_grads(a, b, grads[0])


def _gemm_vjp(attrs: GemmAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    """ADDMM and BADDBMM: the matmul's gradients times alpha; bias: ``beta * g`` summed to its
    broadcast shape (scaled before summing, as autograd does)."""
    bias, a, b = inputs
    (g,) = grads
    ga, gb = _matmul_grads(a, b, g)
    bias_grad = _sum_to(_scaled(g, attrs.beta), bias.type.shape)
    return bias_grad, _scaled(ga, attrs.alpha), _scaled(gb, attrs.alpha)


MM_CASES: tuple[Case, ...] = (
    (((3, 4), (4, 5)), None),
    (((1, 4), (4, 1)), None),
    (((5, 1), (1, 6)), None),
    (((3, 0), (0, 5)), None),
    (((0, 4), (4, 5)), None),
)
BMM_CASES: tuple[Case, ...] = (
    (((2, 3, 4), (2, 4, 5)), None),
    (((1, 1, 4), (1, 4, 1)), None),
    (((0, 3, 4), (0, 4, 5)), None),
    (((2, 3, 0), (2, 0, 5)), None),
)
ADDMM_CASES: tuple[Case, ...] = (
    (((3, 5), (3, 4), (4, 5)), GemmAttrs()),
    (((5,), (3, 4), (4, 5)), GemmAttrs(beta=0.5, alpha=2.0)),
    (((1, 5), (3, 4), (4, 5)), GemmAttrs(beta=0, alpha=-1)),
    (((3, 1), (3, 0), (0, 1)), GemmAttrs(beta=2)),
)
BADDBMM_CASES: tuple[Case, ...] = (
    (((2, 3, 5), (2, 3, 4), (2, 4, 5)), GemmAttrs()),
    (((3, 5), (2, 3, 4), (2, 4, 5)), GemmAttrs(beta=0.5, alpha=2.0)),
    (((1, 1, 1), (1, 1, 4), (1, 4, 1)), GemmAttrs(alpha=3)),
    (((0, 3, 5), (0, 3, 4), (0, 4, 5)), GemmAttrs()),
)


# ---------------------------------------------------------------------------------------------
# convolution


def _convolution(
    attrs: ConvolutionAttrs, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    check_floats(Op.CONVOLUTION, x, weight, bias)
    geometry = (attrs.stride, attrs.padding, attrs.dilation, attrs.transposed)
    return torch.convolution(x, weight, bias, *geometry, attrs.output_padding, attrs.groups)


def convolution_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    wanted: tuple[bool, bool] = (True, True),
    **geometry: Any,
) -> tuple[torch.Tensor, ...]:
    """The gradients of those of x and weight that ``wanted`` names and (when ``bias_sizes``
    says there is one) of the bias, by ``aten.convolution_backward``, the kernel eager
    autograd calls; ``geometry``: the fields of :class:`ConvolutionAttrs`. A network's first
    convolution needs no input gradient: computing it anyway was the largest kernel of
    ResNet-50's training step on the H100 (0.8 ms)."""
    a = ConvolutionAttrs(**geometry)
    mask = [wanted[0], wanted[1], bias_sizes is not None]
    settings = (a.stride, a.padding, a.dilation, a.transposed, a.output_padding, a.groups)
    if wanted[1] and _strided_pointwise_on_cpu(a, x, weight):
        rest = [mask[0], False, mask[2]]
        results = list(
            torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, *settings, rest)
            if any(rest)
            else (None, None, None)
        )
        results[1] = _strided_pointwise_weight_grad(a, grad, x, weight)
    else:
        results = torch.ops.aten.convolution_backward(grad, x, weight, bias_sizes, *settings, mask)
    return tuple(result for result, wanted in zip(results, mask, strict=True) if wanted)


def _strided_pointwise_on_cpu(
    attrs: ConvolutionAttrs, x: torch.Tensor, weight: torch.Tensor
) -> bool:
    """A CPU convolution with a 1x1 kernel, a stride above 1 and no padding (a ResNet's
    downsampling shortcut): PyTorch 2.13's CPU weight gradient of a channels-last input
    writes out of bounds at some sizes (``[3, 8, 10, 12]`` into 16 channels, stride 2: a
    crash or a damaged heap, in eager PyTorch too), and Kiln lays CPU convolutions out
    channels-last."""
    return (
        x.device.type == "cpu"
        and x.dim() == 4
        and not attrs.transposed
        and all(size == 1 for size in weight.shape[2:])
        and all(p == 0 for p in attrs.padding)
        and any(s > 1 for s in attrs.stride)
    )


def _strided_pointwise_weight_grad(
    attrs: ConvolutionAttrs, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The weight gradient of a 1x1 convolution with stride ``s``, as that of the stride-1
    convolution of the pixels it reads (``x[..., ::s, ::s]``; PyTorch's kernels for that are
    sound), laid out as the strided call returns it (channels-last for a channels-last x)."""
    (sh, sw), ones = attrs.stride, (1, 1)
    settings = (ones, (0, 0), ones, False, (0, 0), attrs.groups)
    picked = x[:, :, ::sh, ::sw]
    result = torch.ops.aten.convolution_backward(
        grad, picked, weight, None, *settings, [False, True, False]
    )[1]
    laid_out = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    order = torch.channels_last if laid_out else torch.contiguous_format
    # (empty_like, not contiguous(): a 1x1 kernel's strides are ambiguous, and its gradient
    # must have exactly the strides the layout rule predicted)
    return torch.empty_like(result, memory_format=order).copy_(result)


def _convolution_backward_types(attrs: ExternAttrs, *operands: Any) -> Any:
    """The types of :func:`convolution_backward`'s results: x's and weight's (those wanted),
    then the bias gradient, in the gradient's dtype; None when the call is irregular."""
    if len(attrs.args) != 5 or not all(isinstance(a, Slot) for a in attrs.args[:3]):
        return None
    grad, x, weight = (operands[a.index] for a in attrs.args[:3])
    bias_sizes, wanted = attrs.args[3], attrs.args[4]
    types = [grad, x, weight]
    if not all(isinstance(t, TensorType) for t in types):
        return None
    if len({(t.dtype, t.device) for t in types}) != 1 or grad.dtype not in FLOATING:
        return None
    results = [t for t, want in zip((x, weight), wanted, strict=True) if want]
    if bias_sizes is not None:
        results.append(TensorType(tuple(bias_sizes), grad.dtype, grad.device))
    return tuple(results)


EXTERN_FORMULAS[convolution_backward] = _convolution_backward_types


def fields_of(attrs: Any) -> dict[str, Any]:
    return {name: getattr(attrs, name) for name in attrs.__dataclass_fields__}


def _convolution_vjp(
    attrs: ConvolutionAttrs, inputs: Sequence[Any], outputs: Any, grads: Any
) -> Grads:
    x, weight, bias = inputs
    bias_sizes = None if bias is None else bias.type.shape
    wanted = (needs_grad(x), needs_grad(weight))
    arguments = (grads[0], x, weight, bias_sizes, wanted)
    results = extern_call(convolution_backward, arguments, fields_of(attrs))
    return spread_to((*wanted, bias is not None), results)


def needs_grad(operand: Any) -> bool:
    return _is_float(operand) and bool(operand.type.requires_grad)


CONV_CASES: tuple[Case, ...] = (
    (((2, 3, 10), (4, 3, 3), (4,)), ConvolutionAttrs((1,), (1,), (1,))),
    (((2, 4, 7, 6), (6, 2, 3, 3), None), ConvolutionAttrs((2, 1), (1, 0), (1, 2), groups=2)),
    (((1, 2, 5, 4, 4), (3, 2, 2, 2, 2), (3,)), ConvolutionAttrs((1, 1, 1), (0, 1, 0), (1, 1, 1))),
    (((1, 3, 1, 1), (2, 3, 1, 1), (2,)), ConvolutionAttrs((1, 1), (0, 0), (1, 1))),
    (((0, 3, 8), (4, 3, 3), (4,)), ConvolutionAttrs((1,), (0,), (1,))),
    (
        ((1, 4, 5, 5), (4, 3, 3, 3), (3,)),
        ConvolutionAttrs((2, 2), (1, 1), (1, 1), transposed=True, output_padding=(1, 1)),
    ),
    (
        ((2, 4, 6), (4, 1, 3), None),
        ConvolutionAttrs((2,), (0,), (1,), transposed=True, output_padding=(1,), groups=2),
    ),
)


# ---------------------------------------------------------------------------------------------
# cumsum, sort, topk


def _cumsum(attrs: CumsumAttrs, x: torch.Tensor) -> torch.Tensor:
    _check_dim(Op.CUMSUM, attrs.dim)
    if x.dtype not in FLOATING | INT64:
        raise TypeError(f"cumsum: takes a floating or int64 tensor, got {_name(x.dtype)}")
    return torch.cumsum(x, attrs.dim)


def _sort(attrs: SortAttrs, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_dim(Op.SORT, attrs.dim)
    values, indices = torch.sort(x, dim=attrs.dim, descending=attrs.descending, stable=attrs.stable)
    return values, indices


def _topk(attrs: TopkAttrs, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_dim(Op.TOPK, attrs.dim)
    values, indices = torch.topk(x, attrs.k, attrs.dim, largest=attrs.largest, sorted=attrs.sorted)
    return values, indices


def _cumsum_vjp(attrs: CumsumAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    """The cumsum of the cotangent in reverse order along dim."""
    (g,) = grads
    if g.type.rank == 0 or g.type.shape[attrs.dim] in (0, 1):
        return (g,)
    reversed_grad = prims.flip(g, dims=(attrs.dim,))
    return (prims.flip(prims.cumsum(reversed_grad, dim=attrs.dim), dims=(attrs.dim,)),)


def _selection_vjp(
    attrs: SortAttrs | TopkAttrs, inputs: Sequence[Any], outputs: Any, grads: Any
) -> Grads:
    """SORT and TOPK: the values' cotangent scattered back through the indices (the indices are
    distinct, so eager's scatter into zeros); the indices output takes no cotangent."""
    (x,) = inputs
    _, indices = outputs
    if grads[0] is None:
        return (None,)
    return (prims.scatter(_zeros(x), indices, grads[0], dim=attrs.dim),)


CUMSUM_CASES: tuple[Case, ...] = tuple(
    ((shape,), CumsumAttrs(dim))
    for shape, dim in (((3, 5), 0), ((3, 5), 1), ((2, 3, 4), 2), ((), 0), ((0, 4), 0), ((4, 1), 1))
)
SORT_CASES: tuple[Case, ...] = (
    (((3, 5),), SortAttrs(1)),
    (((3, 5),), SortAttrs(0, descending=True)),
    (((2, 3, 4),), SortAttrs(1, stable=True)),
    (((6, 1),), SortAttrs(1, descending=True, stable=True)),
    (((),), SortAttrs(0)),
    (((0, 4),), SortAttrs(0)),
    (((4, 0),), SortAttrs(1)),
)
TOPK_CASES: tuple[Case, ...] = (
    (((3, 5),), TopkAttrs(2, 1)),
    (((3, 5),), TopkAttrs(5, 1, largest=False)),
    (((3, 5),), TopkAttrs(0, 1)),
    (((2, 3, 4),), TopkAttrs(1, 0, sorted=False)),
    (((),), TopkAttrs(1, 0)),
    (((0, 4),), TopkAttrs(2, 1)),
)

# (op, impl, attrs, sampled dtypes, sample cases, doc, vjp) of the externs with plain samples.
_ROWS: tuple[
    tuple[Op, ImplFn, type | None, frozenset[torch.dtype], tuple[Case, ...], str, VjpFn], ...
] = (
    (
        Op.MM,
        _matmul_impl(Op.MM, torch.mm),
        None,
        FLOATS,
        MM_CASES,
        "mm(a, b): a @ b, 2-d",
        _matmul_vjp,
    ),
    (
        Op.BMM,
        _matmul_impl(Op.BMM, torch.bmm),
        None,
        FLOATS,
        BMM_CASES,
        "bmm(a, b): a @ b, 3-d",
        _matmul_vjp,
    ),
    (
        Op.ADDMM,
        _matmul_impl(Op.ADDMM, torch.addmm),
        GemmAttrs,
        FLOATS,
        ADDMM_CASES,
        "addmm(bias, a, b, beta, alpha): beta * bias + alpha * (a @ b), 2-d",
        _gemm_vjp,
    ),
    (
        Op.BADDBMM,
        _matmul_impl(Op.BADDBMM, torch.baddbmm),
        GemmAttrs,
        FLOATS,
        BADDBMM_CASES,
        "baddbmm(bias, a, b, beta, alpha): beta * bias + alpha * (a @ b), 3-d",
        _gemm_vjp,
    ),
    (
        Op.CONVOLUTION,
        _convolution,
        ConvolutionAttrs,
        FLOATS,
        CONV_CASES,
        "convolution(x, weight, bias or None, ...): torch.convolution, 1d/2d/3d",
        _convolution_vjp,
    ),
    (
        Op.CUMSUM,
        _cumsum,
        CumsumAttrs,
        FLOATS | INT64,
        CUMSUM_CASES,
        "cumsum(x, dim), same dtype",
        _cumsum_vjp,
    ),
    (
        Op.SORT,
        _sort,
        SortAttrs,
        FLOATS | INT64,
        SORT_CASES,
        "sort(x, ...) -> values, indices",
        _selection_vjp,
    ),
    (
        Op.TOPK,
        _topk,
        TopkAttrs,
        FLOATS | INT64,
        TOPK_CASES,
        "topk(x, ...) -> values, indices",
        _selection_vjp,
    ),
)
for _op, _impl, _attrs, _dtypes, _cases, _doc, _vjp in _ROWS:
    extern(
        _op, _impl, attrs=_attrs, dtypes=_dtypes, samples=shape_samples(_cases), doc=_doc, vjp=_vjp
    )


# ---------------------------------------------------------------------------------------------
# extern: any torch function


def _call(attrs: ExternAttrs, *operands: Any) -> Any:
    """``attrs.fn``'s result with every ``Slot(i)`` of its arguments replaced by operand i."""

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, Slot):
            return leaf
        if not 0 <= leaf.index < len(operands):
            raise IndexError(f"extern: {leaf} with {len(operands)} operand(s)")
        return operands[leaf.index]

    args, kwargs = pytree.tree_map(fill, (tuple(attrs.args), dict(attrs.kwargs)))
    return attrs.fn(*args, **kwargs)


def _output_tensors(fn: Callable[..., Any], result: Any) -> list[torch.Tensor]:
    """The tensors of ``result``, flattened; anything else cannot be a graph value."""
    if type(result) is tuple and result and all(type(t) is torch.Tensor for t in result):
        return list(result)  # the common case, without pytree (tens of us a call)
    leaves = pytree.tree_leaves(result)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"extern: {getattr(fn, '__name__', fn)} returns {type(leaf).__name__} "
                f"{leaf!r}; only tensors (in tuples, lists, dicts) can be graph values"
            )
    if not leaves:
        raise TypeError(f"extern: {getattr(fn, '__name__', fn)} returns no tensor")
    return leaves


def _extern(attrs: ExternAttrs, *operands: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    result = _call(attrs, *operands)
    if isinstance(result, torch.Tensor):
        return fresh(result, operands)
    return tuple(fresh(t, operands) for t in _output_tensors(attrs.fn, result))


def extern_runner(attrs: ExternAttrs) -> Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]:
    """``_extern`` bound to one ``attrs``, for the host program's hot path: when every Slot is
    a top-level argument or keyword (``convolution_backward(Slot(0), Slot(1), ...)``), the
    call is built by position instead of mapping pytree over the arguments, which cost 27 us a
    call against 9 us for a tiny ``convolution_backward`` itself (CPU)."""
    fn, args, kwargs = attrs.fn, list(attrs.args), dict(attrs.kwargs)
    arg_slots = [(i, a.index) for i, a in enumerate(args) if isinstance(a, Slot)]
    kwarg_slots = [(k, v.index) for k, v in kwargs.items() if isinstance(v, Slot)]
    leaves = pytree.tree_leaves((tuple(args), kwargs))
    if sum(isinstance(leaf, Slot) for leaf in leaves) != len(arg_slots) + len(kwarg_slots):
        return functools.partial(_extern, attrs)  # Slots nested in containers
    count = 1 + max((index for _, index in arg_slots + kwarg_slots), default=-1)

    def run(*operands: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(operands) < count:
            raise IndexError(f"extern: Slot({count - 1}) with {len(operands)} operand(s)")
        call_args = args.copy()
        for position, index in arg_slots:
            call_args[position] = operands[index]
        call_kwargs = kwargs
        if kwarg_slots:
            call_kwargs = {**kwargs, **{key: operands[index] for key, index in kwarg_slots}}
        result = fn(*call_args, **call_kwargs)
        if isinstance(result, torch.Tensor):
            return fresh(result, operands)
        return tuple(fresh(t, operands) for t in _output_tensors(fn, result))

    return run


def fresh(result: torch.Tensor, operands: Sequence[Any]) -> torch.Tensor:
    """``result``, copied when it shares memory with an operand (``x.real`` of a real tensor,
    ``atleast_1d``): the schedule gives an extern's outputs their own memory and may reuse an
    operand's buffer once it is dead."""
    if result.layout is not torch.strided or not result.numel() or result.is_meta:
        return result  # (sparse results, abstract runs: no strided memory to share)
    if isinstance(result, FakeTensor):
        return result
    memory = result.untyped_storage().data_ptr()
    for operand in operands:
        if isinstance(operand, torch.Tensor) and operand.untyped_storage().data_ptr() == memory:
            return result.clone()
    return result


def extern_call(
    fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
) -> Any:
    """Emit an ``extern`` node computing ``fn(*args, **kwargs)`` into the active graph.

    Each :class:`~kiln.ir.Value` in ``args``/``kwargs`` (nested in lists, tuples and dicts too)
    becomes an operand, replaced by its ``Slot``; a concrete tensor is lifted into a graph
    constant first. Returns ``fn``'s result with its tensors replaced by the node's outputs: a
    Value for a tensor, the same container of Values for a tuple or list of tensors. A result
    holding anything but tensors raises ``TypeError``: it cannot be a graph value.
    """
    builder = require_builder()
    slots: dict[Value, Slot] = {}  # operands in first-use order; a repeated Value shares a slot

    def slot(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            leaf = builder.constant(leaf)
        if isinstance(leaf, Value):
            return slots.setdefault(leaf, Slot(len(slots)))
        return leaf

    slotted_args, slotted_kwargs = pytree.tree_map(slot, (tuple(args), dict(kwargs or {})))
    attrs = ExternAttrs(fn, slotted_args, slotted_kwargs)
    outputs = emit(Op.EXTERN, *slots, attrs=attrs)
    # The node's meta accepted the call; the formula's result (or a second abstract run)
    # gives the result's structure.
    types = [value.type for value in slots]
    result = extern_result_types(attrs, *types)
    if result is None:  # (only the structure is read: the captured sizes will do)
        hinted = [t.with_(shape=hint_shape(t.shape)) for t in types]
        result = run_abstractly(
            _call, substitute_deep(attrs, hint_values(attrs, types)), hinted, fake=True
        )
    leaves, structure = pytree.tree_flatten(result)
    if any(isinstance(t, torch.Tensor) and t.layout is not torch.strided for t in leaves):
        raise TypeError(f"extern: {getattr(fn, '__name__', fn)} returns a sparse tensor")
    flat = [outputs] if isinstance(outputs, Value) else list(outputs)
    return pytree.tree_unflatten(flat, structure)


def extern_backward(
    attrs: ExternAttrs, operands: Sequence[Any], grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """The gradients of the floating tensors of ``operands`` (the forward's, which the Slots of
    ``attrs`` index) given ``grads``, one cotangent (or None) per flattened output, by re-running
    ``attrs.fn`` under autograd. Each operand is its own leaf, even one passed twice."""
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [grad_leaf(operand) for operand in operands]
        result = _extern(attrs, *leaves)
        outputs = [result] if isinstance(result, torch.Tensor) else list(result)
        return tuple(autograd_grads(outputs, leaves, grads))


# Externs with a VJP of their own (the general one re-runs the function under autograd);
# kiln.ops.attention registers the CPU flash kernel's.
EXTERN_VJPS: dict[Callable[..., Any], Callable[..., Grads]] = {}


def _extern_vjp(attrs: ExternAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    own = EXTERN_VJPS.get(attrs.fn)
    if own is not None:
        return own(attrs, inputs, outputs, grads)
    # attrs travels whole, a leaf to extern_call: its Slots index ``inputs``, not the new node.
    try:
        results = extern_call(extern_backward, (attrs, list(inputs), list(grads)))
    except KilnError as error:  # PyTorch's backward needs data to say its result's type
        name = getattr(attrs.fn, "__name__", "extern")
        raise NotImplementedError(f"{name}: the backward cannot be typed: {error}") from error
    return _spread(inputs, results)


def _extern_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    def x(*shape: int) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    one = (Slot(0),)
    cases = [
        Sample((x(3, 4),), ExternAttrs(F.softplus, one, {"beta": 2.0, "threshold": 1.0})),
        Sample((x(3, 4),), ExternAttrs(torch.linalg.vector_norm, one, {"ord": 3, "dim": (1,)})),
        Sample((x(3, 4),), ExternAttrs(torch.aminmax, one, {"dim": 1}), note="two outputs"),
        Sample(
            (x(2, 3), x(4, 3)),
            ExternAttrs(torch.cat, ([Slot(0), Slot(1)],), {"dim": 0}),
            note="slots nested in a list",
        ),
        Sample((x(0, 3),), ExternAttrs(torch.exp, one), note="empty"),
    ]
    if dtype == torch.float32:  # CPU has no float16/bfloat16 kernel for bessel_j0
        cases.append(Sample((x(5),), ExternAttrs(torch.special.bessel_j0, one)))
    return cases


extern(
    Op.EXTERN,
    _extern,
    attrs=ExternAttrs,
    dtypes=FLOATS,
    samples=_extern_samples,
    doc="extern(*tensors, fn, args, kwargs): fn's result, its tensors flattened",
    vjp=_extern_vjp,
    fake=True,  # any function: it may move tensors between devices
)
