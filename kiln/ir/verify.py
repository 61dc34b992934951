"""The IR verifier: the invariants every frontend and pass must keep.

``verify(graph)`` checks, and raises :class:`VerificationError` naming the node otherwise:

- every value is defined once, before it is used (SSA, topological order);
- every node's op has a registry row, and its attributes are that row's dataclass;
- re-running the op's meta on the operand types gives the recorded output types;
- outputs and mutations name defined values, and mutations target graph inputs;
- every constant input has its tensor in ``graph.constants``.
"""

from __future__ import annotations

from kiln.errors import VerificationError
from kiln.ir.builder import check_types
from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.op import op_def
from kiln.ir.printer import format_node


def _fail(message: str, node: Node | None = None) -> VerificationError:
    where = f"\n  at: {format_node(node)}" if node is not None else ""
    return VerificationError(f"invalid graph: {message}{where}")


def verify(graph: Graph) -> Graph:
    """Check ``graph``'s invariants and return it unchanged."""
    defined: set[Value] = set()
    names: set[str] = set()

    def define(value: Value, node: Node | None) -> None:
        if value in defined or value.name in names:
            raise _fail(f"value {value.name} is defined twice", node)
        defined.add(value)
        names.add(value.name)

    for value in graph.inputs:
        define(value, None)
        if value.kind is None:
            raise _fail(f"input {value.name} has no input kind")
        if value.kind is InputKind.CONSTANT and value.name not in graph.constants:
            raise _fail(f"constant input {value.name} has no tensor in graph.constants")
    for node in graph.nodes:
        _verify_node(node, defined)
        for out in node.outputs:
            if out.node is not node:
                raise _fail(f"output {out.name} does not point back at its node", node)
            define(out, node)
    for value in graph.outputs:
        if value not in defined:
            raise _fail(f"output {value.name} is not defined")
    for target, new in graph.mutations:
        if target not in graph.inputs:
            raise _fail(f"mutation target {target.name} is not a graph input")
        if new not in defined:
            raise _fail(f"mutation value {new.name} is not defined")
        if not check_types(target.type, new.type):
            raise _fail(f"mutation of {target.name} changes its type to {new.type}")
    return graph


def _verify_node(node: Node, defined: set[Value]) -> None:
    for value in node.input_values():
        if value not in defined:
            raise _fail(f"operand {value.name} is used before it is defined", node)
    definition = op_def(node.op)
    if definition.attrs is None:
        if node.attrs is not None:
            raise _fail(f"{node.op.name} takes no attributes", node)
    elif not isinstance(node.attrs, definition.attrs):
        raise _fail(f"{node.op.name} attributes must be {definition.attrs.__name__}", node)
    operand_types = tuple(i.type if isinstance(i, Value) else i for i in node.inputs)
    try:
        types = definition.meta(node.attrs, *operand_types)
    except Exception as error:
        raise _fail(f"meta rejects the operands: {error}", node) from error
    expected = types if isinstance(types, tuple) else (types,)
    if len(expected) != len(node.outputs):
        raise _fail(f"{len(node.outputs)} outputs recorded, meta gives {len(expected)}", node)
    for want, out in zip(expected, node.outputs, strict=True):
        if not check_types(want, out.type):
            raise _fail(f"{out.name} is recorded as {out.type}, meta gives {want}", node)
