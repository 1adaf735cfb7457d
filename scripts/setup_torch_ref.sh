#!/usr/bin/env bash
# One-time set-up of .venv-torch: a Python 3.11 environment with a CPU-only torch and `transformers`,
# used only by the Hugging Face parity tests (tests/test_hf.py runs tests/hf_reference.py in it).
# PyPI's torch wheel pulls GBs of CUDA libraries, so torch comes from a local CPU wheel for 3.11
# (found in $TORCH_WHEEL_DIR, default /opt/wheels). Every package is pinned by scripts/constraints-torch-ref.txt
# (its header says how to add or upgrade one). Idempotent: a complete .venv-torch built from the same
# constraints is left alone; one built from other constraints (or unfinished) is rebuilt.
# Exit codes: 0 ready, 3 no Python 3.11, 4 no torch wheel (the parity tests then skip), other: failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_VENV:-.venv-torch}
WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
CONSTRAINTS=scripts/constraints-torch-ref.txt
STAMP=$(sha256sum "$CONSTRAINTS" | cut -d' ' -f1)  # written into .ready
if [ -f "$VENV/.ready" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.ready")" = "$STAMP" ]; then
  echo "$VENV ready (already built)"; exit 0
fi
find_python311() {
  for cand in "${PYTHON311:-}" python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  for v in 3.11.7 3.11; do
    if PYENV_VERSION=$v python3.11 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      echo "env PYENV_VERSION=$v python3.11"; return 0
    fi
  done
  return 1
}
PY=$(find_python311) || { echo "error: Python 3.11 not found (fix: install it, or set PYTHON311=/path/to/python3.11)" >&2; exit 3; }
WHEEL=$(ls "$WHEEL_DIR"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n 1 || true)
[ -n "$WHEEL" ] || { echo "error: no torch-2.13.0+cpu cp311 wheel in $WHEEL_DIR (fix: set TORCH_WHEEL_DIR)" >&2; exit 4; }
rm -rf "$VENV"
echo "creating $VENV with $PY and $(basename "$WHEEL")"
$PY -m venv "$VENV"
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's status, not grep's
quiet "$VENV/bin/python" -m pip install -q --no-compile -c "$CONSTRAINTS" --upgrade pip
quiet "$VENV/bin/python" -m pip install -q --no-compile -c "$CONSTRAINTS" "$WHEEL"
# torch is already satisfied by the CPU wheel (and pinned to +cpu), so this never pulls the CUDA build
quiet "$VENV/bin/python" -m pip install -q --no-compile -c "$CONSTRAINTS" "transformers>=4.46,<6" safetensors numpy "peft==0.21.2" "accelerate==1.15.0"
"$VENV/bin/python" -c "import torch, transformers, safetensors, numpy; assert '+cpu' in torch.__version__, torch.__version__; print('torch reference ready: torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$STAMP" > "$VENV/.ready"  # tests/test_hf.py rebuilds an environment without this marker
