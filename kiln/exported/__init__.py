"""Export: a call's whole graph, its weights and input spec as one program that runs compiled
and saves to one file, loadable where the model's source is not (issue 22).

- :mod:`kiln.exported.tracing`: ``export`` (capture through ``kiln.trace``; ``dynamic_shapes``
  dims as symbols) and ``Dim``;
- :mod:`kiln.exported.program`: ``ExportedProgram`` (input checks, the pipeline, ``save``) and
  ``load``;
- :mod:`kiln.exported.graph_format`: a graph as JSON-able data and back;
- :mod:`kiln.exported.file`: the file (a zip with a version header; ``docs/export-format.md``)
  and seeding the kernel cache from it.
"""

from kiln.exported.file import ExportFileError
from kiln.exported.program import ExportedProgram, ExportError, load
from kiln.exported.tracing import Dim, export

__all__ = ["Dim", "ExportError", "ExportFileError", "ExportedProgram", "export", "load"]
