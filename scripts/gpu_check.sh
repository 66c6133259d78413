#!/usr/bin/env bash
# One prepared run of every CUDA path of issue 16, with its figures (at most ~5 minutes on one H200).
#   bash scripts/gpu_check.sh                  # DEVICE=cuda, the Llama-8B-shaped synthetic model
#   DEVICE=cpu bash scripts/gpu_check.sh       # the same steps on a tiny model (CI runs this)
# On the device machine the repository arrives without its venv and nothing can be installed: the
# image's python3 carries torch, transformers, tokenizers, safetensors, numba, ml_dtypes, click,
# PyYAML and tqdm, and shardc runs from the checkout (PYTHONPATH). Results: $OUT/gpu_check.json
# (when OUT is set) plus $OUT/gpu_check.log, and the log on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHON="$PY"
"$PY" - <<'PYEOF' || { echo "gpu_check: a needed package is missing for $PY" >&2; exit 2; }
import importlib, sys
missing = [m for m in ("torch", "transformers", "tokenizers", "safetensors", "numba", "ml_dtypes", "click",
                       "yaml", "tqdm", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    print("missing:", ", ".join(missing), file=sys.stderr); sys.exit(1)
import shardc.cli  # noqa: F401  (the checkout itself imports)
PYEOF
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1 || true
  "$PY" scripts/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" scripts/gpu_check.py
