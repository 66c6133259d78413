#!/usr/bin/env bash
# The CI rollout pipeline: build -> verify -> gate -> push. Any red step stops the rollout.
#
#   scripts/rollout.sh [--max-tokens N] CANDIDATE_PLAN BASELINE_PLAN [DEST_URI]
#   scripts/rollout.sh plans/demo-tp3pp2-bf16.yaml plans/demo-tp1pp1-bf16.yaml
#   scripts/rollout.sh --max-tokens 2048 plans/demo-tp3pp2-bf16.yaml plans/demo-tp1pp1-bf16.yaml
#
# --max-tokens: tokens of the golden text the gate scores (default: shardc gate's, 8192).
# shardc is $SHARDC if set, else `shardc` on PATH, else this checkout's .venv/bin/shardc (what
# `make setup` installs), so the script runs from a fresh shell without activating anything.
# Exit codes follow shardc's: 1 = a mismatch or a drifting candidate, 2 = bad input.
set -euo pipefail
gate_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --max-tokens) gate_args+=(--max-tokens "${2:?--max-tokens needs a number}"); shift 2 ;;
    --max-tokens=*) gate_args+=(--max-tokens "${1#*=}"); shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) echo "error: unknown option $1 (hint: scripts/rollout.sh [--max-tokens N] CANDIDATE_PLAN BASELINE_PLAN [DEST_URI])" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "error: usage: scripts/rollout.sh [--max-tokens N] CANDIDATE_PLAN BASELINE_PLAN [DEST_URI]" >&2
  exit 2
fi
cand_plan=$1
base_plan=$2
dest=${3:-}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${SHARDC:-}" ]; then
  shardc=$SHARDC
elif command -v shardc >/dev/null 2>&1; then
  shardc=shardc
elif [ -x "$here/.venv/bin/shardc" ]; then
  shardc=$here/.venv/bin/shardc
else
  echo "error: shardc is not installed (hint: run 'make setup' in $here, or set SHARDC=/path/to/shardc)" >&2
  exit 2
fi
python=python3
[ -x "$here/.venv/bin/python" ] && python=$here/.venv/bin/python
mkdir -p reports

# Build outside a pipeline, so a failed build exits with shardc's own code (2 = bad input).
out_dir() { "$python" -c 'import json,sys; print(json.loads(sys.argv[1])["out_dir"])' "$1"; }
cand_json=$($shardc build "$cand_plan" --json)
base_json=$($shardc build "$base_plan" --json)
cand=$(out_dir "$cand_json")
base=$(out_dir "$base_json")
$shardc verify --manifest "$cand/manifest.json" --json > reports/verify.json
$shardc gate --baseline "$base" --candidate "$cand" --report reports/gate.json ${gate_args[@]+"${gate_args[@]}"}
if [ -n "$dest" ]; then
  $shardc push --manifest "$cand/manifest.json" --to "$dest" --json > reports/push.json
else
  $shardc push --manifest "$cand/manifest.json" --json > reports/push.json
fi
echo "rollout of $cand_plan: built, verified, gated and pushed (reports/)"
