"""Whether reduce-overhead graphs that draw random numbers leave PyTorch's CUDA generator
usable: a dropout step (forward only, then forward and backward) compiled with
``mode="reduce-overhead"``, and an eager ``torch.randn`` on the GPU after each call.

    python benchmarks/cudagraph_rng_check.py
"""

from __future__ import annotations

import torch

import kiln


def dropout_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x, 0.5, training=True).sum()


def check(backward: bool) -> None:
    kiln.reset()
    compiled = kiln.compile(dropout_sum, mode="reduce-overhead")
    for call in range(5):
        x = torch.randn(64, device="cuda", requires_grad=backward)
        out = compiled(x)
        where = "forward"
        try:
            if backward:
                out.backward()
                where = "backward"
            torch.randn(1, device="cuda")
            print(f"backward={backward} call {call}: ok after the {where}", flush=True)
        except RuntimeError as error:
            print(f"backward={backward} call {call}: after the {where}: {error}", flush=True)
            raise
    print("\n".join(kiln.explain().cudagraphs))


if __name__ == "__main__":
    import gc

    check(backward=False)
    check(backward=True)
    kiln.reset()
    gc.collect()  # (the recorded graphs are destroyed)
    torch.randn(1, device="cuda")
    print("ok after the graphs were destroyed")
