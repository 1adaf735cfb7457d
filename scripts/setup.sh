#!/usr/bin/env bash
# One-time set-up: a Python >= 3.12 virtual environment in .venv with megatrain-jax and its test
# dependencies. Finds Python 3.12 itself (pyenv installs it without making it the default).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  for v in 3.12.1 3.12 3.13.0; do
    if PYENV_VERSION=$v python3.12 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "env PYENV_VERSION=$v python3.12"; return 0
    fi
  done
  return 1
}
if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "error: Python >= 3.12 not found (fix: install it, or set PYTHON=/path/to/python3.12)" >&2; exit 2; }
  echo "creating .venv with $PY"
  $PY -m venv .venv
fi
# Every package (pip and the build backend included) at the version in scripts/constraints.txt (see its
# header to add or upgrade one). The stamp skips the install while constraints.txt and pyproject.toml are
# unchanged since the last one (offline runs; environments others are using are left alone).
STAMP=.venv/.constraints-stamp
want=$(cat scripts/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's status, not grep's
  quiet .venv/bin/python -m pip install -q --no-compile -c scripts/constraints.txt --upgrade pip
  quiet .venv/bin/python -m pip install -q --no-compile -c scripts/constraints.txt --build-constraint scripts/constraints.txt \
    -e ".[test,plot]"
  echo "$want" > "$STAMP"
fi
.venv/bin/python -c "import megatrain_jax, jax, flax, optax, numba; print('environment ready: jax', jax.__version__)"
