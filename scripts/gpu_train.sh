#!/usr/bin/env bash
# Drafter training on a lent GPU, within one 10-minute call: self-distillation data on CUDA, then EAGLE-3 (and,
# with time left, DSpark) for SmolLM2-135M; bf16 weights of at most 16 MB per file in OUTDIR.
#
#   scripts/gpu_train.sh OUTDIR [--smoke]
#
# Phases (each bounded by --max-minutes, so the call ends in time and a rerun resumes):
#   1. specloom data  --device cuda: the training prompts + Magpie conversations, 256 rows  (GPU_TRAIN_DATA_MIN, 3.5)
#   2. specloom train eagle3 --device cuda: warm start from the last target layer, TTT unroll 5, draft vocabulary
#      from 99 % answer-token coverage (at most 4096: the file stays under 16 MB), or from GPU_TRAIN_INIT with its
#      own vocabulary; the learning rate decays over the phase's minutes            (GPU_TRAIN_EAGLE_MIN, 3.5)
#   3. specloom train dspark --device cuda, if GPU_TRAIN_DSPARK_MIN > 0                     (default 1.5)
# Then every weight file is checked against the 16 MB limit and the held-out figures are printed. Bring OUTDIR
# back, measure the drafters on CPU (specloom bench) and bundle them only if they win.
#
# --smoke: tiny sizes, for a CPU check of the plumbing (tests/test_gpu_train.py runs it with a tiny target).
# Environment: PYTHON (default python), GPU_TRAIN_DEVICE (default cuda), GPU_TRAIN_TARGET (default smollm2-135m),
# GPU_TRAIN_PROMPTS (default ../shared/data/train next to the checkout), GPU_TRAIN_MAGPIE (Magpie conversations,
# default 60000; 0 for a target without a chat template), GPU_TRAIN_DATA (an existing `specloom data` folder, e.g.
# the committed datasets/smollm2-135m: phase 1 is skipped and the drafters train on it), GPU_TRAIN_INIT (EAGLE-3
# starts from this checkpoint instead of the target's last layer, e.g. the bundled one).
set -u
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [--smoke]" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
SMOKE=0
[ "${2:-}" = "--smoke" ] && SMOKE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python}
DEV=${GPU_TRAIN_DEVICE:-cuda}
TARGET=${GPU_TRAIN_TARGET:-smollm2-135m}
PROMPTS=${GPU_TRAIN_PROMPTS:-$ROOT/../shared/data/train}
MAGPIE=${GPU_TRAIN_MAGPIE:-60000}
LOG="$OUT/gpu_train.log"
export TQDM_DISABLE=1
: > "$LOG"
log() { echo "$*" | tee -a "$LOG"; }

if [ $SMOKE -eq 1 ]; then
    DATA_MIN=${GPU_TRAIN_DATA_MIN:-1}; EAGLE_MIN=${GPU_TRAIN_EAGLE_MIN:-1}; DSPARK_MIN=${GPU_TRAIN_DSPARK_MIN:-1}
    DATA_ARGS=(--max-new-tokens 8 --rows 8 --limit 16 --shard-tokens 200)
    MAGPIE=${GPU_TRAIN_MAGPIE:-0}
    TRAIN_ARGS=(--steps 4 --tokens-per-batch 256 --save-every 2 --eval-every 2 --warmup 1 --anneal-by-time)
    VOCAB=(--draft-vocab 64)
else
    DATA_MIN=${GPU_TRAIN_DATA_MIN:-3.5}; EAGLE_MIN=${GPU_TRAIN_EAGLE_MIN:-3.5}; DSPARK_MIN=${GPU_TRAIN_DSPARK_MIN:-1.5}
    DATA_ARGS=(--max-new-tokens 256 --rows 256)
    # the learning rate decays over each phase's minutes (a lent GPU's run ends by the clock, annealed)
    TRAIN_ARGS=(--epochs 4 --tokens-per-batch 16384 --save-every 50 --eval-every 100 --warmup 30 --anneal-by-time)
    VOCAB=(--draft-vocab 4096 --draft-vocab-coverage 0.99)
fi
FAILED=0
run() {  # run NAME COMMAND...
    local name=$1
    shift
    log "=== $name ($(date -u +%H:%M:%S)): $*"
    local t0=$SECONDS
    if "$@" >> "$LOG" 2>&1; then log "=== $name: ok in $((SECONDS - t0)) s"; else
        log "=== $name: FAILED (exit $?) in $((SECONDS - t0)) s"; FAILED=$((FAILED + 1)); fi
}
log "specloom gpu train, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null), device $DEV, target $TARGET"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >> "$LOG" 2>&1
if [ "$DEV" != cpu ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    log "CUDA is not available to this python's torch: nothing to do"
    exit 1
fi

DATA=${GPU_TRAIN_DATA:-}
if [ -z "$DATA" ]; then
    DATA="$OUT/data"
    run "data" "$PY" -m specloom data --target "$TARGET" --prompts "$PROMPTS" --magpie "$MAGPIE" --out "$DATA" \
        --device "$DEV" --max-minutes "$DATA_MIN" "${DATA_ARGS[@]}"
else
    log "=== data: $DATA (given; no generation)"
fi
if [ -n "${GPU_TRAIN_INIT:-}" ]; then
    START=(--init-from "$GPU_TRAIN_INIT" --ttt-steps 4 --lr 5e-4)
    VOCAB=()  # continuing a drafter keeps its own draft vocabulary: every head row carries over
else
    START=(--warm-start-layer -1 --ttt-steps 5 --lr 1e-3)
fi
run "train eagle3" "$PY" -m specloom train eagle3 --target "$TARGET" --data "$DATA" --out "$OUT/eagle3" \
    --device "$DEV" --max-minutes "$EAGLE_MIN" "${START[@]}" ${VOCAB[@]+"${VOCAB[@]}"} "${TRAIN_ARGS[@]}"
if [ "$DSPARK_MIN" != 0 ]; then
    run "train dspark" "$PY" -m specloom train dspark --target "$TARGET" --data "$DATA" --out "$OUT/dspark" \
        --device "$DEV" --max-minutes "$DSPARK_MIN" --lr 2e-3 "${TRAIN_ARGS[@]}"
fi

# every weight file within the bundle's limit; the held-out figures
"$PY" - "$OUT" >> "$LOG" 2>&1 <<'EOF' || { log "=== weight files: FAILED"; FAILED=$((FAILED + 1)); }
import glob, json, os, sys
out, bad = sys.argv[1], []
for fn in sorted(glob.glob(os.path.join(out, "*", "*.safetensors"))):
    if "/data/" in fn or "/datasets/" in fn:
        continue
    mb = os.path.getsize(fn) / 2**20
    print(f"{fn}: {mb:.1f} MB")
    if mb > 16:
        bad.append(fn)
for cfg in sorted(glob.glob(os.path.join(out, "*", "config.json"))):
    m = json.load(open(cfg)).get("specloom", {}).get("manifest", {})
    print(cfg, "held-out", m.get("held_out"), "steps", m.get("steps"), "answer tokens seen", m.get("answer_tokens_seen"))
prog = os.path.join(out, "data", "progress.json")
if os.path.isfile(prog):
    p = json.load(open(prog))
    print("data:", p["answer_tokens"], "answer tokens,", p["answer_tokens_per_s_this_run"], "answer tokens/s")
sys.exit(1 if bad else 0)
EOF
tail -n 12 "$LOG"
log "=== done: $FAILED failed phase(s); log $LOG"
exit $FAILED
