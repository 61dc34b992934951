"""The op registry rows and the torch-API translations.

Input: nothing. Output: registry rows for every :class:`~kiln.ir.Op` (``elementwise``,
``reductions``, ``movement``, ``indexing``, ``creation``, ``externs``, ``attention``, and the
VJPs of the autodiff markers in ``autograd_function`` and ``untracked``) and the
translation table from torch callables to prims (``kiln.ops.translations``). Importing this
package registers everything.
"""

from kiln.ops import (  # noqa: F401  (importing registers the rows)
    attention,
    autograd_function,
    creation,
    elementwise,
    externs,
    indexing,
    movement,
    reductions,
    translations,
    untracked,
)
