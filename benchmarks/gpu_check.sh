#!/bin/bash
# The GPU measurements of benchmarks/README.md ("On a GPU"), bounded in time.
#
# For a GPU lent for minutes: the yardstick, bench_step with the fully
# sharded rows (the 85.6M GPT and the MLP of issue 19), then the test files
# in the order given, each under what is left of the budget, so that a
# lease that runs out still returns everything measured so far. Two ranks
# share the GPU over ring (NCCL needs one GPU per rank). Every output goes
# to OUT_DIR as it is written: env.txt, yard.txt, step.txt (+ .md tables),
# planner.txt (RECORD=1, PLANNER=1), acts.txt, suite.txt: eight files (a lent
# machine returns at most eight).
#
# usage: bash benchmarks/gpu_check.sh OUT_DIR SECONDS YARDSTICK [TEST_FILE ...]
#   YARDSTICK: path of shared/gpu/yardstick.py (copy it into the checkout
#   if the machine gets only the checkout); "-" skips it.
#   TEST_FILE: names under tests/, e.g. test_fully_shard.py; none runs no tests.
#   SMALL=1 shrinks every model (a dry run on the CPU).
#   BENCH=0 skips bench_step (a rerun of test files alone).
#   PLANNER=1 also runs, alone after bench_step, the fully sharded planner
#   grid that measured above the plan on an H100 beside seven other
#   processes (MPI N=3, bfloat16; docs/memory-planner.md, "Left undone").
#   RECORD=1 also runs, alone after bench_step, bench_plan_memory's default
#   grid (DDP and FSDP, eager) and appends its table and records to
#   planner.txt: `grep '^{' planner.txt > gpu.jsonl` gives the lines for
#   benchmarks/records/plan_memory.jsonl (116 s on an H200, 2026-12-01).
#   ACTS=1 also runs, alone after that, the planner's activations against
#   mlx-lm's Llama (acts.txt): bench_activations.py in one process on the
#   fitted shape and a wider, deeper one, then fully sharded Llama steps
#   (ring N=2) planned with them. It needs mlx_lm.models importable: the
#   lent machine has no transformers, which `import mlx_lm` pulls in, so
#   give LM_PATH, a folder holding mlx_lm/ with mlx-lm's models/ and
#   _version.py only and an __init__.py importing __version__.
#   JOBS=K runs up to K test files at once (16 cores, one GPU: the tests
#   are small, and the lease is short); each file's output lands whole.
set -u
out=$1; budget=$2; yard=$3; shift 3
mkdir -p "$out"
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
port=$((RANDOM + 20000))
left() { echo $((budget - SECONDS)); }
ranks() {  # ranks SECONDS SCRIPT ARGS...: two ring ranks, at most SECONDS
    local t=$1; shift
    port=$((port + 50))
    timeout "$t" python3 "$here/ring_local.py" -n 2 --starting-port "$port" -- python3 "$@"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info())'
} | tee "$out/env.txt"

if [ "${SMALL:-0}" = 1 ]; then
    yard_args="--dims 64 --layers 2 --heads 2 --seq 16 --batch 2 --steps 2"
    gpt="--dims 64 --layers 2 --heads 2 --seq-len 16 --batch 2 --steps 2 --warmup 1 --block 1"
    mlp="--hidden 128 --batch 8 --steps 2 --block 1"
else
    yard_args=""
    gpt="--dims 768 --layers 12 --heads 12 --seq-len 256 --batch 16 --steps 6 --warmup 2 --block 3"
    mlp="--hidden 2048 --batch 8 --steps 10 --block 5"
fi
fully="--communication-size default --dtype float32 --modes fsdp ddp fully_shard ddp_checkpoint"
fully="$fully --wrap root blocks reshard"

if [ "$yard" != - ]; then
    echo "== yardstick, defaults" | tee "$out/yard.txt"
    ranks 130 "$yard" $yard_args 2>&1 | tee -a "$out/yard.txt"
    echo "== yardstick, 3.3M GPT" | tee -a "$out/yard.txt"
    ranks 45 "$yard" --dims 256 --layers 4 --heads 4 --seq 32 --batch 4 --steps 20 2>&1 \
        | tee -a "$out/yard.txt"
fi
if [ "${BENCH:-1}" != 0 ]; then
    echo "== bench_step, GPT" | tee "$out/step.txt"
    ranks 170 "$here/bench_step.py" --model gpt $gpt $fully --markdown "$out/step_gpt.md" 2>&1 \
        | tee -a "$out/step.txt"
    echo "== bench_step, MLP" | tee -a "$out/step.txt"
    ranks 75 "$here/bench_step.py" $mlp $fully --markdown "$out/step_mlp.md" 2>&1 \
        | tee -a "$out/step.txt"
fi

if [ "${RECORD:-0}" = 1 ]; then
    echo "== bench_plan_memory, default grid, recorded" | tee -a "$out/planner.txt"
    small_grid=""
    [ "${SMALL:-0}" = 1 ] && small_grid="--hidden 64 --dims 32 --optimizers sgd adamw"
    ranks 150 "$here/bench_plan_memory.py" --repeat 5 --record "$out/records.tmp" $small_grid \
        2>&1 | grep -v '^  \[' | tee -a "$out/planner.txt"
    cat "$out/records.tmp" >> "$out/planner.txt" 2>/dev/null; rm -f "$out/records.tmp"
fi
if [ "${PLANNER:-0}" = 1 ]; then
    echo "== bench_plan_memory, fully sharded, MPI N=3" | tee -a "$out/planner.txt"
    MLX_MPI_LIBNAME=${MLX_MPI_LIBNAME:-libmpi.so.40} timeout 150 mpirun --allow-run-as-root \
        --oversubscribe -x MLX_MPI_LIBNAME -x PYTHONPATH -n 3 python3 "$here/bench_plan_memory.py" \
        --hidden 256 --dtype bfloat16 --modes fully_shard --optimizers adamw adafactor \
        --reshard-after-forward off on --repeat 10 2>&1 | tee -a "$out/planner.txt"
fi

if [ "${ACTS:-0}" = 1 ]; then
    if [ "${SMALL:-0}" = 1 ]; then
        shapes=("--layers 2 --dims 64 --ffn 176 --vocab 256 --sizes 1x32 2x16")
        steps=("64 2 2 32 float32")
    else
        shapes=("--layers 4 --dims 256 --ffn 704 --vocab 256 --sizes 1x128 4x128 8x128 16x64 2x512 1x1024"
                "--layers 8 --dims 1024 --ffn 2816 --vocab 1024 --heads 8 --sizes 1x512 4x512 1x2048")
        steps=("256 4 8 128 float32" "256 4 2 512 float32" "128 8 8 128 bfloat16" "384 2 4 256 float32"
               "1024 8 2 512 float32")
    fi
    (export PYTHONPATH=${LM_PATH:+$LM_PATH:}${PYTHONPATH:-}
     for shape in "${shapes[@]}"; do
         echo "== bench_activations.py $shape --checkpoint off remat"
         timeout 60 python3 "$here/bench_activations.py" $shape --checkpoint off remat 2>&1 | tail -n 20
     done
     for spec in "${steps[@]}"; do
         read -r d l b s t <<< "$spec"
         echo "== fully sharded Llama, dims $d, $l layers, batch ${b}x$s, $t, ring N=2"
         ranks 70 "$here/bench_plan_memory.py" --models llama --dims "$d" --gpt-layers "$l" \
             --modes fully_shard --reshard-after-forward off on --optimizers sgd adamw muon \
             --batch-size "$b" --seq-len "$s" --dtype "$t" --repeat 5 2>&1 | grep '^[|Np]'
     done) > "$out/acts.txt"
fi

# The harness turns TF32 off for every rank; here too, for the test process.
export MLX_ENABLE_TF32=0
: > "$out/suite.txt"
logs=$(mktemp -d)
one_file() {  # one_file FILE SECONDS: what failed and its last lines, appended whole
    # Verbose, so that a file cut off by its time still names each test that
    # failed before (2026-12-01: seventeen failures of a cut file, unnamed).
    local f=$1 t=$2 log="$logs/$1.txt"
    timeout "$t" python3 -m pytest -v --tb=short -p no:cacheprovider -rfE "$here/../tests/$f" \
        > "$log.full" 2>&1
    { echo "== $f (${t}s left, rc $?): $(grep -c ' PASSED' "$log.full") passed so far"
      grep -v -E ' (PASSED|SKIPPED|XFAIL|XPASS) |^(platform|rootdir|configfile|plugins|collecting)\b' \
          "$log.full" | tail -n 80; } > "$log"
    cat "$log" >> "$out/suite.txt"
}
for f in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-1}" ]; do sleep 1; done
    t=$(( $(left) - 3 ))
    if [ "$t" -lt 10 ]; then echo "== $f: no time left" | tee -a "$out/suite.txt"; continue; fi
    one_file "$f" "$t" &
done
wait
cat "$out/suite.txt"
