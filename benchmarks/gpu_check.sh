#!/usr/bin/env bash
# Correctness of the generated Triton kernels on the GPU: the whole op table compiled for
# CUDA (CI runs the same table through Triton's interpreter on CPU tensors).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
python -c "import torch, triton, sys; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
# 12 test processes: compile on threads, not 12 pools of worker processes
KILN_COMPILE_WORKERS=threads KILN_TEST_DEVICE=cuda python -m pytest -q -n 12 tests/backends/test_kiln_triton.py "$@"
# Modes (issue 20): the CUDA-graph runner's tests on real CUDA graphs, a failed recording
# leaving PyTorch's generator usable, random graphs replayed with fresh numbers
KILN_TEST_DEVICE=cuda python -m pytest -q tests/backends/test_cudagraphs.py
python benchmarks/cudagraph_failed_capture.py
python benchmarks/cudagraph_rng_check.py
# max-autotune: launch shapes measured on the GPU, and matmul templates against the library
python benchmarks/autotune_check.py
python benchmarks/matmul_templates.py
