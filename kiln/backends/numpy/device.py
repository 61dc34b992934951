"""The numpy backend's device: its memory (NumPy arrays), the transfers at a graph's boundary,
and the program that launches a graph's kernels in order.

A graph's tensor inputs move to the device once (``to_device``), every kernel reads and writes
arrays, and the outputs move back (``to_host``) to the device their types name. ``counters``
counts kernel launches and transfers, so a test can tell that the device did the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.backends.numpy.kernels import NumpyKernel, plan_kernels
from kiln.backends.numpy.spellings import NUMPY_DTYPES
from kiln.ir.graph import Graph, Value
from kiln.ir.types import TensorType
from kiln.recording import record


@dataclass
class DeviceCounters:
    """What the device did since the process started (or ``reset()``)."""

    programs: int = 0  # graphs compiled
    launches: int = 0  # kernels run
    to_device: int = 0  # tensors moved in
    to_host: int = 0  # arrays moved out

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


counters = DeviceCounters()


def to_device(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A tensor's data as a device array (no copy for a CPU tensor)."""
    counters.to_device += 1
    return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()


def to_host(array: Any, type_: TensorType) -> torch.Tensor:
    """A device array (or NumPy scalar) as a tensor of ``type_``: contiguous and writable,
    on the type's device."""
    counters.to_host += 1
    array = np.asarray(array, dtype=NUMPY_DTYPES[type_.dtype], order="C")
    if not array.flags.writeable:  # a broadcast view
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor if type_.device.type == "cpu" else tensor.to(type_.device)


@dataclass
class ProgramRecord:
    """An event for ``kiln.explain``'s kernel lines: the kernels one graph compiled to."""

    graph: str
    kernels: list[NumpyKernel] = field(default_factory=list)

    def kernel_lines(self) -> list[str]:
        return [f"{self.graph}: {kernel.line()}" for kernel in self.kernels]


class NumpyProgram:
    """A graph compiled to NumPy kernels; called like any compiled graph."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.kernels = plan_kernels(graph)
        self.returned = [*graph.outputs, *(new for _, new in graph.mutations)]
        read = {value for kernel in self.kernels for value in kernel.inputs}
        self.moved = [v in read or v in self.returned for v in graph.inputs]
        counters.programs += 1
        record(ProgramRecord(graph.name, self.kernels))

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[Value, Any] = {
            value: to_device(tensor)
            for value, tensor, moved in zip(self.graph.inputs, inputs, self.moved, strict=True)
            if moved
        }
        with np.errstate(all="ignore"):  # inf and NaN as PyTorch makes them, silently
            for kernel in self.kernels:
                counters.launches += 1
                results = kernel.function(*(env[value] for value in kernel.inputs))
                env.update(zip(kernel.outputs, results, strict=True))
        return [to_host(env[value], value.type) for value in self.returned]
