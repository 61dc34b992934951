"""torch API -> prims translations, one table keyed by the torch callable.

Importing this package registers every translation. ``lookup(fn)`` finds one; a callable with
no translation becomes an ``extern`` node (see ``kiln.ops.externs``), never an error.
One module per family of torch APIs; ``common`` holds PyTorch's implicit rules (promotion,
broadcasting, autocast) and ``table`` the registry.
"""

# Registration happens on import; the order does not matter.
from kiln.ops.translations import (  # noqa: F401
    activations,
    adaptive_pooling,
    attention,
    conversions,
    convolution,
    creation,
    einsum,
    factories,
    gathering,
    indexing,
    joining,
    linalg,
    losses,
    math,
    nn,
    normalization,
    norms,
    pooling,
    reductions,
    shape,
    slicing,
    sorting,
    ternary,
    unary,
)
from kiln.ops.translations.table import (
    Call,
    FallbackToExtern,
    Translation,
    api_name,
    assign_input,
    collect_assignments,
    entries,
    finish_assignments,
    lookup,
    override,
    translation,
)

__all__ = [
    "Call",
    "FallbackToExtern",
    "Translation",
    "api_name",
    "assign_input",
    "collect_assignments",
    "entries",
    "finish_assignments",
    "lookup",
    "override",
    "translation",
]
