"""torch.fx interop: a Kiln :class:`~kiln.ir.Graph` as a ``torch.fx.GraphModule`` and back.

``to_fx(graph)`` gives a GraphModule of one ``call_function`` per node, whose target is a
:class:`PrimCall`: the op's reference implementation (its registry row's ``impl``) with the
node's attributes bound. For the graph ``t0 = mul(x, 2.0); t1 = sum(t0, dims=(0,))``::

    def forward(self, x):
        t0 = kiln_mul(x, 2.0)
        t1 = kiln_sum(t0)
        return (t1,)

Calling convention: the GraphModule takes the graph's inputs in ``graph.inputs`` order except
``CONSTANT`` ones, which are attributes of the module (``self.c``), and returns a tuple of the
outputs followed by the new values of mutated inputs, exactly as :func:`kiln.ir.interpret`
does (it does not write them back either).

``from_fx(gm, example_inputs)`` traces the GraphModule with :func:`kiln.trace`, so torch-level
graphs (``symbolic_trace``, Dynamo) become prims through the translation table. In aten-level
graphs (``make_fx``, AOTAutograd) each ``torch.ops.aten`` call whose op PyTorch also binds as a
``torch`` function or ``Tensor`` method is retargeted to that binding first (the same
operator, chosen by the same overload resolution), so it is translated instead of being kept
as an ``extern`` node; other aten calls stay externs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from kiln.errors import KilnError
from kiln.frontends.proxy import ProxyTensor
from kiln.frontends.trace import trace
from kiln.ir.builder import active_builder
from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.op import op_def
from kiln.ops.translations.table import lookup


class PrimCall:
    """One node's op applied as its reference implementation, the node's attributes bound:
    the ``call_function`` target ``to_fx`` gives each node. Outputs whose Kiln type does not
    require grad are detached, as the reference interpreter does."""

    def __init__(self, node: Node) -> None:
        self.op = node.op
        self.attrs = node.attrs
        self.frozen = tuple(not value.type.requires_grad for value in node.outputs)
        # torch.fx names a call's target by these (printed as ``kiln_mul``).
        self.__name__ = node.op.printed_name
        self.__module__ = "kiln"

    def __call__(self, *operands: Any) -> Any:
        builder = active_builder()
        if builder is not None:
            # Traced (from_fx of a to_fx module): the node itself, not its impl's torch calls.
            values = tuple(
                o.current()
                if isinstance(o, ProxyTensor)
                else builder.constant(o)
                if isinstance(o, torch.Tensor)
                else o
                for o in operands
            )
            emitted = builder.emit(self.op, values, self.attrs)
            if isinstance(emitted, tuple):
                return tuple(map(ProxyTensor, emitted))
            return ProxyTensor(emitted)
        result = op_def(self.op).impl(self.attrs, *operands)
        results = result if isinstance(result, tuple) else (result,)
        results = tuple(
            tensor.detach() if frozen and getattr(tensor, "requires_grad", False) else tensor
            for tensor, frozen in zip(results, self.frozen, strict=True)
        )
        return results if isinstance(result, tuple) else results[0]

    def __repr__(self) -> str:
        return f"PrimCall({self.op.printed_name}, {self.attrs!r})"


def to_fx(graph: Graph) -> torch.fx.GraphModule:
    """A ``torch.fx.GraphModule`` computing what ``graph`` computes (see the module docstring
    for its calling convention). A graph with symbolic sizes must be specialized first."""
    if graph.symbols:
        raise KilnError(
            f"graph {graph.name} has symbolic sizes {graph.symbols}: specialize it first "
            "(kiln.ir.specialize.specialize)"
        )
    fx_graph = torch.fx.Graph()
    nodes: dict[Value, torch.fx.Node] = {}
    attributes: dict[str, torch.Tensor] = {}
    for value in graph.inputs:
        if value.kind is InputKind.CONSTANT:
            attributes[value.name] = graph.constants[value.name]
            nodes[value] = fx_graph.get_attr(value.name)
        else:
            nodes[value] = fx_graph.placeholder(value.name)
    for node in graph.nodes:
        operands = tuple(nodes[i] if isinstance(i, Value) else i for i in node.inputs)
        call = fx_graph.create_node(
            "call_function", PrimCall(node), operands, name=_call_name(node)
        )
        if len(node.outputs) == 1:
            nodes[node.output] = call
            continue
        for index, value in enumerate(node.outputs):
            nodes[value] = fx_graph.create_node(
                "call_function", operator.getitem, (call, index), name=value.name
            )
    results = [*graph.outputs, *(new for _, new in graph.mutations)]
    fx_graph.output(tuple(nodes[value] for value in results))
    return torch.fx.GraphModule(attributes, fx_graph, class_name=graph.name)


def _call_name(node: Node) -> str:
    first = node.outputs[0].name if node.outputs else node.op.printed_name
    return first if len(node.outputs) == 1 else f"{first}_all"


def from_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Graph:
    """The Kiln graph of ``gm(*example_inputs)``: traced by :func:`kiln.trace`, after
    retargeting the aten calls that have a translated ``torch`` binding (module docstring).
    Its inputs are in ``kiln.trace``'s order: ``gm``'s own parameters and buffers, then its
    tensor arguments (``kiln.frontends.graph_inputs(graph, gm, *args)`` lists them). Shapes
    are the example inputs', specialized (FakeTensors with symbolic sizes are not taken)."""
    return trace(_retarget_aten(gm), *example_inputs)


def _retarget_aten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ``torch.ops.aten`` calls call the ``torch`` binding of the same
    operator where Kiln translates that binding (``aten.add.Tensor`` -> ``torch.add``)."""
    changes = {
        node: binding
        for node in gm.graph.nodes
        if node.op == "call_function" and (binding := _torch_binding(node.target)) is not None
    }
    if not changes:
        return gm
    fx_graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    output = fx_graph.graph_copy(gm.graph, copies)
    for original, binding in changes.items():
        copies[original].target = binding
    fx_graph.output(output)
    return torch.fx.GraphModule(gm, fx_graph, class_name=type(gm).__name__)


# Python bindings that call one aten operator with its own schema (overloads resolved by the
# arguments' types), in order of preference.
_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)


def _torch_binding(target: Any) -> Any:
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    if "out" in target._overloadname:  # out= variants write into an argument
        return None
    name = target.overloadpacket.__name__
    if name == "_unsafe_view":  # a view whose result autograd treats as new memory
        name = "reshape"
    for namespace in _BINDINGS:
        binding = getattr(namespace, name, None)
        if binding is not None and lookup(binding) is not None:
            return binding
    return None
