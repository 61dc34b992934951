#!/usr/bin/env bash
# Issue 24 on two GPUs, in one call: GPT-2 small under DDP and FSDP2, with eager, torch.compile
# and Kiln (the whole model; for FSDP2 also block by block, with both compilers), each run
# profiled for the communication hidden under compute; the table comes last. No network
# needed (torchrun --standalone rendezvous on localhost, NCCL between the two local GPUs).
# Extra arguments go to every run (e.g. --batch 4, or --device cpu --tiny --seq 64 --batch 2
# to try it on a CPU; NPROC=1 runs one process, with no communication). Logs and RESULT
# lines go to ${OUT:-.}; COMPILERS="eager kiln" and MODES=ddp run subsets (a device call is
# limited to 10 minutes: torch.compile's first call alone took 33 s); KEEP=1 appends to the
# results of earlier calls, so the table compares runs of several calls.
set -uo pipefail
cd "$(dirname "$0")/.."
# Kiln from this checkout. (torchrun puts benchmarks/ first on each rank's path, where
# kernels.py shadows the Hugging Face package of that name; it then needs kiln importable.)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-.}"
gpus="${NPROC:-2}"
results="$out/distributed_results.txt"
[ "${KEEP:-0}" = 1 ] || : > "$results"
run() {  # mode compiler scope
    local log="$out/distributed_$1_$2_$3.log"
    echo "=== $1 $2 $3" >&2
    timeout "${RUN_TIMEOUT:-400}" python -m torch.distributed.run --standalone \
        --nproc-per-node "$gpus" benchmarks/distributed.py --mode "$1" --compiler "$2" \
        --scope "$3" --profile "${@:4}" 2>&1 | tee "$log" | grep -E "^(step|\[rank|RESULT|timed)" >&2
    grep "^RESULT " "$log" >> "$results" || echo "($1 $2 $3 failed: see $log)" >&2
}
for mode in ${MODES:-ddp fsdp2}; do
    for compiler in ${COMPILERS:-eager torch kiln}; do
        run "$mode" "$compiler" whole "$@"
    done
done
case " ${MODES:-fsdp2} " in  # FSDP2's usual unit: each block compiled (and sharded) alone
    *" fsdp2 "*)
        for compiler in ${COMPILERS:-torch kiln}; do
            [ "$compiler" = eager ] || run fsdp2 "$compiler" blocks "$@"
        done ;;
esac
python benchmarks/distributed.py --table "$results"
