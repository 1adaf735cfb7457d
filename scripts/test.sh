#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environments if needed, then run the whole suite.
# GPU-only tests skip themselves on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_torch_ref.sh || echo "warning: transformers reference environment not built; tests/test_hf.py will retry or skip"
# two workers, whole files each (module fixtures such as the transformers reference run once per file)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
