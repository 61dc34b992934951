"""The translation of torch.einsum: diagonals, sums and pairwise contractions in prims.

Each operand first loses its repeated labels (diagonals: the two dims move last, flatten, and a
slice with step ``n + 1`` keeps the diagonal) and the labels no other operand or the output
needs (a ``sum``). Operands are then contracted left to right, as eager does without
opt_einsum: each pair becomes one batched product ``(batch, m, k) @ (batch, k, n)`` through
permutes and reshapes; a final permute puts the labels in the output's order::

    torch.einsum("bij,bjk->bik", a, b)   # one bmm, no permutes
    torch.einsum("ii->i", x)             # reshape, then slice(step=n + 1)

Size-1 dims broadcast against the same label's size elsewhere, like eager. The sublist form
(``einsum(a, [0, 1], b, [1, 2])``) arrives here as an equation: torch converts it first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.ir.graph import Value
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.sampling import NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.linalg import check_same_dtype, product, reshape
from kiln.ops.translations.shape import reorder, shape_of
from kiln.ops.translations.table import Call, FallbackToExtern, translation

# A label is a letter's code point; ellipsis dims are -1 (last), -2, ... (right-aligned).
Label = int


@dataclass
class Term:
    """An operand with one label per dim."""

    value: Value
    labels: list[Label]

    def size(self, label: Label) -> Dim:
        return self.value.type.shape[self.labels.index(label)]


def _parse_term(text: str, rank: int | None, where: str) -> list[Label]:
    """Labels of one subscript term; ``rank`` (None for the output) sizes the ellipsis."""
    head, dots, tail = text.partition("...")
    if "." in head or "." in tail:
        raise RuntimeError(f"einsum(): invalid subscript given in {where}: {text!r}")
    for char in head + tail:
        if not char.isalpha():
            raise RuntimeError(f"einsum(): invalid subscript given in {where}: {char!r}")
    letters = len(head) + len(tail)
    if rank is not None and (rank < letters or (not dots and rank != letters)):
        raise RuntimeError(
            f"einsum(): the number of subscripts in the equation ({letters}) does not match the "
            f"number of dimensions ({rank}) for {where}"
        )
    ellipsis = (rank - letters) if rank is not None else 0
    return [*map(ord, head), *range(-ellipsis, 0), *map(ord, tail)] if dots else [*map(ord, text)]


def parse(equation: str, ranks: Sequence[int]) -> tuple[list[list[Label]], list[Label]]:
    """Input label lists and output labels of ``equation`` for operands of ``ranks``."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        more = "more" if len(ranks) > len(terms) else "fewer"
        raise RuntimeError(
            f"einsum(): {more} operands were provided than specified in the equation"
        )
    inputs = [
        _parse_term(t, r, f"operand {i}") for i, (t, r) in enumerate(zip(terms, ranks, strict=True))
    ]
    ellipsis = max((-min(labels, default=0) for labels in inputs), default=0)
    if arrow:
        head, dots, tail = rhs.partition("...")
        output = _parse_term(head + tail, None, "the output")
        if dots:
            output = [*output[: len(head)], *range(-ellipsis, 0), *output[len(head) :]]
        _check_output(output, inputs)
        return inputs, output
    counts: dict[Label, int] = {}
    for labels in inputs:
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
    letters = sorted(label for label, count in counts.items() if count == 1 and label >= 0)
    return inputs, [*range(-ellipsis, 0), *letters]


def _check_output(output: list[Label], inputs: list[list[Label]]) -> None:
    for label in output:
        if output.count(label) > 1:
            raise RuntimeError(f"einsum(): output subscript {chr(label)} appears more than once")
        if label >= 0 and not any(label in labels for labels in inputs):
            raise RuntimeError(
                f"einsum(): output subscript {chr(label)} does not appear in the equation for "
                "any input operand"
            )


# ---------------------------------------------------------------------------------------------
# single-operand steps


def _diagonal(term: Term, label: Label) -> Term:
    """``term`` with the first repeated ``label`` pair merged into its diagonal (last dim)."""
    first = term.labels.index(label)
    second = term.labels.index(label, first + 1)
    size, other = term.size(label), term.value.type.shape[second]
    if size != other:
        raise RuntimeError(
            f"einsum(): subscript {chr(label)} is repeated for operand but the sizes don't "
            f"match, {size} != {other}"
        )
    keep = [d for d in range(len(term.labels)) if d not in (first, second)]
    moved = reorder(term.value, (*keep, first, second))
    lead = shape_of(moved)[: len(keep)]
    flat = reshape(moved, (*lead, size * size))
    diagonal = prims.slice(flat, dim=len(keep), start=0, stop=size * size, step=size + 1)
    return Term(diagonal, [term.labels[d] for d in keep] + [label])


def _sum_labels(term: Term, labels: Sequence[Label]) -> Term:
    """``term`` summed over ``labels``; integers sum as int64, as eager's ``sum`` does."""
    dims = tuple(d for d, label in enumerate(term.labels) if label in labels)
    if not dims:
        return term
    value = term.value
    if not value.type.dtype.is_floating_point:
        value = common.convert(value, torch.int64)
    summed = prims.sum(value, dims=dims)
    return Term(summed, [label for label in term.labels if label not in labels])


def _permute(term: Term, order: Sequence[Label]) -> Value:
    """``term`` with its dims in label ``order`` (labels unique)."""
    return reorder(term.value, [term.labels.index(label) for label in order])


def _prepare(term: Term, needed: set[Label]) -> Term:
    """Take the diagonals of repeated labels, then sum out the labels nothing else needs."""
    while len(set(term.labels)) != len(term.labels):
        repeated = next(label for label in term.labels if term.labels.count(label) > 1)
        term = _diagonal(term, repeated)
    return _sum_labels(term, [label for label in term.labels if label not in needed])


# ---------------------------------------------------------------------------------------------
# pairwise contraction


def _grouped(term: Term, groups: Sequence[Sequence[Label]], sizes: dict[Label, Dim]) -> Value:
    """``term`` permuted to the labels of ``groups`` in order, broadcast to ``sizes`` and
    reshaped to one dim per group."""
    order = [label for group in groups for label in group]
    value = _permute(term, order)
    value = common.broadcast_to(value, tuple(sizes[label] for label in order))
    return reshape(value, tuple(math.prod(sizes[label] for label in group) for group in groups))


def _squeeze(term: Term, label: Label) -> Term:
    dim = term.labels.index(label)
    squeezed = prims.squeeze(term.value, dims=(dim,))
    return Term(squeezed, [other for other in term.labels if other != label])


def _sum_broadcast(a: Term, b: Term, summed: Sequence[Label]) -> tuple[Term, Term]:
    """Sum a summed label of size 1 on one side out of the other side first, as eager does."""
    for label in summed:
        if a.size(label) == b.size(label):
            continue
        if not a.value.type.dtype.is_floating_point:
            raise FallbackToExtern  # eager mixes int32 and int64 operands here
        if a.size(label) == 1:
            a, b = _squeeze(a, label), _sum_labels(b, [label])
        else:
            a, b = _sum_labels(a, [label]), _squeeze(b, label)
    return a, b


def _contract(a: Term, b: Term, keep: set[Label]) -> Term:
    """``a`` times ``b`` summed over their shared labels not in ``keep``."""
    if a.value.type.dtype != b.value.type.dtype:  # an integer operand summed to int64 first
        raise RuntimeError(
            f"einsum(): expected scalar type {a.value.type.dtype} but found {b.value.type.dtype}"
        )
    a, b = _sum_broadcast(
        a, b, [label for label in a.labels if label in b.labels and label not in keep]
    )
    sizes = {label: max(a.size(label), b.size(label)) for label in a.labels if label in b.labels}
    sizes |= {label: a.size(label) for label in a.labels if label not in b.labels}
    sizes |= {label: b.size(label) for label in b.labels if label not in a.labels}
    shared = [label for label in a.labels if label in b.labels]
    batch = [label for label in shared if label in keep]
    summed = [label for label in shared if label not in keep]
    a_only = [label for label in a.labels if label not in b.labels]
    b_only = [label for label in b.labels if label not in a.labels]
    lead = [batch] if batch else []  # no batch labels: a 2-d product (mm)
    left = _grouped(a, (*lead, a_only, summed), sizes)
    right = _grouped(b, (*lead, summed, b_only), sizes)
    result = product(left, right)
    labels = batch + a_only + b_only
    return Term(reshape(result, tuple(sizes[label] for label in labels)), labels)


def _needed_after(index: int, labels: list[list[Label]], output: list[Label]) -> set[Label]:
    return set(output).union(*labels[index + 1 :])


EINSUM_CASES = case_calls(
    (("ij,jk->ik", T((2, 3)), T((3, 4))), {}, "matmul"),
    (("bij,bjk->bik", T((2, 3, 4)), T((2, 4, 5))), {}, "bmm"),
    (("bhqd,bhkd->bhqk", T((2, 2, 3, 4)), T((2, 2, 5, 4))), {}, "attention scores"),
    (("ij,kj", T((2, 3)), T((4, 3))), {}, "implicit output"),
    (("i,i->", T((4,)), T((4,))), {}, "dot"),
    (("i,j->ij", T((3,)), T((4,))), {}, "outer"),
    (("ij->ji", T((2, 3))), {}, "transpose"),
    (("ii->i", T((3, 3))), {}, "diagonal"),
    (("ii", T((3, 3))), {}, "trace"),
    (("ijk->j", T((2, 3, 4))), {}, "sum"),
    (("...ij,...jk", T((2, 1, 3, 4)), T((5, 4, 2))), {}, "ellipsis broadcast"),
    (("bn,anm,bm->ba", T((2, 3)), T((4, 3, 5)), T((2, 5))), {}, "three operands"),
    (("ij,jk->ik", [T((2, 3)), T((3, 4))]), {}, "operands in a list"),
    (("ij,jk->ik", T((2, 0)), T((0, 4))), {}, "0-size contraction"),
)
# Eager mixes int32 and int64 here (one side is summed first), so only floats translate.
FLOAT_EINSUM_CASES = case_calls(
    (("bi,bi->b", T((2, 1)), T((2, 3))), {}, "size-1 summed dim broadcasts"),
)


def _einsum_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    floats = FLOAT_EINSUM_CASES(dtype, device) if dtype.is_floating_point else []
    return [*EINSUM_CASES(dtype, device), *floats]


@translation(torch.einsum, samples=_einsum_samples, dtypes=NUMERIC)
def einsum(*args: object) -> Value:
    equation, operands = args[0], list(args[1:])
    if not isinstance(equation, str):
        raise FallbackToExtern  # not an equation: left to torch
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = list(operands[0])
    values = common.autocast("einsum", *operands)
    if not values or not all(isinstance(v, Value) for v in values):
        raise RuntimeError("einsum(): must provide at least one operand")
    check_same_dtype("einsum", *values)
    labels, output = parse(equation, [v.type.rank for v in values])
    terms = [Term(v, list(ls)) for v, ls in zip(values, labels, strict=True)]
    others = [set().union(*(labels[:i] + labels[i + 1 :])) for i in range(len(terms))]
    terms = [_prepare(t, set(output) | others[i]) for i, t in enumerate(terms)]
    result = terms[0]
    for index, term in enumerate(terms[1:], start=1):
        result = _contract(result, term, _needed_after(index, labels, output))
    result = _sum_labels(result, [label for label in result.labels if label not in output])
    return _permute(result, output)
