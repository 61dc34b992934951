"""Bytecode capture: Python frames to graphs, guards and generated code (the role TorchDynamo
plays in PyTorch 2), without a C extension.

Input: a function and the arguments of one call. Output: a cache entry -- a guard function
over the arguments, and a head function that runs the captured graph, replays side effects
and rebuilds the frame's result, or, at a graph break, performs the unsupported step natively
and continues in a resume function that is compiled in its turn.

Subpackages, bottom to top (each imports only those below it):

* ``bytecode``: decode, assemble and rewrite code objects (resume functions);
* ``guards``: sources of values read from outside the frame, and the guards on them;
* ``core``: the symbolic frame, the session of one capture, graph breaks, iteration;
* ``calls``: what a call does (inline, native, models of builtins, modules, Functions);
* ``handlers``: one handler per opcode, registered in ``core.frame.HANDLERS``;
* ``driver``: one capture end to end (``convert``), generated code (``reconstruct``,
  ``resume``), the per-code cache (``cache``) and ``explain``.


This module imports nothing, so importing one layer never drags in the ones above it.
"""
