"""Factors constant along a sum move out of it: ``sum(c * e)`` becomes ``c * sum(e)``.

A BatchNorm's backward sums ``c * (x - mean)`` over each channel, where ``c`` is a per-channel
value computed from the other gradient sums (the variance's gradient flowing into the mean).
As written, that sum waits for those sums, so it took a kernel of its own: one more full read
of ``x`` and a full-size store of ``c * (x - mean)`` per BatchNorm layer. With ``c`` outside,
``sum(x - mean)`` depends on nothing computed in the backward and joins the kernel of the
other sums over the same rows (it reads the same ``x``)::

    before:  t3 = broadcast(t2, shape=(8, 64, 16, 16), dims=(1,)); t4 = mul(t3, t1)
             t5 = add(t4, t4); t6 = neg(t5); t7 = sum(t6, dims=(0, 2, 3))
    after:   t8 = sum(t1, dims=(0, 2, 3)); t9 = mul(t2, t8); t7 = mul(t9, -2)

The pass looks through ``neg``, ``add(u, u)`` (or of two equal nodes), multiplication by a
scalar and by a value broadcast along every summed dim (a ``broadcast``, or a chain of them,
whose summed output dims are new or of size 1), down to the first operand that is none of
these. Float sums only: the rounding of ``c * sum(e)`` differs from ``sum(c * e)`` by an ulp
or so, as any reordered float sum. It runs before ``reduction_split``, which then splits the
factored sum (on the GPU a BatchNorm's sum becomes a permuted, reshaped column sum, where the
factor would no longer be visible).
"""

from __future__ import annotations

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.passes.rewriting import rewrite_nodes, take_over

Factor = tuple[Value, tuple[int, ...]]  # a value and the output dims its dims map to


def _constant_along(value: Value, dims: tuple[int, ...]) -> Factor | None:
    """``value`` as (source, mapping) when it is a broadcast constant along ``dims``: the
    summed dims are new or of size 1 in the source. A broadcast of a broadcast (``[C]`` to
    ``[N, C]`` to ``[N, C, H, W]``) is followed down, composing the dim mappings."""
    node = value.node
    mapping: tuple[int, ...] | None = None
    while node is not None and node.op is Op.BROADCAST:
        source = node.inputs[0]
        if not isinstance(source, Value):
            return None
        mapping = (
            tuple(node.attrs.dims)
            if mapping is None
            else tuple(mapping[d] for d in node.attrs.dims)
        )
        sizes = tuple(source.type.shape)
        if all(sizes[i] == 1 for i, out_dim in enumerate(mapping) if out_dim in dims):
            return source, mapping
        node = source.node
    return None


def _same(a: object, b: object) -> bool:
    """Whether two operands are one value, or two nodes computing the same (before CSE)."""
    if a is b:
        return True
    if not (isinstance(a, Value) and isinstance(b, Value) and a.node and b.node):
        return False
    x, y = a.node, b.node
    return (
        x.op is y.op
        and x.op is not Op.EXTERN
        and x.attrs == y.attrs
        and len(x.inputs) == len(y.inputs)
        and all(p is q for p, q in zip(x.inputs, y.inputs, strict=True))
    )


def _split(node: Node) -> tuple[float, list[Factor], Value] | None:
    """(scale, factors, core) with ``node``'s operand = scale * product(factors) * core."""
    dims = tuple(node.attrs.dims)
    scale, factors = 1.0, []
    current = node.inputs[0]
    while isinstance(current, Value) and current.node is not None:
        inner = current.node
        if inner.op is Op.NEG:
            scale, current = -scale, inner.inputs[0]
        elif inner.op is Op.ADD and _same(inner.inputs[0], inner.inputs[1]):
            scale, current = 2 * scale, inner.inputs[0]
        elif inner.op is Op.MUL:
            a, b = inner.inputs
            if isinstance(b, int | float) and not isinstance(b, bool):
                scale, current = scale * b, a
                continue
            if isinstance(a, int | float) and not isinstance(a, bool):
                scale, current = scale * a, b
                continue
            found = None
            for factor, other in ((a, b), (b, a)):
                if isinstance(factor, Value):
                    constant = _constant_along(factor, dims)
                    if constant is not None and isinstance(other, Value):
                        found = constant, other
                        break
            if found is None:
                break
            factors.append(found[0])
            current = found[1]
        else:
            break
    if not factors or not isinstance(current, Value) or current is node.inputs[0]:
        return None
    return scale, factors, current


def _chosen(graph: Graph) -> dict[Node, tuple[float, list[Factor], Value]]:
    chosen = {}
    for node in graph.nodes:
        if node.op is not Op.SUM or not isinstance(node.inputs[0], Value):
            continue
        dtype = node.output.type.dtype
        if not dtype.is_floating_point or node.inputs[0].type.dtype != dtype:
            continue
        split = _split(node)
        if split is not None and all(f.type.dtype == dtype for f, _ in split[1]):
            chosen[node] = split
    return chosen


def factor_sums(graph: Graph) -> Graph:
    """``graph`` with constant factors taken out of its sums (module docstring)."""
    chosen = _chosen(graph)

    def emit(node: Node, builder: GraphBuilder) -> None:
        scale, factors, core = chosen[node]
        dims = tuple(node.attrs.dims)
        full = tuple(node.inputs[0].type.shape)  # type: ignore[union-attr]
        kept = [d for d in range(len(full)) if d not in dims]
        shape = tuple(full[d] for d in kept)
        with builder.origin_scope(node.origin):
            result = prims.sum(core, dims=dims)
            for source, mapping in factors:
                # the source's dims that land on summed dims have size 1: drop them
                keep = [i for i, d in enumerate(mapping) if d not in dims]
                drop = tuple(i for i in range(len(mapping)) if i not in keep)
                if drop:
                    source = prims.squeeze(source, dims=drop)
                spread = tuple(kept.index(mapping[i]) for i in keep)
                factor = prims.broadcast(source, shape=shape, dims=spread)
                result = prims.mul(factor, result)
            if scale != 1.0:
                result = prims.mul(result, scale)
        take_over(node.output, result)

    return rewrite_nodes(graph, set(chosen), emit)
