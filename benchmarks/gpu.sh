#!/usr/bin/env bash
# Every GPU benchmark of benchmarks/RESULTS.md, in one go, on one machine (absolute times drift
# between machines: compare only numbers from the same run). Results go to ${OUT:-.}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python -m kiln.bench --suite reference --mode infer --json "$out/bench_infer.json" | tee "$out/bench_infer.md"
python -m kiln.bench --suite reference --mode train --json "$out/bench_train.json" | tee "$out/bench_train.md"
python -m kiln.bench --suite reference --mode infer --compile-mode reduce-overhead \
    --models resnet50,bert_base --no-warm-start | tee "$out/bench_infer_reduce_overhead.md"
python benchmarks/kernels.py --json "$out/kernels.json" | tee "$out/kernels.md"
python benchmarks/overhead.py | tee "$out/overhead.md"
