"""Graph -> Graph passes, one per module, and the ordered pipeline that runs them.

Every pass maps a verified graph to a verified graph computing the same outputs and mutations.
Passes share Values with their input (a rewritten node re-points its outputs), so the input
graph must not be used afterwards. ``optimize`` runs the pipeline; capture and autodiff call
it before a backend compiles a graph.
"""

from __future__ import annotations

from kiln.ir.graph import Graph
from kiln.passes.attention import fuse_attention
from kiln.passes.attention_statistics import keep_attention_statistics
from kiln.passes.conv_bn import fold_conv_batchnorm
from kiln.passes.cse import eliminate_common_subexpressions
from kiln.passes.dce import eliminate_dead_code
from kiln.passes.markers import remove_autodiff_markers
from kiln.passes.matmul_padding import pad_matmul
from kiln.passes.matmul_transpose import transpose_matmul
from kiln.passes.pointwise_conv import convolutions_as_matmuls
from kiln.passes.reduction_split import split_reductions
from kiln.passes.relu_mask import read_relu_masks_from_outputs
from kiln.passes.sum_factor import factor_sums

# The pattern rewrites run first, on the graph as the translations wrote it (CSE could give a
# pattern's values extra readers); CSE and DCE then clean up after them.
PIPELINE = [
    remove_autodiff_markers,
    fuse_attention,
    keep_attention_statistics,
    fold_conv_batchnorm,
    convolutions_as_matmuls,
    transpose_matmul,
    pad_matmul,
    factor_sums,
    split_reductions,
    read_relu_masks_from_outputs,
    eliminate_common_subexpressions,
    eliminate_dead_code,
]


# Passes that shape the work for kernels rather than change the math run on the forward and
# backward graphs after partitioning, not on the graph autodiff differentiates: there a split
# reduction's VJP becomes a permuted, reshaped broadcast, which hides a per-channel factor
# from factor_sums (a BatchNorm backward's third sum then needs a kernel of its own). The
# markers for autodiff (custom Functions' backward, writes through .data) stay until autodiff
# has used them.
AFTER_AUTODIFF = frozenset({remove_autodiff_markers, factor_sums, split_reductions})


def optimize(graph: Graph, *, differentiating: bool = False) -> Graph:
    """``graph`` through the pipeline; ``differentiating``: the graph autodiff will
    differentiate, without the passes of ``AFTER_AUTODIFF``."""
    for run in PIPELINE:
        if not (differentiating and run in AFTER_AUTODIFF):
            graph = run(graph)
    return graph


__all__ = [
    "AFTER_AUTODIFF",
    "PIPELINE",
    "convolutions_as_matmuls",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "factor_sums",
    "fold_conv_batchnorm",
    "fuse_attention",
    "keep_attention_statistics",
    "optimize",
    "pad_matmul",
    "read_relu_masks_from_outputs",
    "remove_autodiff_markers",
    "split_reductions",
    "transpose_matmul",
]
