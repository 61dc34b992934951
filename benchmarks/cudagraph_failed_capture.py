"""A recording that fails (here: a synchronization inside it) must leave PyTorch's CUDA
generator usable: ``CudaRecorder`` ends the capture mode PyTorch leaves behind.

    python benchmarks/cudagraph_failed_capture.py
"""

from __future__ import annotations

import torch

from kiln.runtime.cudagraphs import CudaRecorder


def failing() -> list[torch.Tensor]:
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()  # not allowed while capturing
    return [x]


if __name__ == "__main__":
    torch.randn(1, device="cuda")
    try:
        CudaRecorder().capture(failing, torch.cuda.graph_pool_handle())
        print("recording did not fail")
    except Exception as error:
        print("recording failed as expected:", str(error).splitlines()[0][:120])
    torch.randn(1, device="cuda")
    print("torch.randn on the GPU works after the failed recording")
