"""Attention fusion: scaled dot-product attention written out in prims becomes one ``sdpa``.

``torch.softmax(q @ k.transpose(-2, -1) * d**-0.5, dim=-1) @ v`` traces to two batched
products around a softmax over the last dim (amax, sub, exp, sum, div)::

    before:  t0 = permute(k, dims=(0, 1, 3, 2)); t1 = reshape(q, shape=(6, 4, 8))
             t2 = reshape(t0, shape=(6, 8, 5)); t3 = bmm(t1, t2)
             t4 = reshape(t3, shape=(2, 3, 4, 5)); t5 = mul(t4, 0.354)
             t6 = amax(t5, dims=(3,)) ... t14 = div(t10, t13)     # softmax(t5, dim=-1)
             t15 = reshape(t14, shape=(6, 4, 5)); t16 = reshape(v, shape=(6, 5, 8))
             t17 = bmm(t15, t16); t18 = reshape(t17, shape=(2, 3, 4, 8))
    after:   t18 = sdpa(q, k, v, None, is_causal=False, scale=0.354, enable_gqa=False)

It matches scores ``q @ k^T`` of 3-d or n-d operands (batch dims flattened by reshapes), scaled
by a Python number (``mul``, ``div``, or a ``mul`` of ``q`` before the product) or not at all,
plus an optional additive float mask, then that softmax, then ``@ v``; in float32 and float64
only, so no dtype conversion sits inside; every value inside is read by the pattern only.
Eager's softmax gives NaN on a row the mask hides entirely (all ``-inf``), ``sdpa`` gives 0:
unless the mask is finite by construction (transformers' ``finfo.min`` masks), the fused
graph restores those rows, ``where(ne(amax(mask, last dim), -inf), sdpa(...), nan)``. (A row
of ``-inf`` scores from infinite q or k still differs the same way.)

It leaves alone dropout on the probabilities, a softmax over another dim, converts between
the steps (autocast, half precision), and masks applied by ``where``/``masked_fill``: those
*replace* scores, so a NaN score at a hidden position (garbage in a padded key) never reaches
the output, while ``sdpa`` adds its mask and would spread it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kiln.ir.builder import GraphBuilder, check_types
from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.op import Op, op_def
from kiln.ops import prims
from kiln.ops.attrs import BroadcastAttrs, ReduceAttrs, SdpaAttrs, UnsqueezeAttrs
from kiln.passes.rewriting import rewrite_nodes

_DTYPES = (torch.float32, torch.float64)
_VIEWS = (Op.RESHAPE, Op.PERMUTE, Op.BROADCAST, Op.EXPAND, Op.UNSQUEEZE, Op.SQUEEZE, Op.SLICE)


@dataclass
class _Match:
    """One attention found: what the ``sdpa`` node reads, and what it replaces."""

    final: Node  # its output becomes the sdpa node's (or the NaN-restoring where's) output
    q: Value
    k: Value
    v: Value
    mask: Value | None
    scale: float
    guard_rows: bool  # whether rows the mask hides entirely must come out NaN
    core: list[Node]  # read only by the pattern: removed
    views: list[Node]  # operand views: removed when nothing else reads them


class _Reader:
    """Who reads each value of one graph: nodes, and the graph's outputs and mutations."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.users = graph.users()
        self.external = set(graph.outputs) | {new for _, new in graph.mutations}

    def only_user(self, value: Value) -> Node | None:
        users = self.users.get(value, [])
        return users[0] if len(users) == 1 and value not in self.external else None

    def read_only_by(self, nodes: Iterable[Node], allowed: set[Node]) -> bool:
        return all(
            out not in self.external and all(user in allowed for user in self.users[out])
            for node in nodes
            for out in node.outputs
        )


def _producer(value: object, op: Op) -> Node | None:
    """The node of ``op`` that defines ``value``, if one does."""
    if isinstance(value, Value) and value.node is not None and value.node.op is op:
        return value.node
    return None


def _number(operand: object) -> float | None:
    if isinstance(operand, bool) or not isinstance(operand, int | float):
        return None
    return float(operand)


def _batched(flat: Value, batch: tuple[int, ...], views: list[Node]) -> Value | None:
    """The operand whose batch dims ``batch`` a matmul flattened into ``flat``'s first dim."""
    if len(batch) == 1:
        return flat
    node = _producer(flat, Op.RESHAPE)
    if node is None or not isinstance(node.inputs[0], Value):
        return None
    source = node.inputs[0]
    if tuple(source.type.shape) != (*batch, *flat.type.shape[-2:]):
        return None
    views.append(node)
    return source


def _keepdim(value: Value, reduce: Op, source: Value, core: list[Node]) -> bool:
    """Whether ``value`` is ``reduce(source, last dim, keepdim=True)`` broadcast to its shape."""
    rank = source.type.rank
    node = _producer(value, Op.BROADCAST)
    if node is not None:
        if node.attrs != BroadcastAttrs(source.type.shape, tuple(range(rank))):
            return False
        core.append(node)
        value = node.inputs[0]  # type: ignore[assignment]
    elif tuple(value.type.shape) != tuple(source.type.shape):
        return False
    unsqueeze = _producer(value, Op.UNSQUEEZE)
    if unsqueeze is None or unsqueeze.attrs != UnsqueezeAttrs((rank - 1,)):
        return False
    reduced = _producer(unsqueeze.inputs[0], reduce)
    if (
        reduced is None
        or reduced.attrs != ReduceAttrs((rank - 1,))
        or reduced.inputs[0] is not source
    ):
        return False
    core += [unsqueeze, reduced]
    return True


def _softmax_input(probs: Value, core: list[Node]) -> Value | None:
    """``x`` when ``probs`` is ``softmax(x, dim=-1)`` as the softmax translation writes it."""
    divide = _producer(probs, Op.DIV)
    exps = _producer(divide.inputs[0], Op.EXP) if divide else None
    shifted = _producer(exps.inputs[0], Op.SUB) if exps else None
    if divide is None or exps is None or shifted is None:
        return None
    scores = shifted.inputs[0]
    if not isinstance(scores, Value) or scores.type.rank < 1:
        return None
    core += [divide, exps, shifted]
    total, high = divide.inputs[1], shifted.inputs[1]
    if not isinstance(total, Value) or not isinstance(high, Value):
        return None
    if not _keepdim(total, Op.SUM, exps.output, core) or not _keepdim(high, Op.AMAX, scores, core):
        return None
    return scores


def _unbroadcast(value: Value, views: list[Node]) -> Value:
    """The operand of a broadcast with PyTorch's rules (trailing dims aligned), else ``value``."""
    node = _producer(value, Op.BROADCAST)
    if node is None or not isinstance(node.inputs[0], Value):
        return value
    source, rank = node.inputs[0], value.type.rank
    if node.attrs.dims != tuple(range(rank - source.type.rank, rank)):
        return value
    views.append(node)
    return source


def _mask_splits(scores: Value) -> list[tuple[Value, Value | None, Node | None]]:
    """Ways to read ``scores`` as (product, additive mask, the add): both operand orders of an
    ``add`` (either reading gives the same sum), and as unmasked."""
    node = _producer(scores, Op.ADD)
    if node is not None:
        left, right = node.inputs
        if isinstance(left, Value) and isinstance(right, Value):
            return [(left, right, node), (right, left, node)]
    return [(scores, None, None)]


def _scaled(scores: Value, core: list[Node]) -> tuple[Value, float]:
    """(the product before a scaling by a Python number, the factor)."""
    for op in (Op.MUL, Op.DIV):
        node = _producer(scores, op)
        operands = node.inputs if node is not None else ()
        if op is Op.MUL and len(operands) == 2 and _number(operands[0]) is not None:
            operands = operands[::-1]
        if len(operands) == 2 and isinstance(operands[0], Value):
            factor = _number(operands[1])
            if factor is not None and factor != 0 and math.isfinite(factor):
                assert node is not None
                core.append(node)
                return operands[0], factor if op is Op.MUL else 1.0 / factor
    return scores, 1.0


def _query(flat: Value, batch: tuple[int, ...], views: list[Node]) -> tuple[Value, float] | None:
    """(q, factor): a ``mul`` of q by a number before the product moves into the scale."""
    q = _batched(flat, batch, views)
    node = _producer(q, Op.MUL)
    if q is None or node is None or not isinstance(node.inputs[0], Value):
        return (q, 1.0) if q is not None else None
    factor = _number(node.inputs[1])
    if factor is None or factor == 0 or not math.isfinite(factor):
        return q, 1.0
    views.append(node)
    return node.inputs[0], factor


def _key(flat: Value, batch: tuple[int, ...], views: list[Node]) -> Value | None:
    """k when ``flat`` is ``k`` with its last two dims swapped (batch flattened)."""
    swapped = _batched(flat, batch, views)
    node = _producer(swapped, Op.PERMUTE)
    if swapped is None or node is None or not isinstance(node.inputs[0], Value):
        return None
    rank = swapped.type.rank
    if node.attrs.dims != (*range(rank - 2), rank - 1, rank - 2):
        return None
    views.append(node)
    return node.inputs[0]


def _product(
    scores: Value, batch: tuple[int, ...], core: list[Node], views: list[Node]
) -> tuple[Value, Value, float] | None:
    """(q, k, scale) when ``scores`` is ``q @ k^T`` times a number (or not scaled)."""
    product, scale = _scaled(scores, core)
    if len(batch) > 1:
        unflatten = _producer(product, Op.RESHAPE)
        if unflatten is None or not isinstance(unflatten.inputs[0], Value):
            return None
        core.append(unflatten)
        product = unflatten.inputs[0]
    first = _producer(product, Op.BMM)
    if first is None or tuple(product.type.shape[-2:]) != tuple(scores.type.shape[-2:]):
        return None
    core.append(first)
    flat_q, flat_k = first.inputs
    assert isinstance(flat_q, Value) and isinstance(flat_k, Value)
    query, k = _query(flat_q, batch, views), _key(flat_k, batch, views)
    if query is None or k is None:
        return None
    return query[0], k, scale * query[1]


def _probabilities(second: Node, reader: _Reader) -> tuple[Value, Node, list[Node]] | None:
    """(probabilities, final node, core so far) of the product ``second`` = probs @ v: an n-d
    matmul flattens the batch dims of probs by a reshape and restores them after."""
    flat_probs = second.inputs[0]
    assert isinstance(flat_probs, Value)
    flatten = _producer(flat_probs, Op.RESHAPE)
    source = flatten.inputs[0] if flatten is not None else None
    if flatten is None or not isinstance(source, Value) or source.type.rank < 4:
        return flat_probs, second, [second]
    if tuple(source.type.shape[-2:]) != tuple(flat_probs.type.shape[-2:]):
        return None
    final = reader.only_user(second.output)
    expected = (*source.type.shape[:-2], *second.output.type.shape[-2:])
    if final is None or final.op is not Op.RESHAPE or final.output.type.shape != expected:
        return None
    return source, final, [second, flatten, final]


def _match(second: Node, reader: _Reader) -> _Match | None:
    """The attention ending in ``second`` (the product of the probabilities and v), or None."""
    found = _probabilities(second, reader)
    if found is None or found[0].type.dtype not in _DTYPES or found[0].type.rank < 3:
        return None
    probs, final, core = found
    batch = tuple(d for d in probs.type.shape[:-2] if isinstance(d, int))
    if len(batch) != probs.type.rank - 2:
        return None  # symbolic batch dims: no match
    views: list[Node] = []
    flat_v = second.inputs[1]
    assert isinstance(flat_v, Value)
    v = _batched(flat_v, batch, views)
    scores = _softmax_input(probs, core)
    if v is None or scores is None:
        return None
    for unmasked, mask, add in _mask_splits(scores):
        more_core, more_views = [*core, *([add] if add else [])], list(views)
        product = _product(unmasked, batch, more_core, more_views)
        if product is None:
            continue
        mask = _unbroadcast(mask, more_views) if mask is not None else None
        inner = [node for node in more_core if node is not final]
        if not reader.read_only_by(inner, set(more_core)):
            return None
        q, k, scale = product
        guard = mask is not None and not _finite(mask, reader.graph)
        match = _Match(final, q, k, v, mask, scale, guard, more_core, more_views)
        return match if _types_agree(match) else None
    return None


def _types_agree(match: _Match) -> bool:
    """Whether ``sdpa`` accepts the operands and gives exactly the replaced value's type."""
    types = [match.q.type, match.k.type, match.v.type]
    if match.mask is not None:
        types.append(match.mask.type)  # a float mask of q's dtype; amax needs a key
        if match.mask.type.shape[-1:] == (0,):
            return False
    if any(t.dtype != match.q.type.dtype for t in types):
        return False
    attrs = SdpaAttrs(scale=match.scale)
    try:
        result = op_def(Op.SDPA).meta(attrs, *types[:3], types[3] if len(types) > 3 else None)
    except Exception:  # torch rejects the operands: no match
        return False
    return check_types(result, match.final.output.type)


def _finite(value: Value, graph: Graph, depth: int = 8) -> bool:
    """Whether ``value`` holds finite numbers whatever the graph's inputs (a mask built from
    conditions and finite fill values, as transformers builds them)."""
    if value.kind is InputKind.CONSTANT:
        return bool(torch.isfinite(graph.constants[value.name]).all())
    node, dtype = value.node, value.type.dtype
    if node is None or depth == 0 or dtype not in _DTYPES:
        return False
    if node.op is Op.FULL:
        return _fits(node.attrs.value, dtype)
    if node.op is Op.CONVERT:
        source = node.inputs[0]
        assert isinstance(source, Value)
        if not source.type.dtype.is_floating_point:
            return True  # bool and integers (up to 2**63) fit float32
        wider = torch.finfo(source.type.dtype).max <= torch.finfo(dtype).max
        return wider and _finite(source, graph, depth - 1)
    if node.op in _VIEWS:
        operand = node.inputs[0]
        return isinstance(operand, Value) and _finite(operand, graph, depth - 1)
    if node.op is Op.WHERE:
        return all(
            _finite(o, graph, depth - 1) if isinstance(o, Value) else _fits(o, dtype)
            for o in node.inputs[1:]
        )
    return False


def _fits(operand: object, dtype: torch.dtype) -> bool:
    """Whether a Python number stays finite in ``dtype``."""
    number = _number(operand)
    return number is not None and abs(number) <= torch.finfo(dtype).max


def _restore_hidden_rows(attended: Value, mask: Value) -> Value:
    """``attended`` with NaN rows where ``mask`` is ``-inf`` for every key, as eager's softmax."""
    rank, out_rank = mask.type.rank, attended.type.rank
    highest = prims.amax(mask, dims=(rank - 1,))
    seen = prims.ne(highest, -math.inf)
    dims = tuple(range(out_rank - rank, out_rank - 1))
    rows = prims.broadcast(seen, shape=attended.type.shape, dims=dims)
    return prims.where(rows, attended, math.nan)


def _emit(match: _Match, builder: GraphBuilder) -> None:
    """Append the ``sdpa`` node (and the NaN rows) that take over ``match.final``'s output."""
    output = match.final.output
    with (
        torch.set_grad_enabled(output.type.requires_grad),
        builder.origin_scope(match.final.origin),
    ):
        attended = prims.sdpa(match.q, match.k, match.v, match.mask, scale=match.scale)
        if match.guard_rows:
            assert match.mask is not None
            attended = _restore_hidden_rows(attended, match.mask)
    node = attended.node
    node.outputs = (output,)
    output.node = node


def fuse_attention(graph: Graph) -> Graph:
    """``graph`` with each attention written in prims replaced by ``sdpa`` (module docstring)."""
    reader = _Reader(graph)
    matches: dict[Node, _Match] = {}
    for node in graph.nodes:
        if node.op is Op.BMM:
            match = _match(node, reader)
            if match is not None:
                matches[match.final] = match
    if not matches:
        return graph
    removed = {node for match in matches.values() for node in match.core}
    views = {node for match in matches.values() for node in match.views}
    order = {node: index for index, node in enumerate(graph.nodes)}
    operands = {v for m in matches.values() for v in (m.q, m.k, m.v, m.mask) if v is not None}
    for node in sorted(views, key=order.__getitem__, reverse=True):
        if reader.read_only_by([node], removed) and operands.isdisjoint(node.outputs):
            removed.add(node)

    def emit(node: Node, builder: GraphBuilder) -> None:
        if node in matches:  # other removed nodes emit nothing
            _emit(matches[node], builder)

    return rewrite_nodes(graph, removed | set(matches), emit)
