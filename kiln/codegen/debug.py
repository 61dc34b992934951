"""The debug directory (``KILN_DEBUG_DIR``): what one compiled program is, for people to read."""

from __future__ import annotations

import os

from kiln.codegen.wrapper import Wrapper
from kiln.ir.graph import Graph
from kiln.schedule.loops import format_kernel
from kiln.schedule.program import Program


def dump_program(graph: Graph, program: Program, directory: str, host: str = "") -> str:
    """Write the graph, its kernels (loop-level IR) and the host program (``host``, the one
    that runs: max-autotune's pairs change it; else printed here) to ``directory/programs/``
    (the runtime writes the kernel sources beside them); the path."""
    folder = os.path.join(directory, "programs")
    os.makedirs(folder, exist_ok=True)
    listing = "\n\n".join(format_kernel(k) for k in program.kernels())
    wrapper = host or Wrapper(program, {}).source()
    path = os.path.join(folder, f"{graph.name}_{id(program):x}.txt")
    with open(path, "w") as file:
        file.write(f"# graph\n{graph}\n\n# kernels\n{listing}\n\n# host program\n{wrapper}")
    return path
