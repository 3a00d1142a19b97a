#!/usr/bin/env bash
# One prepared GPU check of pacs.py, for a short loan of a GPU machine (docs/gpu-check.md: how to prepare, run it).
#
#   bash benchmarks/gpu_check.sh OUT                 # on the GPU machine: the steps below that fit 470 s
#   GPU_CHECK_STEPS="e2e_train e2e_resume e2e_eval" bash benchmarks/gpu_check.sh OUT   # those steps only
#   bash benchmarks/gpu_check.sh OUT --device cpu    # the rehearsal on a CPU: the same steps at a tiny shape
# GPU_CHECK_BUDGET: seconds for all steps (a step that would start with under 20 s left is skipped, and said).
#
# Reads .gpu/ (GPU_CHECK_DIR), which `python benchmarks/gpu_check.py prepare --wheels` fills beforehand: the wheels
# the machine lacks (installed into a private folder first, offline), Qwen2.5-0.5B-Instruct's config and tokenizer
# (a random-init stand-in of the exact shape is built from them), Qwen3-4B's config with the Qwen3 tokenizer
# (step_qwen3 builds that model on the card) and MATH text for the prompts. Each step runs under
# its own `timeout` and writes its JSON into OUT; a step that fails or times out is recorded and the next one runs.
#   probe          versions, the card, SDPA's kernels on rows of padding, the allocator's settings
#   step_default   the defaults at the default shape: time split, tokens/s, generate and update peaks vs the plan
#   step_opt       the same with every opt-in lever on (--static-cache flex --compile-head --compile-layers
#                  --sampler gumbel --defer-stop-check): against step_default, the ratio of each phase
#   psi_levers     psi at --lr 0 with every lever on (the opt-in ones too, but flex),
#                  prompts of varied length (left padding): psi_std exactly 0
#   psi_ckpt       psi at --lr 0 with every lever on, --gradient-checkpointing, against a frozen pi_ref
#                  (--ref-reset-every 2: the reference copy's forwards)
#   psi_lora       psi at --lr 0 with LoRA (rank 16, its B drawn at random, not peft's zeros) on the defaults (on
#                  CUDA the static cache compiles the decode step through peft's layers): psi_std exactly 0
#   step_qwen3     a Qwen3-4B stand-in built on the card from models/qwen3-4b's config (random weights, the build
#                  timed), v2's prompt with the real Qwen3 tokenizer, LoRA rank 16, 16 prompts of 1,024 tokens x 8,
#                  512 new tokens at --lr 0: time split, decode ms a token, the updates' share of the card, peaks
#                  vs the plan, and from them a step at 128 x 8 and 1,024 x 8 prompts of 1,024 + 8,192 tokens
#   step_off       the default step with every lever off (--pack-groups off --full-rows off --static-cache off
#                  --verify-workers 1): the baseline of the step's target (step_default and step_opt against it)
#   step_22g       the defaults at --memory-gib 22.5 under a real allocator cap (a 24 GB card's limit)
#   step_22g_ckpt  the same with --gradient-checkpointing, where the plan takes 16 rows of full rows, not 2
#   e2e_train, e2e_resume, e2e_eval   the README's commands end to end: 2 steps with a held-out eval and a
#                  checkpoint each, a resumed step, eval.py on the checkpoint (each under its own time limit)
#   forms          one mini-batch's update in each form (benchmarks/update_forms.py): --compile-layers' and
#                  --compile-head's own ratios (layersc-32 against full-32, headc-8 against head-8)
#   attn           one decode step's attention and sampling at 1,024 rows in each form (decode_attention.py)
#   step_flex      the default step with --static-cache flex (the decode attention reads the cache's filled blocks
#                  only): against step_default, generate's ratio
#   step_defer     the default step with --defer-stop-check (generate reads its stop a step late): against
#                  step_default, generate's ratio
#   step_dynamic   the default step with the dynamic KV cache and the verifier in this process (--static-cache off
#                  --verify-workers 1): against step_default, generate's and the verifier's ratios
#   decode         ms a decode step at 1,024 rows, the dynamic cache and the static one (compiled), with profiles
#   step_shared    the default step with one group per micro-batch and the shared prompt (--pack-groups off
#                  --full-rows off)
#   profile        torch.profiler over a smaller default step's verify, old log-probs and updates
# They run in this order: what the targets and exactness need first, then LoRA's psi and the Qwen3-4B stand-in, then
# the README's commands, then each lever alone and what earlier calls measured. A call runs those that fit its budget
# (the default: 470 s, a call of 8 minutes) and names the others as skipped (or timed out, where the budget cut a
# step's limit), for the next call to ask for by name (GPU_CHECK_STEPS).
# With CUDA --pack-groups, --full-rows, --static-cache and --verify-workers are on by default: step_shared and
# step_dynamic against step_default give their ratios, phase by phase, on one card in one call. The opt-in levers
# (--static-cache flex, --compile-head, --compile-layers, --sampler gumbel, --defer-stop-check): step_opt against
# step_default all together; each alone: step_flex, step_defer, forms (the compiled head and layers) and attn (the
# sampler), each read against the 1.10x bar a lever must pass to stay (the summary's verdicts). Then OUT/summary.md (a
# table with a verdict per check: a missing or nonzero psi, a peak over its plan or a failed command reads FAIL; a row
# per target: met, short or not measured) and OUT/results.json (every step's JSON in one file: a GPU loan brings back
# at most 8 files).
set -u
usage="usage: bash benchmarks/gpu_check.sh OUT_DIR [--device cuda|cpu]"
OUT=${1:?$usage}
DEVICE=cuda
if [ $# -ge 2 ]; then
    [ "$2" = "--device" ] && [ $# -eq 3 ] || { echo "$usage" >&2; exit 2; }
    DEVICE=$3
fi
case $DEVICE in cuda|cpu) ;; *) echo "$usage" >&2; exit 2 ;; esac
[ "$DEVICE" = cpu ] && BUDGET_DEFAULT=1200 || BUDGET_DEFAULT=470  # the rehearsal: a busy 2-core CPU takes 5 minutes
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GPU_DIR=${GPU_CHECK_DIR:-$ROOT/.gpu}
BUDGET=${GPU_CHECK_BUDGET:-$BUDGET_DEFAULT}  # seconds for every step together: on a GPU the call's 8 minutes
ONLY=${GPU_CHECK_STEPS:-}  # the steps to run, by name (default: all; build runs whenever): a second call's share
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

# the wheels (transformers, peft), offline, into a private folder in front of the machine's own packages
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
    if [ -n "$ONLY" ] && [ "$name" != build ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "== $name: skipped, not in GPU_CHECK_STEPS" | tee -a "$LOG"
        return
    fi
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

# after_train NAME SECONDS CMD...: step, where this call's e2e_train left a checkpoint (a resume of nothing would run
# from step 0 and exit 0); a second call that asks for e2e_resume or e2e_eval asks for e2e_train too
after_train() {
    if ls -d "$E2E"/run/checkpoint-* > /dev/null 2>&1 || { [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]]; }; then
        step "$@"
    else
        echo "== $1: skipped, no checkpoint of e2e_train in this call" | tee -a "$LOG"
    fi
}

STANDIN=$SCRATCH/standin
STEP=(benchmarks/gpu_step.py --standin "$STANDIN" --data-dir "$GPU_DIR/data" --device "$DEVICE"
      --warmup-steps 0 --timed-steps 1)
# every lever, on the CPU too
LEVERS=(--verify-workers 0 --static-cache on --pack-groups on --full-rows on --compile-head --compile-layers
        --sampler gumbel --defer-stop-check)
OPT_IN=(--static-cache flex --compile-head --compile-layers --sampler gumbel --defer-stop-check)  # not yet defaults
SHARED=(--pack-groups off --full-rows off)
DYNAMIC=(--static-cache off --verify-workers 1)
OFF=("${SHARED[@]}" "${DYNAMIC[@]}")  # every lever off: pacs.py's defaults before the levers, the targets' baseline
LORA=(--lora-rank 16 --random-adapter)  # an adapter that adds something: psi = 0 at --lr 0 can fail
E2E=$SCRATCH/e2e
if [ "$DEVICE" = cuda ]; then
    TINY=()
    DEFAULT=()  # pacs.py's defaults: 128 prompts x 8, M = 4, 512 + 1024 tokens
    PSI=(--lr 0 --prompts-per-step 16 --max-new-tokens 256 --varied-prompts 128 --expect-psi-zero)
    PROFILE=(--prompts-per-step 32)
    SMALL_CARD=(--memory-gib 22.5 --prompts-per-step 64)
    TRAIN=(--prompts-per-step 16 --eval-size 32 --max-new-tokens 512)
    EVAL=(--limit 32 --n 4 --k 1,2,4 --max-new-tokens 512)
    FORMS=(--forms full-32,layersc-32,head-8,headc-8 --repeats 2)
    DECODE=(--decode-rows 1024)
    ATTN=()
    AUTO=()  # the auto levers as CUDA has them: on
    QWEN3=(--prompt v2 --lr 0 --prompts-per-step 16 --max-prompt-tokens 1024 --max-new-tokens 512)
else  # the rehearsal: 2 small layers with the real vocabulary, a few rows and tokens
    TINY=(--tiny)
    DEFAULT=(--prompts-per-step 2 --group-size 2 --num-mini-batches 1 --max-prompt-tokens 64 --max-new-tokens 4)
    PSI=(--lr 0 --prompts-per-step 4 --group-size 2 --num-mini-batches 2 --max-prompt-tokens 96 --max-new-tokens 4
         --varied-prompts 60 --expect-psi-zero)
    PROFILE=("${DEFAULT[@]}")
    SMALL_CARD=("${DEFAULT[@]}" --memory-gib 22.5)
    TRAIN=(--prompts-per-step 2 --group-size 2 --num-mini-batches 1 --eval-size 2 --max-new-tokens 4)
    EVAL=(--limit 2 --n 2 --k 1,2 --max-new-tokens 4)
    FORMS=(--tiny --forms full-4,layersc-4,head-4,headc-4 --repeats 1 --rows 4 --group-size 2
           --max-prompt-tokens 64 --max-new-tokens 4)
    DECODE=(--tiny --decode-rows 4 --decode-tokens 4 --group-size 2 --max-prompt-tokens 64 --max-new-tokens 4)
    ATTN=(--rows 8 --cache 384 --filled 200 --vocab 4096 --iters 3)
    AUTO=(--static-cache on --pack-groups on --full-rows on --verify-workers 0)  # CUDA's auto levers, by name
    QWEN3=(--tiny --prompt v2 --lr 0 --prompts-per-step 2 --group-size 2 --num-mini-batches 2 --max-prompt-tokens 64
           --max-new-tokens 4)
fi
# the README's train command, on the stand-in and the prepared MATH text, with an eval and a checkpoint every step
README_TRAIN=(pacs.py --model "$STANDIN" --dataset math --data-dir "$GPU_DIR/data" --device "$DEVICE" "${TRAIN[@]}"
              --eval-every 1 --save-every 1 --out-dir "$E2E/run")

cd "$ROOT" || exit 2
step probe 60 "$PY" benchmarks/gpu_check.py probe "$OUT/probe.json" --device "$DEVICE"
step build 90 "$PY" benchmarks/gpu_check.py build "$STANDIN" --model-dir "$GPU_DIR/model" "${TINY[@]}"
step step_default 200 "$PY" "${STEP[@]}" "${DEFAULT[@]}" --json "$OUT/step_default.json"
step step_opt 230 "$PY" "${STEP[@]}" "${DEFAULT[@]}" "${OPT_IN[@]}" --json "$OUT/step_opt.json"
step psi_levers 150 "$PY" "${STEP[@]}" "${PSI[@]}" "${LEVERS[@]}" --json "$OUT/psi_levers.json"
step psi_ckpt 150 "$PY" "${STEP[@]}" "${PSI[@]}" "${LEVERS[@]}" --gradient-checkpointing --ref-reset-every 2 \
    --json "$OUT/psi_ckpt.json"
step psi_lora 150 "$PY" "${STEP[@]}" "${PSI[@]}" "${AUTO[@]}" "${LORA[@]}" --json "$OUT/psi_lora.json"
step step_qwen3 240 "$PY" benchmarks/gpu_step.py --random-init "$GPU_DIR/qwen3-4b" --data-dir "$GPU_DIR/data" \
    --device "$DEVICE" --warmup-steps 0 --timed-steps 1 "${QWEN3[@]}" "${AUTO[@]}" "${LORA[@]}" --extrapolate \
    --json "$OUT/step_qwen3.json"
step step_off 200 "$PY" "${STEP[@]}" "${DEFAULT[@]}" "${OFF[@]}" --json "$OUT/step_off.json"
step step_22g 150 "$PY" "${STEP[@]}" "${SMALL_CARD[@]}" --json "$OUT/step_22g.json"
step step_22g_ckpt 150 "$PY" "${STEP[@]}" "${SMALL_CARD[@]}" --gradient-checkpointing --json "$OUT/step_22g_ckpt.json"
step e2e_train 110 "$PY" "${README_TRAIN[@]}" --steps 2
after_train e2e_resume 80 "$PY" "${README_TRAIN[@]}" --steps 3 --resume
cp "$E2E/run/metrics.jsonl" "$OUT/e2e_metrics.jsonl" 2>/dev/null
after_train e2e_eval 60 "$PY" eval.py --model "$(ls -d "$E2E"/run/checkpoint-* 2>/dev/null | tail -1)" \
    --datasets math500 --data-dir "$GPU_DIR/data" --device "$DEVICE" "${EVAL[@]}" --out "$E2E/eval"
cp "$E2E/eval/metrics.json" "$OUT/e2e_eval.json" 2>/dev/null
step forms 150 "$PY" benchmarks/update_forms.py --standin "$STANDIN" --data-dir "$GPU_DIR/data" --device "$DEVICE" \
    "${FORMS[@]}" --decode-tokens 0 --json "$OUT/forms.json"
step attn 90 "$PY" benchmarks/decode_attention.py --device "$DEVICE" "${ATTN[@]}" --json "$OUT/attn.json"
step step_flex 200 "$PY" "${STEP[@]}" "${DEFAULT[@]}" --static-cache flex --json "$OUT/step_flex.json"
step step_defer 200 "$PY" "${STEP[@]}" "${DEFAULT[@]}" --defer-stop-check --json "$OUT/step_defer.json"
step step_dynamic 170 "$PY" "${STEP[@]}" "${DEFAULT[@]}" "${DYNAMIC[@]}" --json "$OUT/step_dynamic.json"
step decode 150 "$PY" benchmarks/update_forms.py --standin "$STANDIN" --data-dir "$GPU_DIR/data" --device "$DEVICE" \
    --forms "" "${DECODE[@]}" --json "$OUT/decode.json"
step step_shared 170 "$PY" "${STEP[@]}" "${DEFAULT[@]}" "${SHARED[@]}" --json "$OUT/step_shared.json"
step profile 70 "$PY" "${STEP[@]}" "${PROFILE[@]}" --profile "$OUT/profile.json" --json "$OUT/step_profiled.json"
echo "== total ${SECONDS} s" | tee -a "$LOG"
"$PY" benchmarks/gpu_check.py summary "$OUT"
