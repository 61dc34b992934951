"""How a graph is recorded and replayed (``cudagraphs.py`` decides when): CUDA graphs on the
GPU, through :class:`CudaRecorder`; CPU tests swap in an emulation of the :class:`Recorder`
protocol."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kiln.config import logger

_log = logger("cudagraphs")


class Recorder(Protocol):
    """Records a run of a function into a replayable graph: CUDA graphs on the GPU; tests
    emulate it on the CPU."""

    def supports(self, tensor: torch.Tensor) -> str | None:
        """None when ``tensor`` can be read by a recorded graph, else why not."""

    def new_pool(self) -> Any: ...

    def capture(
        self, run: Callable[[], list[torch.Tensor]], pool: Any
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        """Record ``run()``; return the replay function and the tensors the recording
        returned (static: every replay rewrites them)."""


class CudaRecorder:
    # the copied inputs' buffers may be made in a recording and freed there (their memory
    # reused by its later steps): replays keep the pool's blocks where the graph left them
    donates = hasattr(torch._C, "_construct_storage_from_data_pointer")

    def supports(self, tensor: torch.Tensor) -> str | None:
        if tensor.device.type != "cuda":
            return f"it reads a {tensor.device.type} tensor"
        return None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(
        self, run: Callable[[], list[torch.Tensor]], pool: Any
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        graph = torch.cuda.CUDAGraph()
        # cuBLAS keeps a workspace per handle and stream (32 MiB on Hopper): the warm-up's,
        # outside the pool, are dropped before recording, and the recording's own is left in
        # the pool as one of its temporaries (later recordings may reuse it), not kept aside
        _clear_cublas_workspaces()
        # thread_local: a backward records on autograd's device thread while the main thread
        # waits in the engine; another thread's CUDA calls must not invalidate the capture
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs = run()
        except Exception:
            _leave_capture_mode()
            raise
        finally:
            _clear_cublas_workspaces()
        return graph.replay, outputs


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # (a CUDA build)
        clear()


def _leave_capture_mode() -> None:
    """After a failed recording: a recording PyTorch begins and does not end leaves its CUDA
    generator in capture mode ("Offset increment outside graph capture" on the next eager
    random op). Recording an empty graph ends that mode."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("the CUDA graph is empty")
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
    except Exception as error:  # (nothing more to try: the next random op will say so)
        _log.warning("could not reset PyTorch's CUDA generator after a failed recording: %s", error)
