"""torch API -> prims translations, one table keyed by the torch callable.

Importing this package registers every translation. ``lookup(fn)`` finds one; a callable with
no translation becomes an ``extern`` node (see ``kiln.ops.externs``), never an error.
"""

from kiln.ops.translations.table import (
    Call,
    FallbackToExtern,
    Translation,
    api_name,
    assign_input,
    collect_assignments,
    finish_assignments,
    entries,
    lookup,
    translation,
)

__all__ = ["Call", "FallbackToExtern", "Translation", "api_name", "assign_input", "collect_assignments", "finish_assignments", "entries", "lookup", "translation"]
from kiln.ops.translations import reductions, norms, sorting, normalization, losses  # noqa: F401
from kiln.ops.translations import attention, convolution, einsum, linalg, nn  # noqa: F401
from kiln.ops.translations import adaptive_pooling, pooling  # noqa: F401
from kiln.ops.translations import math, unary  # noqa: F401
from kiln.ops.translations import gathering, indexing, joining, shape, slicing  # noqa: F401
from kiln.ops.translations import ternary  # noqa: F401
from kiln.ops.translations import activations  # noqa: F401
from kiln.ops.translations import creation  # noqa: F401
from kiln.ops.translations import conversions  # noqa: F401
