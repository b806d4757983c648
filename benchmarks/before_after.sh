#!/bin/bash
# Speed of this checkout against an earlier commit, interleaved (before, after, before, after, ...) so
# that a change of the machine's load falls on both sides: the demo's wall-clock ratios, CPU decoding
# (`ar` and `lookup` at int4, batch 1) and the serving engine in process. One torch thread per job, one
# job at a time. Accuracy and TPF must come out equal on both sides; tokens/s and wall ratios are what
# a refactor must not move beyond the noise between rounds.
#
#   bash benchmarks/before_after.sh BEFORE_COMMIT [ROUNDS] [OUT]
#
# The earlier commit is checked out into a temporary git worktree and imported from there (PYTHONPATH);
# both sides use this checkout's .venv. Logs and JSON land in OUT (default runs/before-after).
set -euo pipefail
before_ref=${1:?usage: bash benchmarks/before_after.sh BEFORE_COMMIT [ROUNDS] [OUT]}
rounds=${2:-2}
here=$(git rev-parse --show-toplevel)
out=$(realpath -m "${3:-$here/runs/before-after}")
py=$here/.venv/bin/python
before=$(mktemp -d)/before
git -C "$here" worktree add --detach "$before" "$before_ref" >/dev/null
trap 'git -C "$here" worktree remove --force "$before"' EXIT
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for side in before after; do
    dir=$here; [ "$side" = before ] && dir=$before
    echo "== round $round, $side: $(uptime)"
    cd "$dir"
    PYTHONPATH=$dir "$py" benchmarks/cpu_speed.py --only "ar int4" "lookup int4" --n 3 --max-new-tokens 96 \
      --threads 1 --out "$out/cpu_${side}_$round.json" > "$out/cpu_${side}_$round.log" 2>&1
    PYTHONPATH=$dir "$py" benchmarks/serve_load.py --skip one-at-a-time continuous poisson static \
      --server-threads 1 --json "$out/serve_${side}_$round.json" > "$out/serve_${side}_$round.log" 2>&1
    PYTHONPATH=$dir "$py" -m fastforward demo --n 60 --threads 1 --quiet --json "$out/demo_${side}_$round.json" \
      > "$out/demo_${side}_$round.log" 2>&1
  done
done
echo "== done: $(uptime)"
"$py" "$here/benchmarks/before_after_summary.py" "$out"
