#!/usr/bin/env bash
# Does a real pretrained model learn a real task here? Held-out greedy accuracy of SmolLM2-135M-Instruct
# on builtin:gsm8k_synth_test (word problems in GSM8K's format, disjoint from the training split)
# before and after GRPO training with the smollm2-135m-grpo-cpu preset, and the paired gain with its
# 95% interval. Everything lands in $OUT_DIR (default outputs/real_model_learning):
#   before.json / after.json (per-prompt results), gain.json, train.log, checkpoints/.
# Usage: bash scripts/real_model_learning.sh [extra dotted overrides for rlhf train]
#   STEPS=30 HELDOUT_PROMPTS=400 OUT_DIR=... bash scripts/real_model_learning.sh
# An existing $OUT_DIR/before.json is reused (the base model does not change).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/env.sh
OUT=${OUT_DIR:-outputs/real_model_learning}
STEPS=${STEPS:-54}
PROMPTS=${HELDOUT_PROMPTS:-1000}
PRESET=smollm2-135m-grpo-cpu
mkdir -p "$OUT"
eval_args=(--data builtin:gsm8k_synth_test --reward-fn gsm8k_flexible --max-prompts "$PROMPTS"
  --max-new-tokens 96 --max-prompt-length 160 --engine vllm)
# The eval engine may use both cores; the training ranks set their own threads (resources.num_cpus_per_worker).
export OMP_NUM_THREADS=2
if [ -s "$OUT/before.json" ]; then
  echo "== held-out accuracy before training: reusing $OUT/before.json"
else
  echo "== held-out accuracy before training ($PROMPTS prompts, greedy)"
  .venv/bin/rlhf eval model builtin:smollm2-135m-instruct "${eval_args[@]}" --out "$OUT/before.json" 2>"$OUT/eval_before.log"
fi
echo "== training: $PRESET, $STEPS steps (log: $OUT/train.log)"
start=$(date +%s)
.venv/bin/rlhf train --preset "$PRESET" trainer.total_training_steps="$STEPS" \
  trainer.save_freq="$STEPS" trainer.checkpoint_root="$OUT/checkpoints" trainer.run_name=learning \
  trainer.resume_mode=disable "$@" >"$OUT/train.log" 2>&1
train_s=$(( $(date +%s) - start ))
echo "   trained $STEPS steps in ${train_s} s"
echo "$train_s" >"$OUT/train_seconds.txt"
ckpt="$OUT/checkpoints/$PRESET/learning/global_step_$STEPS"
echo "== held-out accuracy after training"
.venv/bin/rlhf eval model "$ckpt/hf" "${eval_args[@]}" --out "$OUT/after.json" 2>"$OUT/eval_after.log"
.venv/bin/rlhf eval gain "$OUT/before.json" "$OUT/after.json" --out "$OUT/gain.json"
