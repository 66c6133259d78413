#!/usr/bin/env bash
# The CI rollout pipeline: build -> verify -> gate -> push. Any red step stops the rollout.
#
#   scripts/rollout.sh CANDIDATE_PLAN BASELINE_PLAN [DEST_URI]
#   scripts/rollout.sh plans/demo-tp3pp2-bf16.yaml plans/demo-tp1pp1-bf16.yaml
#
# Exit codes follow shardc's: 1 = a mismatch or a drifting candidate, 2 = bad input.
set -euo pipefail
cand_plan=${1:?candidate plan}
base_plan=${2:?baseline plan}
dest=${3:-}
shardc=${SHARDC:-shardc}
mkdir -p reports

# Build outside a pipeline, so a failed build exits with shardc's own code (2 = bad input).
out_dir() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])["out_dir"])' "$1"; }
cand_json=$($shardc build "$cand_plan" --json)
base_json=$($shardc build "$base_plan" --json)
cand=$(out_dir "$cand_json")
base=$(out_dir "$base_json")
$shardc verify --manifest "$cand/manifest.json" --json > reports/verify.json
$shardc gate --baseline "$base" --candidate "$cand" --report reports/gate.json
if [ -n "$dest" ]; then
  $shardc push --manifest "$cand/manifest.json" --to "$dest" --json > reports/push.json
else
  $shardc push --manifest "$cand/manifest.json" --json > reports/push.json
fi
echo "rollout of $cand_plan: built, verified, gated and pushed (reports/)"
