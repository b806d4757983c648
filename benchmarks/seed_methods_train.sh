#!/usr/bin/env bash
# Issue 81's trainings: every seed method on one base (SmolLM2-135M), one data set (the arithmetic task's 4,000
# train problems in its varied wording, the presets' range) and one shared start (the preset
# smollm2-135m-arithmetic-start: `benchmarks/arithmetic_start_data.py`, then `benchmarks/ship_start.py`), in steps
# that fit a 3-hour session. Each step is one version: version 1 trains the method from the shared start (MultiTF:
# from an SBD version), version N continues version N-1 (`--from`); each version trains, measures itself on the
# dev split and ships to $RUNS/smollm2-135m-METHOD-arithmetic-vN. Rerun a step's command to resume it.
#
#   bash benchmarks/seed_methods_train.sh sbd 1 40min          # SBD version 1: 40 minutes of training
#   bash benchmarks/seed_methods_train.sh sbd 2 2h             # version 2 continues version 1
#   SBD=2 bash benchmarks/seed_methods_train.sh multitf 1 1h   # MultiTF from SBD version 2
#   bash benchmarks/seed_methods_train.sh setdlm 1 2h
#   bash benchmarks/seed_methods_train.sh jacobi-forcing 1 2h
#
# Rows of 256 tokens, 16 a step, 8 a forward (the recipes' default is 8 x 512, the same tokens): the dual-stream
# objectives attend over twice a row, and on 2 AVX2 cores SBD trained 1.15x faster per token at 256 than at 512
# (`python benchmarks/train_speed.py --objectives sbd ntp --contenders float32+lora --seq-len 512 256
# --batch-size 2 --rounds 2`: 165 against 143 tokens/s); 8 rows a forward keep SBD's peak memory within a 24 GB
# machine. The dev evaluation is kept short (2 curve points of 10 prompts, 20 for the final rows) to fit a session;
# `python benchmarks/seed_methods.py` measures the shipped versions on the test split for the table.
set -euo pipefail
cd "$(dirname "$0")/.."
METHOD=${1:?method: sbd, multitf, setdlm or jacobi-forcing}
VERSION=${2:?version: 1, 2, ...}
BUDGET=${3:?budget: 40min, 2h, 500k ...}
FF=${FF:-.venv/bin/fastforward}
RUNS=${RUNS:-runs}
START=${START:-smollm2-135m-arithmetic-start}
TASK=(--task arithmetic --problems 4000 --task-option min_ops=2 --task-option max_ops=3 --task-option max_number=20
      --task-option max_factor=5 --task-option phrasing=varied --targets reference --threads 2
      --seq-len 256 --batch-size 16 --micro-batch 8 --curve 2 --curve-n 10 --final-n 20)
shipped() { echo "$RUNS/smollm2-135m-$1-arithmetic-v$2"; }
if [ "$VERSION" -gt 1 ]; then
  FROM=(--from "$(shipped "$METHOD" $((VERSION - 1)))")
elif [ "$METHOD" = multitf ]; then
  FROM=(--start "$(shipped sbd "${SBD:?SBD: the SBD version MultiTF starts from}")")
else
  FROM=(--start "$START")
fi
$FF recipe "$METHOD" "${TASK[@]}" "${FROM[@]}" --work "$RUNS/$METHOD-v$VERSION" --budget "$BUDGET" \
  --ship-to "$(shipped "$METHOD" "$VERSION")"
