"""Translations of matrix products: matmul (``@``), mm, bmm, addmm, baddbmm, dot, mv, outer,
F.linear and tensordot. einsum lives in ``einsum.py``.

Floating products go to the extern prims ``mm``/``bmm``/``addmm``/``baddbmm`` (PyTorch's own
kernels, so results match eager bit for bit); those take floating operands only, so integer
products (which eager computes on CPU) multiply and sum exactly instead. Like eager, operands
must share one dtype: matrix products never promote.

``matmul`` follows eager's plan: 1-d operands get a size-1 dim that the result drops again, a
batched left operand times a matrix folds its batch into the rows (one ``mm``), and other
batched products broadcast their batch dims and run one ``bmm`` on 3-d reshapes::

    x @ w   # x: f32[2, 3, 4], w: f32[4, 5]
    t2 = reshape(x, shape=(6, 4)); t3 = mm(t2, w); t4 = reshape(t3, shape=(2, 3, 5))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kiln.ir.graph import Value
from kiln.ir.types import Shape, same_shape
from kiln.ops import prims
from kiln.ops.sampling import NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, translation

Scalar = bool | int | float


# ---------------------------------------------------------------------------------------------
# shared helpers (einsum, attention and the nn translations use them too)


def check_same_dtype(op: str, *values: Value | None) -> torch.dtype:
    """The one dtype of ``values`` (None skipped); RuntimeError like eager when they differ."""
    dtypes = [v.type.dtype for v in values if v is not None]
    for dtype in dtypes[1:]:
        if dtype != dtypes[0]:
            raise RuntimeError(
                f"{op}: expected m1 and m2 to have the same dtype, but got: "
                f"{_dtype_name(dtypes[0])} != {_dtype_name(dtype)}"
            )
    if dtypes and dtypes[0] == torch.bool:
        raise RuntimeError(f"\"{op}\" not implemented for 'Bool'")
    return dtypes[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def reshape(value: Value, shape: Shape) -> Value:
    """``value`` reshaped, skipping the node when the shape already is ``shape``."""
    if same_shape(value.type.shape, shape):
        return value
    return prims.reshape(value, shape=tuple(shape))


def transpose_last(value: Value) -> Value:
    """``value`` with its last two dims swapped."""
    rank = value.type.rank
    dims = (*range(rank - 2), rank - 1, rank - 2)
    return prims.permute(value, dims=dims)


def product(a: Value, b: Value) -> Value:
    """``a @ b`` of two 2-d or two 3-d values of one dtype and equal batch size."""
    if a.type.dtype.is_floating_point:
        return prims.mm(a, b) if a.type.rank == 2 else prims.bmm(a, b)
    # Integer products: broadcast (.., n, k, 1) * (.., 1, k, m) and sum k, exactly like eager.
    rank = a.type.rank
    shape = (*a.type.shape, b.type.shape[-1])
    left = common.broadcast_to(prims.unsqueeze(a, dims=(rank,)), shape)
    right = common.broadcast_to(prims.unsqueeze(b, dims=(rank - 2,)), shape)
    return prims.sum(prims.mul(left, right), dims=(rank - 1,))


def gemm(bias: Value, a: Value, b: Value, beta: Scalar = 1, alpha: Scalar = 1) -> Value:
    """``beta * bias + alpha * (a @ b)``, ``bias`` broadcastable to the product (addmm)."""
    if a.type.dtype.is_floating_point:
        gemm_prim = prims.addmm if a.type.rank == 2 else prims.baddbmm
        return gemm_prim(bias, a, b, beta=beta, alpha=alpha)
    dtype = a.type.dtype
    scaled = product(a, b)
    if alpha != 1:
        scaled = prims.mul(scaled, common.convert(alpha, dtype))
    if beta == 0:  # eager ignores the bias then, even its NaNs
        return scaled
    term = common.broadcast_to(bias, scaled.type.shape)
    if beta != 1:
        term = prims.mul(term, common.convert(beta, dtype))
    return prims.add(term, scaled)


def _check_inner(op: str, a: Shape, b: Shape) -> None:
    if a[-1] != b[-2]:
        raise RuntimeError(
            f"{op}: mat1 and mat2 shapes cannot be multiplied ("
            f"{math.prod(a[:-1])}x{a[-1]} and {b[-2]}x{b[-1]})"
        )


def _check_rank(op: str, value: Value, rank: int, name: str) -> None:
    if value.type.rank != rank:
        raise RuntimeError(f"{op}: {name} must be a {rank}-D tensor, got {value.type.rank}-D")


# ---------------------------------------------------------------------------------------------
# matmul


def batched_matmul(a: Value, b: Value) -> Value:
    """``a @ b`` for ``a`` (..., n, k) and ``b`` (..., k, m) of at least 2 dims each."""
    _check_inner("matmul", shape_of(a), shape_of(b))
    (*a_batch, n, k), (*b_batch, _, m) = shape_of(a), shape_of(b)
    if b.type.rank == 2:  # fold the batch of a into its rows: one mm
        rows = reshape(a, (math.prod(a_batch) * n, k))
        return reshape(product(rows, b), (*a_batch, n, m))
    batch = common.broadcast_shapes(tuple(a_batch), tuple(b_batch))
    count = math.prod(batch)
    left = reshape(common.broadcast_to(a, (*batch, n, k)), (count, n, k))
    right = reshape(common.broadcast_to(b, (*batch, k, m)), (count, k, m))
    return reshape(product(left, right), (*batch, n, m))


@translation(
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    samples=case_calls(
        ((T((3, 4)), T((4, 5))), {}, "2-d"),
        ((T((4,)), T((4,))), {}, "1-d dot"),
        ((T((3, 4)), T((4,))), {}, "matrix-vector"),
        ((T((4,)), T((4, 5))), {}, "vector-matrix"),
        ((T((2, 3, 4)), T((4, 5))), {}, "batched times matrix folds"),
        ((T((2, 3, 4)), T((4,))), {}, "batched times vector"),
        ((T((4,)), T((2, 4, 5))), {}, "vector times batched"),
        ((T((3, 4)), T((2, 4, 5))), {}, "matrix times batched"),
        ((T((2, 1, 3, 4)), T((5, 4, 2))), {}, "broadcast batch dims"),
        ((T((0, 3, 4)), T((4, 2))), {}, "0-size batch"),
        ((T((3, 0)), T((0, 2))), {}, "0-size inner"),
    ),
    dtypes=NUMERIC,
)
def matmul(input: Value, other: Value) -> Value:
    input, other = common.autocast("matmul", input, other)
    check_same_dtype("matmul", input, other)
    if input.type.rank == 0 or other.type.rank == 0:
        raise RuntimeError(
            "both arguments to matmul need to be at least 1D, but they are "
            f"{input.type.rank}D and {other.type.rank}D"
        )
    a = prims.unsqueeze(input, dims=(0,)) if input.type.rank == 1 else input
    b = prims.unsqueeze(other, dims=(1,)) if other.type.rank == 1 else other
    result = batched_matmul(a, b)
    rank = result.type.rank  # the dims the 1-d operands gained go again
    drop = [rank - 2] if input.type.rank == 1 else []
    drop += [rank - 1] if other.type.rank == 1 else []
    if drop:
        result = prims.squeeze(result, dims=tuple(drop))
    return result


@translation(
    torch.Tensor.__rmatmul__,
    samples=case_calls(((T((4, 5)), T((3, 4))), {}, "other @ self")),
    dtypes=NUMERIC,
)
def rmatmul(input: Value, other: Value) -> Value:
    return matmul(other, input)


# ---------------------------------------------------------------------------------------------
# mm, bmm, mv, dot, outer


@translation(
    torch.mm,
    torch.Tensor.mm,
    samples=case_calls(
        ((T((3, 4)), T((4, 5))), {}, ""),
        ((T((1, 4)), T((4, 1))), {}, "size-1 dims"),
        ((T((3, 0)), T((0, 2))), {}, "0-size inner"),
    ),
    dtypes=NUMERIC,
)
def mm(input: Value, mat2: Value) -> Value:
    input, mat2 = common.autocast("mm", input, mat2)
    check_same_dtype("mm", input, mat2)
    _check_rank("mm", input, 2, "self")
    _check_rank("mm", mat2, 2, "mat2")
    _check_inner("mm", shape_of(input), shape_of(mat2))
    return product(input, mat2)


def _check_batches(op: str, a: Value, b: Value) -> None:
    (batch, _, k), (batch2, k2, _) = a.type.shape, b.type.shape
    if (batch2, k2) != (batch, k):
        raise RuntimeError(
            f"{op}: Expected size for first two dimensions of batch2 tensor to be: "
            f"[{batch}, {k}] but got: [{batch2}, {k2}]."
        )


@translation(
    torch.bmm,
    torch.Tensor.bmm,
    samples=case_calls(
        ((T((2, 3, 4)), T((2, 4, 5))), {}, ""),
        ((T((1, 1, 4)), T((1, 4, 1))), {}, "size-1 dims"),
        ((T((0, 3, 4)), T((0, 4, 5))), {}, "0-size batch"),
    ),
    dtypes=NUMERIC,
)
def bmm(input: Value, mat2: Value) -> Value:
    input, mat2 = common.autocast("bmm", input, mat2)
    check_same_dtype("bmm", input, mat2)
    _check_rank("bmm", input, 3, "batch1")
    _check_rank("bmm", mat2, 3, "batch2")
    _check_batches("bmm", input, mat2)
    return product(input, mat2)


@translation(
    torch.mv,
    torch.Tensor.mv,
    samples=case_calls(((T((3, 4)), T((4,))), {}, ""), ((T((0, 4)), T((4,))), {}, "0 rows")),
    dtypes=NUMERIC,
)
def mv(input: Value, vec: Value) -> Value:
    check_same_dtype("mv", input, vec)
    _check_rank("mv", input, 2, "self")
    _check_rank("mv", vec, 1, "vec")
    if input.type.shape[1] != vec.type.shape[0]:
        raise RuntimeError(
            f"mv: size mismatch, got input ({input.type.shape[0]}), mat "
            f"({input.type.shape[0]}x{input.type.shape[1]}), vec ({vec.type.shape[0]})"
        )
    return matmul(input, vec)


@translation(
    torch.dot,
    torch.Tensor.dot,
    torch.vdot,
    torch.Tensor.vdot,
    samples=case_calls(((T((5,)), T((5,))), {}, ""), ((T((0,)), T((0,))), {}, "empty")),
    dtypes=NUMERIC,
)
def dot(input: Value, tensor: Value) -> Value:
    if input.type.dtype != tensor.type.dtype:
        raise RuntimeError(
            "dot : expected both vectors to have same dtype, but found "
            f"{_dtype_name(input.type.dtype)} and {_dtype_name(tensor.type.dtype)}"
        )
    if input.type.rank != 1 or tensor.type.rank != 1:
        raise RuntimeError(
            f"1D tensors expected, but got {input.type.rank}D and {tensor.type.rank}D tensors"
        )
    if input.type.shape != tensor.type.shape:
        a, b = input.type.shape[0], tensor.type.shape[0]
        raise RuntimeError(
            f"inconsistent tensor size, expected tensor [{a}] and src [{b}] to have the same "
            f"number of elements, but got {a} and {b} elements respectively"
        )
    return matmul(input, tensor)


@translation(
    torch.outer,
    torch.Tensor.outer,
    torch.ger,
    torch.Tensor.ger,
    samples=case_calls(((T((3,)), T((4,))), {}, ""), ((T((0,)), T((2,))), {}, "empty")),
    dtypes=NUMERIC,
)
def outer(input: Value, vec2: Value) -> Value:
    for value, name in ((input, "self"), (vec2, "vec2")):
        if value.type.rank != 1:
            raise RuntimeError(f"outer: Expected 1-D argument {name}, but got {value.type.rank}-D")
    column = prims.unsqueeze(input, dims=(1,))
    (left, right), _ = common.elementwise(column, vec2)
    return prims.mul(left, right)


# ---------------------------------------------------------------------------------------------
# addmm, baddbmm


@translation(
    torch.addmm,
    torch.Tensor.addmm,
    samples=case_calls(
        ((T((3, 5)), T((3, 4)), T((4, 5))), {}, ""),
        ((T((5,)), T((3, 4)), T((4, 5))), {"beta": 2, "alpha": 3}, "broadcast bias, scaled"),
        ((T((1, 5)), T((3, 4)), T((4, 5))), {"beta": 0}, "beta 0"),
        ((T((3, 1)), T((3, 0)), T((0, 1))), {}, "0-size inner"),
    ),
    dtypes=NUMERIC,
)
def addmm(input: Value, mat1: Value, mat2: Value, *, beta: Scalar = 1, alpha: Scalar = 1) -> Value:
    input, mat1, mat2 = common.autocast("addmm", input, mat1, mat2)
    check_same_dtype("addmm", input, mat1, mat2)
    _check_rank("addmm", mat1, 2, "mat1")
    _check_rank("addmm", mat2, 2, "mat2")
    _check_inner("addmm", shape_of(mat1), shape_of(mat2))
    return gemm(input, mat1, mat2, beta, alpha)


@translation(
    torch.Tensor.addmm_,
    samples=case_calls(((T((3, 5)), T((3, 4)), T((4, 5))), {"alpha": 2}, "")),
    dtypes=NUMERIC,
    inplace=True,
)
def addmm_(input: Value, mat1: Value, mat2: Value, *, beta: Scalar = 1, alpha: Scalar = 1) -> Value:
    return addmm(input, mat1, mat2, beta=beta, alpha=alpha)


@translation(
    torch.baddbmm,
    torch.Tensor.baddbmm,
    samples=case_calls(
        ((T((2, 3, 5)), T((2, 3, 4)), T((2, 4, 5))), {}, ""),
        ((T((3, 5)), T((2, 3, 4)), T((2, 4, 5))), {"beta": 2, "alpha": 3}, "broadcast, scaled"),
        ((T((0, 3, 5)), T((0, 3, 4)), T((0, 4, 5))), {}, "0-size batch"),
    ),
    dtypes=NUMERIC,
)
def baddbmm(
    input: Value, batch1: Value, batch2: Value, *, beta: Scalar = 1, alpha: Scalar = 1
) -> Value:
    input, batch1, batch2 = common.autocast("baddbmm", input, batch1, batch2)
    check_same_dtype("baddbmm", input, batch1, batch2)
    _check_rank("baddbmm", batch1, 3, "batch1")
    _check_rank("baddbmm", batch2, 3, "batch2")
    _check_batches("baddbmm", batch1, batch2)
    if not input.type.dtype.is_floating_point and not input.type.dtype.is_complex:
        # (eager's integer kernels cast the scalars to the tensor's type: 0.6 -> 0)
        beta, alpha = _integral(beta), _integral(alpha)
    return gemm(input, batch1, batch2, beta, alpha)


def _integral(scalar: Scalar) -> Scalar:
    return int(scalar) if isinstance(scalar, float) else scalar


@translation(
    torch.Tensor.baddbmm_,
    samples=case_calls(((T((2, 3, 5)), T((2, 3, 4)), T((2, 4, 5))), {"beta": 2}, "")),
    dtypes=NUMERIC,
    inplace=True,
)
def baddbmm_(
    input: Value, batch1: Value, batch2: Value, *, beta: Scalar = 1, alpha: Scalar = 1
) -> Value:
    return baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)


# ---------------------------------------------------------------------------------------------
# linear


@translation(
    torch.nn.functional.linear,
    samples=case_calls(
        ((T((3, 4)), T((5, 4)), T((5,))), {}, ""),
        ((T((2, 3, 4)), T((5, 4))), {}, "3-d input, no bias"),
        ((T((2, 1, 3, 4)), T((5, 4))), {"bias": T((5,))}, "4-d input, bias keyword"),
        ((T((4,)), T((5, 4)), T((5,))), {}, "1-d input"),
        ((T((0, 4)), T((5, 4)), T((5,))), {}, "0 rows"),
        ((T((3, 4)), T((4,))), {}, "1-d weight"),
    ),
    dtypes=NUMERIC,
)
def linear(input: Value, weight: Value, bias: Value | None = None) -> Value:
    input, weight, bias = common.autocast("linear", input, weight, bias)
    check_same_dtype("linear", input, weight, bias)
    if input.type.rank == 0 or weight.type.rank == 0:
        raise RuntimeError(
            "both arguments to linear need to be at least 1D, but they are "
            f"{input.type.rank}D and {weight.type.rank}D"
        )
    if weight.type.rank == 1 and bias is None:  # a vector weight: a plain matmul
        return matmul(input, weight)
    _check_rank("linear", weight, 2, "weight")
    *lead, inner = shape_of(input)
    features = weight.type.shape[0]
    _check_inner("linear", shape_of(input), shape_of(weight)[::-1])
    rows = reshape(input, (math.prod(lead), inner))
    weight_t = prims.permute(weight, dims=(1, 0))
    out = product(rows, weight_t) if bias is None else gemm(bias, rows, weight_t)
    return reshape(out, (*lead, features))


# ---------------------------------------------------------------------------------------------
# tensordot


def _contracted_dims(
    dims: int | Sequence[Sequence[int] | int], a: Value, b: Value
) -> tuple[list[int], list[int]]:
    """The dims of ``a`` and ``b`` that tensordot sums over, non-negative and paired."""
    if isinstance(dims, int):
        if dims < 0:
            raise RuntimeError(f"tensordot expects dims >= 0, but got dims={dims}")
        return list(range(a.type.rank - dims, a.type.rank)), list(range(dims))
    first, second = ([d] if isinstance(d, int) else list(d) for d in dims)
    if len(first) != len(second):
        raise RuntimeError("both dimension lists should have same length")
    return (
        [common.normalize_dim(d, a.type.rank, "tensordot") for d in first],
        [common.normalize_dim(d, b.type.rank, "tensordot") for d in second],
    )


@translation(
    torch.tensordot,
    samples=case_calls(
        ((T((3, 4, 5)), T((4, 5, 6))), {}, "dims=2"),
        ((T((3, 4, 5)), T((4, 5, 6))), {"dims": ([1], [0])}, "lists"),
        ((T((3, 4, 5)), T((6, 4, 3))), {"dims": ([-2, 0], [1, 2])}, "negative, reordered"),
        ((T((2, 3)), T((4,))), {"dims": 0}, "outer product"),
    ),
    dtypes=NUMERIC,
)
def tensordot(
    a: Value, b: Value, dims: int | Sequence[Sequence[int] | int] = 2, out: None = None
) -> Value:
    if a.type.dtype != b.type.dtype:
        raise RuntimeError("both inputs should have same dtype")
    if out is not None or not isinstance(dims, int | Sequence):
        raise FallbackToExtern  # out= or dims given as a tensor
    summed_a, summed_b = _contracted_dims(dims, a, b)
    for da, db in zip(summed_a, summed_b, strict=True):
        size_a, size_b = a.type.shape[da], b.type.shape[db]
        if size_a == 1 and size_b != 1:  # (eager broadcasts a contracted dim of size 1)
            a = common.broadcast_to(
                a, tuple(size_b if d == da else s for d, s in enumerate(shape_of(a)))
            )
        elif size_b == 1 and size_a != 1:
            b = common.broadcast_to(
                b, tuple(size_a if d == db else s for d, s in enumerate(shape_of(b)))
            )
        elif size_a != size_b:
            raise RuntimeError(
                f"contracted dimensions need to match, but first has size {a.type.shape[da]} in "
                f"dim {da} and second has size {b.type.shape[db]} in dim {db}"
            )
    free_a = [d for d in range(a.type.rank) if d not in summed_a]
    free_b = [d for d in range(b.type.rank) if d not in summed_b]
    shape_a, shape_b = shape_of(a), shape_of(b)
    sizes_a = [shape_a[d] for d in free_a]
    sizes_b = [shape_b[d] for d in free_b]
    inner = math.prod(shape_a[d] for d in summed_a)
    left = reshape(prims.permute(a, dims=(*free_a, *summed_a)), (math.prod(sizes_a), inner))
    right = reshape(prims.permute(b, dims=(*summed_b, *free_b)), (inner, math.prod(sizes_b)))
    return reshape(product(left, right), (*sizes_a, *sizes_b))
