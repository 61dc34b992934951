"""Opcode handlers, one module per family: ``data`` (stack, locals, operators, containers),
``flow`` (jumps, loops, ``with``, exceptions), ``names`` (globals, attributes, cells) and
``calls`` (calls and function creation).

Importing this package registers every handler in ``kiln.capture.core.frame.HANDLERS``.
Handlers call down into ``calls`` and ``core``; they never import each other.
"""

from kiln.capture.handlers import calls, data, flow, names

__all__ = ["calls", "data", "flow", "names"]
