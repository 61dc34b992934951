#!/usr/bin/env bash
# Issue 18's correctness suites on the GPU machine (Python 3.12, torch 2.11, Triton 3.6).
#   benchmarks/gpu_conformance.sh cpu   the real-programs suite, the capture tests and the sweep
#                                       regressions (CPU tensors: the 3.12 / torch 2.11 check)
#   benchmarks/gpu_conformance.sh zoo   the transformer zoo's training steps on CUDA tensors
#                                       (Triton kernels), against eager on the same card
#   benchmarks/gpu_conformance.sh oob   out-of-range gathers on CUDA: clamped, no memory fault
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. KILN_COMPILE_WORKERS=threads PYTHONUNBUFFERED=1
python -c "import torch, triton, sys; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
case "${1:-cpu}" in
  cpu) python -m pytest -q -n 14 -p no:cacheprovider tests/programs tests/capture \
         tests/ops/test_sweep_regressions.py "${@:2}" ;;
  zoo) KILN_TEST_DEVICE=cuda python -m pytest -q -n 4 -p no:cacheprovider \
         tests/models/test_transformer_zoo.py "${@:2}" ;;
  oob) python - <<'PY'
import torch, kiln, torch.nn.functional as F
x = torch.randn(64, 64, device="cuda")
index = torch.randint(0, 64, (64, 8), device="cuda")
index[3, 2], index[7, 0] = 64, -70  # (out of range for x[i] too, which wraps -64..-1)
clamped = torch.where((index >= 0) & (index < 64), index, 0)  # what the kernels read
for name, program in {
    "gather": lambda t, i: torch.gather(t, 1, i) * 2,
    "embedding": lambda t, i: F.embedding(i, t) + 1,
    "index": lambda t, i: t[i] * 3,
}.items():
    result = kiln.compile(program)(x, index)
    torch.cuda.synchronize()
    expected = program(x, clamped)
    print(name, "clamped as documented:", torch.equal(result, expected))
PY
  ;;
esac
