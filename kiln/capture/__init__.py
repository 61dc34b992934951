"""Bytecode capture: Python frames to graphs, guards and generated code (the role TorchDynamo
plays in PyTorch 2), without a C extension.

Input: a function and the arguments of one call. Output: a cache entry -- a guard function
over the arguments, and a head function that runs the captured graph, replays side effects
and rebuilds the frame's result, or, at a graph break, performs the unsupported step natively
and continues in a resume function that is compiled in its turn.

Stages, one module each: ``frame`` (the symbolic interpreter loop) with ``ops_*`` (one handler
per opcode), ``calls``/``builtins``/``modules`` (what a call does), ``session`` (graph, guards,
sources, side effects of one capture), ``sources``/``guards``, ``reconstruct`` and ``resume``
(generated code), ``convert`` (one capture end to end), ``cache`` (compiled wrappers and the
per-code cache), ``explain``. The bytecode toolkit (``bytecode``, ``assembler``, ``rewrite``)
builds resume functions.
"""

from kiln.capture import (  # noqa: F401  (register the opcode handlers and call models)
    higher_order,
    ops_calls,
    ops_data,
    ops_flow,
    ops_names,
)
