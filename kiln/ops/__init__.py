"""The op registry rows and the torch-API translations.

Input: nothing. Output: registry rows for every :class:`~kiln.ir.Op` (``elementwise``,
``reductions``, ``movement``, ``creation``, ``externs``) and the translation table from torch
callables to prims (``kiln.ops.translations``). Importing this package registers everything.
"""

from kiln.ops import elementwise  # noqa: F401  (registers rows)
from kiln.ops import indexing, movement  # noqa: F401  (registers rows)
from kiln.ops import creation, externs, reductions  # noqa: F401  (registers rows)
from kiln.ops import translations  # noqa: F401  (registers translations)
