#!/usr/bin/env bash
# On the lent GPU machine: one call per run of the kit's plan (`python scripts/gpu/kit.py pack` wrote it here).
#
#   here:   python scripts/gpu/kit.py slim            (the tree that travels: 64.6 -> ~3 MiB)
#   device: run  command "bash scripts/gpu/remote.sh 1"  carry [".gpukit/run1"]   -> tests
#           run  command "bash scripts/gpu/remote.sh 2"  carry [".gpukit/run2"]   -> bench   (within 30 s of run 1)
#           run  command "bash scripts/gpu/remote.sh 3"  carry [".gpukit/run3"]   -> train
#   here:   python scripts/gpu/kit.py unslim
#
# Each call stashes its payload under /tmp/specloom-kit (kept while the machine is held), installs the wheels into
# /tmp/site, joins and verifies the GGUF once all its parts are there, then runs the job the plan gives that run,
# each step under its own timeout (the call stays under 8 minutes). Everything comes back under $OUT: run<N>.log
# and the job's JSON / weights (at most 8 files, 16 MiB each).
set -u
N=${1:?usage: remote.sh N}
O=${OUT:-/tmp/specloom-out}
mkdir -p "$O"
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG="$O/run$N.log"
{
    echo "specloom gpu kit: run $N, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$LOG" 2>&1
if ! "$PY" scripts/gpu/kit.py machine "$N" >> "$LOG" 2>&1; then
    tail -n 20 "$LOG"
    exit 3
fi
export PYTHONPATH=/tmp/site:$PWD
JOB=$("$PY" scripts/gpu/kit.py job "$N" 2>> "$LOG")
PROMPTS=/tmp/specloom-kit/prompts/spec_bench.jsonl
FAILED=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), at most $secs s): $*" >> "$LOG"
    local t0=$SECONDS
    timeout "$secs" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s" >> "$LOG"
    [ $rc -eq 0 ] || FAILED=$((FAILED + 1))
}
DEFAULT='{"method": "eagle3", "suffix_decoding": true}'
case "$JOB" in
tests)
    # every drafter kind greedy-identical to plain in fp32 on CUDA, alone and batched; sampling; the verifier's
    # distribution on the device (the file's CPU-only checks run in CI: left out here)
    step "tests/test_cuda.py -k on_device" 420 env SPECLOOM_TEST_DEVICE=cuda "$PY" -m pytest -q -rs \
        -p no:cacheprovider tests/test_cuda.py -k on_device
    ;;
bench)
    # plain and the README default against HF generate and HF prompt lookup on the same GPU, bf16, batch 1,
    # 26 Spec-Bench prompts (2 per category), 128 tokens; then serving at concurrency 1/8/32, speculation
    # off / fixed / load-aware (hf-assisted needs a smaller model with SmolLM2's tokenizer: there is none)
    step "bench: plain, eagle3+suffix, hf, hf-lookup" 240 "$PY" -m specloom bench smollm2-135m --device cuda \
        --prompts "$PROMPTS" --per-category 2 --max-tokens 128 --baseline plain,hf,hf-lookup \
        --speculative-config "$DEFAULT" --json "$O/bench.json"
    # the same without CUDA graphs (models/graphs.py, drafters/eagle/graphed.py): what the replayed passes buy
    step "bench: plain, eagle3+suffix, CUDA graphs off" 50 env SPECLOOM_CUDA_GRAPHS=0 "$PY" -m specloom bench \
        smollm2-135m --device cuda --prompts "$PROMPTS" --per-category 1 --max-tokens 64 --baseline plain \
        --speculative-config "$DEFAULT" --json "$O/bench_eager.json"
    step "bench-serve: 1/8/32 x off/fixed/load-aware" 150 "$PY" -m specloom bench-serve smollm2-135m --device cuda \
        --speculative-config "$DEFAULT" --concurrency 1 8 32 --modes off fixed load_aware --prompts "$PROMPTS" \
        --max-tokens 64 --requests-per-level 32 --json "$O/serve.json"
    ;;
train)
    # every bundled drafter (all on the machine by now), one prompt per category, before training
    step "bench: every bundled drafter (compare)" 75 "$PY" -m specloom bench smollm2-135m --device cuda \
        --prompts "$PROMPTS" --per-category 1 --max-tokens 128 --json "$O/drafters.json" --compare \
        '{"eagle3": {"method": "eagle3"}, "dspark": {"method": "dspark"}, "dflash": {"method": "dflash"}, "dflash2": {"method": "dflash2"}, "mtp": {"method": "mtp"}, "medusa": {"method": "medusa"}, "eagle": {"method": "eagle"}}'
    # EAGLE-3 (from the bundled one) and DSpark on the committed dataset, on the GPU; weights back <= 16 MiB each
    step "gpu_train.sh" 380 env PYTHON="$PY" GPU_TRAIN_DATA=datasets/smollm2-135m \
        GPU_TRAIN_INIT=specloom/bundled/smollm2-135m/eagle3 GPU_TRAIN_EAGLE_MIN=3.5 GPU_TRAIN_DSPARK_MIN=1.5 \
        bash scripts/gpu_train.sh /tmp/gpu_train
    for k in eagle3 dspark; do
        if [ -f /tmp/gpu_train/$k/model.safetensors ]; then
            mkdir -p "$O/$k" && cp /tmp/gpu_train/$k/model.safetensors /tmp/gpu_train/$k/config.json "$O/$k/"
        fi
    done
    ;;
"")
    echo "=== nothing to run on this call (the payload is stashed for a later run)" >> "$LOG"
    ;;
esac
echo "=== run $N ($JOB): $FAILED failed step(s)" >> "$LOG"
tail -n 60 "$LOG"
exit $FAILED
