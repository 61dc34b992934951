"""Does cuBLAS still need 16-bit matmuls padded to multiples of 8? Times GPT-2's LM head and its
gradients (bf16, ``[8192, 768] x [768, 50257]``) unpadded, with ``N``/``K`` zero-padded to a
multiple of 8 (the result a gapped view), and padded then copied out dense; and prints the
strides of the logits torch.compile returns for GPT-2 (``--inductor``).

    python benchmarks/matmul_alignment.py [--inductor]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kiln.bench.timing import median_seconds


def _padded(t: torch.Tensor, dim: int, multiple: int = 8) -> torch.Tensor:
    pad = -t.shape[dim] % multiple
    widths = [0, 0] * t.dim()
    widths[2 * (t.dim() - 1 - dim) + 1] = pad
    return F.pad(t, widths)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inductor", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    m, k, n = 8192, 768, 50257
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # nn.Linear's layout
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w_pad = _padded(w, 0)  # [50264, 768]
    g_pad = _padded(g, 1)  # [8192, 50264]
    cases = {
        "logits = x @ w.T, N=50257": lambda: x @ w.t(),
        "logits, N padded (gapped view)": lambda: (x @ w_pad.t())[:, :n],
        "logits, N padded, copied dense": lambda: (x @ w_pad.t())[:, :n].contiguous(),
        "grad x = g @ w, K=50257": lambda: g @ w,
        "grad x, K padded": lambda: g_pad @ w_pad,
        "grad w = g.T @ x, M=50257": lambda: g.t() @ x,
        "grad w, M padded (gapped view)": lambda: (g_pad.t() @ x)[:n],
    }
    reference = (x @ w_pad.t())[:, :n].float()
    error = ((x @ w.t()).float() - reference).abs().max().item()
    print(f"max |unpadded - padded| logits: {error:.3g}")
    print("| case | ms |\n| --- | --- |")
    for name, fn in cases.items():
        seconds, _ = median_seconds(lambda _, fn=fn: fn(), [None], torch.device("cuda"))
        print(f"| {name} | {seconds * 1e3:.3f} |", flush=True)
    if args.inductor:
        from kiln.bench.models import MODELS, primary_output

        spec = MODELS["gpt2"]
        workload = spec.build(spec.batch)
        model = workload.model.cuda().eval()
        tokens = workload.make_input(torch.Generator().manual_seed(0))[0].cuda()
        compiled = torch.compile(model)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = primary_output(compiled(tokens))
            eager = primary_output(model(tokens))
        print(
            f"GPT-2 logits: torch.compile {tuple(logits.shape)} strides {logits.stride()} "
            f"contiguous {logits.is_contiguous()}; eager strides {eager.stride()}"
        )


if __name__ == "__main__":
    main()
