"""Fused memory-bound kernels: eager, torch.compile and Kiln as a share of copy bandwidth.

Usage: python benchmarks/kernels.py [--device cuda|cpu] [--shape 16384x4096] [--dtype bfloat16]
A GPU benchmark; on a machine without a GPU it says so unless --device cpu asks for a small
run. See kiln/bench/kernels.py.
"""

import sys

from kiln.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
