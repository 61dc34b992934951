"""Layout choice: the strides of the values kernels store, channels-last around convolutions.

cuDNN's convolutions are fastest on channels-last operands, and so are oneDNN's on the CPU, so
a 4-D value that feeds a convolution (or its backward) is stored channels-last, on the GPU and
the CPU, for inference and training; a graph input a convolution reads in the NCHW layout is
copied channels-last first. Other values follow the layout of a same-shaped dense value they
are computed from, as eager's elementwise ops keep ``channels_last``, else are contiguous: the
layout propagates from one convolution to the next instead of being converted back and forth.
(The strides in a dim order, and those extern results will have, are in ``layouts.py``.)
"""

from __future__ import annotations

from kiln.ir.graph import Node, Origin, Value
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim
from kiln.ops.attrs import ConvertAttrs
from kiln.ops.externs import convolution_backward
from kiln.schedule import index as ix
from kiln.schedule.layouts import channels_last_strides, memory_order, strides_in_order
from kiln.schedule.loops import BufferKind
from kiln.schedule.lowering import REDUCE_KINDS, in_kernels, shape_of
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS


class LayoutChoice:
    """Layouts for values of a graph whose readers are ``users``, given the ``layouts`` of the
    values in memory so far (the fusion walk adds to it as it stores them)."""

    def __init__(self, users: dict[Value, list[Node]], layouts: dict[Value, View]):
        self.users = users
        self.layouts = layouts

    def strides_for(self, value: Value) -> tuple[Dim, ...]:
        """The layout of a value a kernel stores: channels-last when it feeds a convolution on
        the GPU (cuDNN's fast path), the dim order of an input it is computed from (as eager's
        elementwise ops, pooling and cropping keep ``channels_last``), else contiguous."""
        shape = shape_of(value)
        contiguous = ix.contiguous_strides(shape)
        if self.wants_channels_last(value):
            return channels_last_strides(shape)
        source = self.source_strides(value)
        if source is not None:
            return source
        return channels_last_strides(shape) if self._feeds_channels_last(value) else contiguous

    def source_strides(self, value: Value) -> tuple[Dim, ...] | None:
        """Dense strides in the dim order of a value in memory that ``value`` is computed
        from (see :meth:`_source_layout`), or None when there is none."""
        shape = shape_of(value)
        layout = self._source_layout(value, shape) or self._source_layout(value, shape, True)
        if layout is not None and 0 not in layout.strides:  # (dense or not: a strided slice)
            return strides_in_order(shape, memory_order(layout.strides))
        return None

    def _feeds_channels_last(self, value: Value) -> bool:
        """Whether elementwise work of ``value``'s shape leads from it to a convolution's
        operand: a residual stream whose bfloat16 copy a convolution reads (ConvNeXt's, after
        a LayerNorm reached through permutes) is stored in the order of that copy, or the
        kernel storing both reads and writes one of them across its rows."""
        shape, stack, seen = shape_of(value), [value], {value}
        while stack:
            for user in self.users.get(stack.pop(), ()):
                out = user.outputs[0] if len(user.outputs) == 1 else None
                if out is None or out in seen or user.op in REDUCE_KINDS or user.op in VIEW_OPS:
                    continue
                if not _is_convolution(user) and shape_of(out) == shape and in_kernels(user):
                    if self.wants_channels_last(out):
                        return True
                    seen.add(out)
                    stack.append(out)
        return False

    def _source_layout(
        self, value: Value, shape: tuple[Dim, ...], resized: bool = False
    ) -> View | None:
        """The layout of the first same-shaped value in memory that ``value``'s inlined
        elementwise work reads (depth-first, operands in order). ``resized``: the first value of
        the same rank, none of its dims broadcast, read through pads and the views that keep
        the dims in order (a max pool's strided slices of its padded input; its backward's
        interleaving ``unsqueeze``, ``pad``, ``reshape``). A stored factor broadcast is passed
        over, as its inlined expression was before it was stored: a BatchNorm's scale made its
        ReLU over channels-last input write NCHW, walking the input across its channels (1.09
        ms against 0.21 on an H200); so is a graph input broadcast per channel (a BatchNorm's
        bias). One dense in the trailing dims (a LayerNorm's bias) still ends the walk with no
        order, so the result is contiguous: ViT's LayerNorm output, following the residual
        stream's sequence-first order instead, needed a copy before each MLP."""
        stack, seen = [value], {value}
        while stack:
            current = stack.pop()
            node = current.node
            if node is None or node.op in REDUCE_KINDS:
                continue
            if node.op in VIEW_OPS and not (resized and node.op in _ORDERED_VIEWS):
                continue
            for operand in reversed(list(node.input_values())):
                alike = _alike(shape_of(operand), shape, resized)
                if operand in seen or not (alike or (resized and operand not in self.layouts)):
                    continue
                seen.add(operand)
                if operand in self.layouts and _orderless(self.layouts[operand]):
                    continue  # (a stored factor, a per-channel input: the walk goes on)
                if operand in self.layouts:
                    return self.layouts[operand]
                stack.append(operand)
        return None

    def wants_channels_last(self, value: Value) -> bool:
        """Whether ``value`` feeds a convolution (or its backward) on the GPU or the CPU:
        cuDNN's convolutions are fastest on channels-last operands, and so are oneDNN's on the
        CPU (small_cnn inference on two cores: 1.6-1.9x eager against about 1x; training, with
        the C++ generator's split column reductions for the BatchNorm statistics over
        channels-last rows, ``kiln/codegen/cpp_split.py``: see benchmarks/RESULTS.md)."""
        feeds_convolution = any(_is_convolution(u) for u in self.users.get(value, ()))
        if len(shape_of(value)) != 4 or not feeds_convolution:
            return False
        return value.type.device.type in ("cuda", "cpu")

    def copies_channels_last(self, node: Node, position: int, operand: Value) -> bool:
        """Whether extern ``node`` reads ``operand``, its operand at ``position`` and a graph
        input (the caller checks that), through a channels-last copy: when a convolution reads
        it as its input (or its backward as the gradient or the input) in the NCHW layout,
        where convolutions go channels-last (:meth:`wants_channels_last`). Else the
        convolution answers NCHW (oneDNN and cuDNN follow the input), and every kernel between
        it and the next convolution converts between the layouts: small_cnn's first BatchNorm
        read NCHW and wrote channels-last, column by column. Weights stay as they are (the
        libraries reorder them anyway). Not for transposed convolutions: oneDNN's
        channels-last float16 one accumulates in float16 (4 ulps off on the op table's
        sample)."""
        view = self.layouts[operand]
        shape = shape_of(operand)
        activations = 1 if node.op is Op.CONVOLUTION else 2  # (x) or (gradient, x)
        return (
            _is_convolution(node)
            and position < activations
            and not _transposed(node)
            and len(shape) == 4
            and view.strides != channels_last_strides(shape)
            and view.strides == ix.contiguous_strides(shape)
            and self.wants_channels_last(operand)
        )


def _orderless(view: View) -> bool:
    """Whether ``view``, a broadcast (a zero stride, size above one), tells nothing of a
    result's dim order: a small value the program computed and stored (``inlining``), or a
    graph input whose dense dims are not the trailing ones (a BatchNorm's per-channel bias:
    it ended the walk, so the centred BatchNorm's ReLU over channels-last input walked NCHW).
    A graph input dense in the trailing dims (a LayerNorm's bias) agrees with contiguous."""
    pairs = list(zip(view.strides, view.shape, strict=True))
    if not any(st == 0 and not (isinstance(size, int) and size == 1) for st, size in pairs):
        return False
    if view.buffer.kind is BufferKind.TEMP:
        return True
    kept = [d for d, (st, _) in enumerate(pairs) if st != 0]
    return bool(kept) and kept != list(range(kept[0], len(pairs)))


# Views whose dims stay in their order (sizes split, joined, added or dropped), so a source read
# through them tells the memory order of the result's same-rank dims.
_ORDERED_VIEWS = frozenset({Op.SLICE, Op.RESHAPE, Op.UNSQUEEZE, Op.SQUEEZE})


def _alike(shape: tuple[Dim, ...], target: tuple[Dim, ...], resized: bool) -> bool:
    if not resized:
        return shape == target
    return len(shape) == len(target) and all(
        a > 1 or b <= 1 for a, b in zip(shape, target, strict=True)
    )


def channels_last_copy(operand: Value, convolution: Node) -> Value:
    """A new value: ``operand`` converted to its own dtype, for a kernel to store
    channels-last before ``convolution`` reads it (``LayoutChoice.copies_channels_last``)."""
    return copied(operand, "channels_last", convolution.origin)


def copied(operand: Value, label: str, at: Origin) -> Value:
    """A new value: ``operand`` converted to its own dtype (a copy a kernel stores in another
    layout), made at ``at``'s source line."""
    copy = Value(f"{operand.name}_{label}", operand.type)
    attrs = ConvertAttrs(operand.type.dtype)
    copy.node = Node(Op.CONVERT, (operand,), attrs, (copy,), Origin(label, at.file, at.line))
    return copy


def _transposed(convolution: Node) -> bool:
    """Whether a convolution (or its backward: the forward's attrs are its keywords) is
    transposed."""
    attrs = convolution.attrs
    if convolution.op is Op.CONVOLUTION:
        return bool(attrs.transposed)
    return bool(attrs.kwargs.get("transposed", False))


def _is_convolution(node: Node) -> bool:
    """A convolution or its backward (whose gradient and input operands cuDNN wants laid out
    like the forward's: a contiguous gradient made it transpose every one, and made the
    kernel writing it store across the channels-last rows it reads)."""
    return node.op is Op.CONVOLUTION or (
        node.op is Op.EXTERN and node.attrs.fn is convolution_backward
    )
