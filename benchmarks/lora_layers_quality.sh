#!/usr/bin/env bash
# Issue 80, item 2: does LoRA on the top 10 of SmolLM2-135M's 30 layers (`--lora-layers 10`) learn as much as
# every layer at an equal token budget? The Jacobi Forcing and SBD recipes on the arithmetic task (seed 0, the
# same dev split), each method's stage 300k read tokens from one shared SFT start (100k tokens, every layer),
# on the records' worked solutions (--targets reference: no generation), every layer against the top 10.
# Each recipe measures its dev split as it always does (int4 --exact, batch 1, greedy); then
# `python benchmarks/lora_layers_quality.py` prints the table. Each command resumes from its work folder.
#
#   bash benchmarks/lora_layers_quality.sh     # about 80 min on the 2-core EPYC with AVX-512 BF16 (bf16 autocast)
set -euo pipefail
cd "$(dirname "$0")/.."
FF=${FF:-.venv/bin/fastforward}
RUNS=${RUNS:-runs/lora-layers}
TASK=(--task arithmetic --problems 3000 --task-option min_ops=2 --task-option max_ops=3 --task-option max_number=20
      --task-option max_factor=5 --threads 2 --seq-len 256 --batch-size 16 --targets reference --budget 400k
      --sft-share 0.25 --dev 60 --curve 1 --curve-n 4)
for method in jacobi-forcing sbd; do
  for layers in 0 10; do
    work="$RUNS/$method-layers$layers"
    if [ ! -d "$work/sft" ] && [ -d "$RUNS/sft" ]; then  # the one shared SFT start
      mkdir -p "$work" && cp -r "$RUNS/sft" "$work/sft"
    fi
    extra=()
    [ "$method" = jacobi-forcing ] && extra=(--blocks 16)
    [ "$method" = sbd ] && extra=(--blocks 16 --max-block 16)
    $FF recipe "$method" "${TASK[@]}" "${extra[@]}" --lora-layers "$layers" --work "$work"
    [ -d "$RUNS/sft" ] || cp -r "$work/sft" "$RUNS/sft"
  done
done
