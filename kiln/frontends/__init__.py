"""Frontends: turn a Python program into a Graph.

Input: a function or ``nn.Module`` and example inputs. Output: a verified ``kiln.ir.Graph``.
``trace`` (symbolic tracing with proxy tensors) lives here, and torch.fx interop
(``to_fx``, ``from_fx``); bytecode capture is ``kiln.capture``.
"""

from kiln.frontends.fx import from_fx, to_fx
from kiln.frontends.lowerings import register_lowering
from kiln.frontends.trace import graph_inputs, rebuild_outputs, run_traced, trace

__all__ = [
    "from_fx",
    "graph_inputs",
    "rebuild_outputs",
    "register_lowering",
    "run_traced",
    "to_fx",
    "trace",
]
