#!/usr/bin/env bash
# The modes issue's rows (reduce-overhead; torch.compile in the same run), one `kiln bench`
# invocation per model so that a call cut off by the device tool's time limit keeps the rows
# it finished (one invocation for six training rows ran past 600 s and printed nothing).
#
#   MODE=train MODELS="resnet50 bert_base_128" OUT=/tmp/out bash benchmarks/modes_rows.sh
#
# Defaults: MODE=train, the overhead suite and the reference suite's other models. Each row's
# table goes to $OUT/modes_$MODE.md, the progress lines (first calls, errors) to
# $OUT/modes_$MODE.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mode="${MODE:-train}"
models="${MODELS:-resnet50 bert_base_128 gpt2_32 vit_b_16 bert_base gpt2}"
for model in $models; do
    python -m kiln.bench --device cuda --models "$model" --mode "$mode" \
        --compile-mode reduce-overhead --no-warm-start --budget 1 \
        >> "$out/modes_$mode.md" 2> "$out/modes_stderr.txt"
    grep "first call\|rror\|failed" "$out/modes_stderr.txt" | cut -c1-300 >> "$out/modes_$mode.log"
done
rm -f "$out/modes_stderr.txt"
