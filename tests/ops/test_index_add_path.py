"""``index_put(accumulate=True)`` runs as ``index_add`` on CUDA (atomic adds instead of a sort);
the rewrite must give index_put's results for every index form it takes."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.indexing import _index_add


@pytest.mark.parametrize(
    ("shape", "dim", "index_shape", "values_shape"),
    [
        ((30, 8), 0, (50,), (50, 8)),  # embedding gradient: duplicates accumulate
        ((4, 30, 3), 1, (5, 7), (4, 5, 7, 3)),  # a 2-D index on a middle dim
        ((10, 6), 0, (12,), (6,)),  # values broadcast
        ((0, 6), 0, (0,), (0, 6)),  # nothing to add
        ((5, 0), 0, (3,), (3, 0)),
    ],
)
def test_index_add_matches_index_put(
    shape: tuple[int, ...], dim: int, index_shape: tuple[int, ...], values_shape: tuple[int, ...]
) -> None:
    x = torch.randn(*shape, dtype=torch.float64)
    size = shape[dim]
    index = torch.randint(-size, max(size, 1), index_shape)  # negatives wrap, as index_put's do
    values = torch.randn(*values_shape, dtype=torch.float64)
    expected = torch.ops.aten.index_put(x, [None] * dim + [index], values, True)
    torch.testing.assert_close(_index_add(dim, x, values, index), expected)
