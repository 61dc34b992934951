"""Frontends: turn a Python program into a Graph.

Input: a function or ``nn.Module`` and example inputs. Output: a verified ``kiln.ir.Graph``.
``trace`` (symbolic tracing with proxy tensors) lives here; bytecode capture is ``kiln.capture``.
"""

from kiln.frontends.lowerings import register_lowering
from kiln.frontends.trace import graph_inputs, rebuild_outputs, run_traced, trace

__all__ = ["graph_inputs", "rebuild_outputs", "register_lowering", "run_traced", "trace"]
