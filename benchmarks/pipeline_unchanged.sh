#!/usr/bin/env bash
# Issue 25's check that consolidating the pipeline changed no behaviour on the GPU: the op
# table through compiled Triton kernels, then the reference models' inference step of a
# baseline checkout (benchmarks/_baseline/kiln, untracked: `git archive <commit> kiln | tar -x
# -C benchmarks/_baseline`) and of this checkout, interleaved model by model on one card.
# One model takes 2-3 minutes: pass two per device command, e.g. `... resnet50,gpt2`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/gpu_check.sh -q 2>&1 | tail -2
models="${1:-resnet50,vit_b_16,bert_base,gpt2}"
for model in ${models//,/ }; do
  for tree in baseline current; do
    if [ "$tree" = baseline ]; then dir=benchmarks/_baseline; else dir=.; fi
    echo "== $model $tree"
    (cd "$dir" && PYTHONPATH=. python -m kiln.bench --models "$model" --mode "${MODE:-infer}" \
      --compilers kiln --no-warm-start --budget 2 2>&1 | grep -E "^\| $model")
  done
done
