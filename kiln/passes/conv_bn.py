"""Conv/BatchNorm folding: an inference BatchNorm after a convolution moves into its weights.

Eval-mode ``batch_norm`` translates to a per-channel affine map of its input, ``x * scale +
shift`` with ``scale = weight * rsqrt(running_var + eps)`` and ``shift = bias - running_mean *
scale`` (both of shape ``(C,)``, broadcast along dim 1). After a convolution that map folds
into the convolution's weight and bias, ``w' = w * scale`` per output channel and ``b' = b *
scale + shift``; the folded parameters are computed by prims in the graph, so they follow the
parameters (graph inputs) from call to call::

    before:  t0 = convolution(x, w, b, stride=(1, 1), ...)
             t1 = add(running_var, 1e-05); t2 = rsqrt(t1); t3 = mul(t2, weight)    # scale
             t4 = mul(running_mean, t3); t5 = neg(t4); t6 = add(t5, bias)          # shift
             t7 = broadcast(t3, shape=(2, 8, 6, 6), dims=(1,)); t8 = mul(t0, t7)
             t9 = broadcast(t6, shape=(2, 8, 6, 6), dims=(1,)); t10 = add(t8, t9)
    after:   t1 = add(running_var, 1e-05); t2 = rsqrt(t1); t3 = mul(t2, weight)
             t4 = mul(running_mean, t3); t5 = neg(t4); t6 = add(t5, bias)
             t11 = broadcast(t3, shape=(8, 3, 3, 3), dims=(0,)); t12 = mul(w, t11)
             t13 = mul(b, t3); t14 = add(t13, t6)
             t10 = convolution(x, t12, t14, stride=(1, 1), ...)

It folds only in graphs that record no gradients (no node's value requires grad), only a
non-transposed convolution whose output nothing but the ``mul`` reads (and whose ``mul``
nothing but the ``add``), in float32 or float64 with every operand of the convolution's dtype,
and only when ``scale`` and ``shift`` do not depend on the convolution's output: training-mode
BatchNorm (batch statistics) is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.passes.rewriting import rewrite_nodes

_DTYPES = (torch.float32, torch.float64)


@dataclass
class _Fold:
    """One convolution followed by a per-channel ``x * scale + shift``."""

    conv: Node
    scale: Value
    shift: Value
    mul: Node
    add: Node  # its output becomes the folded convolution's output
    views: list[Node]  # the broadcasts of scale and shift: removed when nothing else reads them


def _only_user(value: Value, users: dict[Value, list[Node]], external: set[Value]) -> Node | None:
    readers = users.get(value, [])
    return readers[0] if len(readers) == 1 and value not in external else None


def _per_channel(operand: object, like: Value) -> tuple[Value, Node] | None:
    """(v, the broadcast) when ``operand`` is a ``(C,)`` value ``v`` broadcast along dim 1 of
    ``like`` (C = its channels), in ``like``'s dtype."""
    if not isinstance(operand, Value) or operand.node is None:
        return None
    node = operand.node
    if node.op is not Op.BROADCAST or node.attrs.dims != (1,):
        return None
    source = node.inputs[0]
    if not isinstance(source, Value) or source.type.dtype != like.type.dtype:
        return None
    if tuple(source.type.shape) != (like.type.shape[1],):
        return None
    return source, node


def _other(node: Node, value: Value) -> object:
    """The operand of a binary ``node`` that is not ``value`` (None if neither or both are)."""
    left, right = node.inputs
    if (left is value) == (right is value):
        return None
    return right if left is value else left


def _depends_on(values: list[Value], target: Value) -> bool:
    """Whether any of ``values`` is computed from ``target``."""
    seen: set[int] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if value is target:
            return True
        if id(value) in seen or value.node is None:
            continue
        seen.add(id(value))
        stack.extend(value.node.input_values())
    return False


def _match(conv: Node, users: dict[Value, list[Node]], external: set[Value]) -> _Fold | None:
    """The BatchNorm arithmetic that reads ``conv``'s output, if it folds."""
    out = conv.output
    x, weight, bias = conv.inputs
    operands = [v for v in (x, weight, bias) if isinstance(v, Value)]
    if conv.attrs.transposed or out.type.dtype not in _DTYPES or out.type.rank < 3:
        return None
    if any(v.type.dtype != out.type.dtype for v in operands):
        return None
    mul = _only_user(out, users, external)
    if mul is None or mul.op is not Op.MUL:
        return None
    scaling = _per_channel(_other(mul, out), out)
    add = _only_user(mul.output, users, external)
    if scaling is None or add is None or add.op is not Op.ADD:
        return None
    shifting = _per_channel(_other(add, mul.output), out)
    if shifting is None or _depends_on([scaling[0], shifting[0]], out):
        return None
    return _Fold(conv, scaling[0], shifting[0], mul, add, [scaling[1], shifting[1]])


def _emit(fold: _Fold, builder: GraphBuilder) -> None:
    """Append the folded weight, bias and convolution, which takes over ``fold.add``'s output."""
    x, weight, bias = fold.conv.inputs
    assert isinstance(weight, Value)
    geometry = {f.name: getattr(fold.conv.attrs, f.name) for f in fields(fold.conv.attrs)}
    with torch.no_grad(), builder.origin_scope(fold.conv.origin):
        factor = prims.broadcast(fold.scale, shape=weight.type.shape, dims=(0,))
        folded_weight = prims.mul(weight, factor)
        folded_bias = fold.shift
        if bias is not None:
            folded_bias = prims.add(prims.mul(bias, fold.scale), fold.shift)
        result = prims.convolution(x, folded_weight, folded_bias, **geometry)
    output = fold.add.output
    node = result.node
    node.outputs = (output,)
    output.node = node


def fold_conv_batchnorm(graph: Graph) -> Graph:
    """``graph`` with inference BatchNorms folded into the convolutions before them."""
    if any(out.type.requires_grad for node in graph.nodes for out in node.outputs):
        return graph
    users = graph.users()
    external = set(graph.outputs) | {new for _, new in graph.mutations}
    folds: dict[Node, _Fold] = {}
    for node in graph.nodes:
        if node.op is Op.CONVOLUTION:
            fold = _match(node, users, external)
            if fold is not None:
                folds[fold.add] = fold
    if not folds:
        return graph
    removed = {node for fold in folds.values() for node in (fold.conv, fold.mul, fold.add)}
    for fold in folds.values():
        for view in fold.views:
            readers = users[view.output]
            if view.output not in external and all(reader in removed for reader in readers):
                removed.add(view)

    def emit(node: Node, builder: GraphBuilder) -> None:
        if node in folds:  # other removed nodes emit nothing
            _emit(folds[node], builder)

    return rewrite_nodes(graph, removed | set(folds), emit)
