#!/usr/bin/env bash
# Issue 70's trainings, one after another, on one base (SmolLM2-135M), one data set (the arithmetic task's 3,000
# train problems, as the Jacobi Forcing arithmetic preset) and one budget: SBD with its SFT start and an NTP control,
# MultiTF from the SBD preset, SetDLM from the same SFT adapter and the same own answers. Each command resumes
# from its work folder: rerun this script after a stop. Then `python benchmarks/seed_methods.py` compares them.
#
#   bash benchmarks/seed_methods_train.sh            # about 14 h on 2 AVX2 cores (the SBD recipe ≈ 7 h, its SBD stage ≈ 4.5 h)
#
# Rows of 256 tokens, 16 a step (the recipes' default is 8 x 512, the same tokens): the dual-stream objectives
# attend over twice a row, and on 2 AVX2 cores SBD trained 1.15x faster per token at 256 than at 512
# (`python benchmarks/train_speed.py --objectives sbd ntp --contenders float32+lora --seq-len 512 256 --batch-size 2
# --rounds 2`: 165 against 143 tokens/s, NTP 204 against 187; load 1.0-1.9). The arithmetic examples are ~85 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
FF=${FF:-.venv/bin/fastforward}
RUNS=${RUNS:-runs}
TASK=(--task arithmetic --problems 3000 --task-option min_ops=2 --task-option max_ops=3 --task-option max_number=20
      --task-option max_factor=5 --threads 2 --seq-len 256 --batch-size 16)
# SFT for 100 steps (the JF arithmetic preset's), the rest of 3M read tokens for SBD
$FF recipe sbd "${TASK[@]}" --work "$RUNS/sbd-arith" --budget 3M --sft-share 0.137 --curve 6 --control \
  --ship-to "$RUNS/smollm2-135m-sbd-arithmetic"
$FF recipe multitf "${TASK[@]}" --work "$RUNS/mtf-arith" --start "$RUNS/smollm2-135m-sbd-arithmetic" --budget 1M \
  --curve 4 --ship-to "$RUNS/smollm2-135m-multitf-arithmetic"
# the same start and the same targets as SBD: its SFT adapter and the SFT model's own answers
if [ ! -d "$RUNS/setdlm-arith/sft" ]; then
  mkdir -p "$RUNS/setdlm-arith"
  cp -r "$RUNS/sbd-arith/sft" "$RUNS/setdlm-arith/sft"
  cp "$RUNS/sbd-arith/answers.jsonl" "$RUNS/setdlm-arith/"
fi
$FF recipe setdlm "${TASK[@]}" --work "$RUNS/setdlm-arith" --budget 3M --sft-share 0.137 --curve 6 \
  --ship-to "$RUNS/smollm2-135m-setdlm-arithmetic"
