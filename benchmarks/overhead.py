"""Per-call overhead of a compiled call on a cache hit, and GPT-2's capture time.

Usage: python benchmarks/overhead.py [--device cpu|cuda] [--compilers torch,kiln] [--no-gpt2]
Runs on the GPU when there is one, else on the CPU. See kiln/bench/overhead.py.
"""

import sys

from kiln.bench.overhead import main

if __name__ == "__main__":
    sys.exit(main())
