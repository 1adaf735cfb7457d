#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environments if needed, then run the whole suite.
# GPU-only tests skip themselves on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# the two environments build side by side (their installs wait mostly on the disk and the package index)
mkdir -p .pytest_cache
bash scripts/setup_torch_ref.sh > .pytest_cache/setup_torch_ref.log 2>&1 &
torch_ref=$!
bash scripts/setup.sh
if wait "$torch_ref"; then
  tail -n 1 .pytest_cache/setup_torch_ref.log
else
  cat .pytest_cache/setup_torch_ref.log
  echo "warning: transformers reference environment not built; the tests that need it will retry or skip"
fi
# bytecode cached (tests/conftest.py says why: every subprocess would compile jax's source again)
unset PYTHONDONTWRITEBYTECODE
# two workers, whole files each (module fixtures such as the transformers reference run once per file)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
