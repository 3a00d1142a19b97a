#!/usr/bin/env bash
# One prepared GPU check of pacs.py, for a short loan of a GPU machine (docs/gpu.md: how to prepare and run it).
#
#   bash benchmarks/gpu_check.sh OUT                 # on the GPU machine: about 6 minutes on an H100, at most 8
#   bash benchmarks/gpu_check.sh OUT --device cpu    # the rehearsal on a CPU: the same steps at a tiny shape
#
# Reads .gpu/ (GPU_CHECK_DIR), which `python benchmarks/gpu_check.py prepare --wheels` fills beforehand: the wheels
# the machine lacks (installed into a private folder first, offline), Qwen2.5-0.5B-Instruct's config and tokenizer
# (a random-init stand-in of the exact shape is built from them) and MATH text for the prompts. Each step runs under
# its own `timeout` and writes its JSON into OUT; a step that fails or times out is recorded and the next one runs.
#   probe          versions, the card, SDPA's kernels on rows of padding, the allocator's settings
#   (a) psi_plain  psi at --lr 0 on prompts of varied length (left padding): psi_std must be exactly 0
#   (a) psi_ckpt   the same on the --gradient-checkpointing route
#   (b) step_default   the default step: time split, tokens/s, generate and update peaks against the plan
#   (c) step_22g   the same at --memory-gib 22.5 under a real allocator cap (a 24 GB card's limit), 64 prompts
#   (d) lab        the lab's step on the device against one CPU core, if time remains
# Then a summary table (OUT/summary.md). OUT ends up with 8 files: the 6 JSON, check.log (every step's output) and
# summary.md (a GPU loan brings back at most 8).
set -u
usage="usage: bash benchmarks/gpu_check.sh OUT_DIR [--device cuda|cpu]"
OUT=${1:?$usage}
DEVICE=cuda
if [ $# -ge 2 ]; then
    [ "$2" = "--device" ] && [ $# -eq 3 ] || { echo "$usage" >&2; exit 2; }
    DEVICE=$3
fi
case $DEVICE in cuda|cpu) ;; *) echo "$usage" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GPU_DIR=${GPU_CHECK_DIR:-$ROOT/.gpu}
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for every step together: the call's 8 minutes, less the summary
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/check.log
: > "$LOG"
[ -f "$GPU_DIR/model/config.json" ] || {
    echo "gpu_check.sh: error: no $GPU_DIR/model/config.json: run python benchmarks/gpu_check.py prepare --wheels" >&2
    exit 2; }
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
# on the CPU gpu_step.py reads peaks from the RSS with every block over 64 KiB mapped on its own (it would restart
# itself with these otherwise)
[ "$DEVICE" = cpu ] && export MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0

# the wheels, offline, into a private folder in front of the machine's own packages
if ls "$GPU_DIR"/wheels/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
        "$GPU_DIR"/wheels/*.whl >> "$LOG" 2>&1 ||
        { echo "gpu_check.sh: error: installing the wheels failed (check.log)" >&2; exit 1; }
    export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME SECONDS CMD...: CMD under `timeout`, at most SECONDS and what is left of BUDGET; its output to check.log
step() {
    local name=$1 limit=$2 left rc start
    shift 2
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s left of ${BUDGET}" | tee -a "$LOG"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    start=$SECONDS
    echo "== $name (timeout ${limit} s): $*" >> "$LOG"
    timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo ' (timed out)')" | tee -a "$LOG"
}

STANDIN=$SCRATCH/standin
STEP=(benchmarks/gpu_step.py --standin "$STANDIN" --data-dir "$GPU_DIR/data" --device "$DEVICE"
      --warmup-steps 0 --timed-steps 1)
# (a) puts several groups in a micro-batch: a group alone has no left padding (columns of padding in every row are
# trimmed), prompts of unequal length side by side have. (c) runs half the default's prompts: the plan for 22.5 GiB
# picks the same per-call shapes at 64 prompts as at 128 (64 prompts per generate call, 2 rows per micro-batch), so
# the peaks are the same, in half the time.
if [ "$DEVICE" = cuda ]; then
    TINY=()
    PSI=(--lr 0 --prompts-per-step 16 --micro-batch-size 32 --max-new-tokens 256 --varied-prompts 128
         --expect-psi-zero)
    DEFAULT=()  # pacs.py's defaults: 128 prompts x 8, M = 4, 512 + 1024 tokens
    SMALL_CARD=(--memory-gib 22.5 --prompts-per-step 64)
    LAB=(--steps 2 --warmup 1)
else  # the rehearsal: 2 small layers with the real vocabulary, a few rows and tokens
    TINY=(--tiny)
    PSI=(--lr 0 --prompts-per-step 4 --group-size 2 --num-mini-batches 2 --micro-batch-size 4 --max-prompt-tokens 96
         --max-new-tokens 4 --varied-prompts 60 --expect-psi-zero)
    DEFAULT=(--prompts-per-step 2 --group-size 2 --num-mini-batches 1 --max-prompt-tokens 64 --max-new-tokens 4)
    SMALL_CARD=("${DEFAULT[@]}" --memory-gib 22.5)
    LAB=(--steps 1 --warmup 0 --prompts 2 --group-size 2 --num-mini-batches 1 --max-new-tokens 4)
fi

cd "$ROOT" || exit 2
step probe 60 "$PY" benchmarks/gpu_check.py probe "$OUT/probe.json" --device "$DEVICE"
step build 90 "$PY" benchmarks/gpu_check.py build "$STANDIN" --model-dir "$GPU_DIR/model" "${TINY[@]}"
step psi_plain 75 "$PY" "${STEP[@]}" "${PSI[@]}" --json "$OUT/psi_plain.json"
step psi_ckpt 75 "$PY" "${STEP[@]}" "${PSI[@]}" --gradient-checkpointing --json "$OUT/psi_ckpt.json"
step step_default 170 "$PY" "${STEP[@]}" "${DEFAULT[@]}" --json "$OUT/step_default.json"
step step_22g 150 "$PY" "${STEP[@]}" "${SMALL_CARD[@]}" --json "$OUT/step_22g.json"
step lab 90 "$PY" benchmarks/gpu_check.py lab "$OUT/lab.json" --device "$DEVICE" "${LAB[@]}"
echo "== total ${SECONDS} s" | tee -a "$LOG"
"$PY" benchmarks/gpu_check.py summary "$OUT"
