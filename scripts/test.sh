#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environments if needed, then run the whole suite.
# GPU-only tests skip themselves on a machine without a GPU.
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    the fast subset while working: every test not marked slow (tests/conftest.py:
#                                   config, CLI errors, plan, data, optimizer kernels), without the transformers
#                                   reference environment
# Other arguments go to pytest (e.g. --durations=30, or -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
# bytecode cached (tests/conftest.py says why: every subprocess would compile jax's source again); set before the
# environment's import check, which then caches jax's for every worker
unset PYTHONDONTWRITEBYTECODE
if [ "$quick" = 1 ]; then
  bash scripts/setup.sh
  exec .venv/bin/python -m pytest -q -n 2 -m "not slow" "$@"
fi
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
# three workers on CI's two cores, whole files each (module fixtures such as the transformers reference run once per
# file): a worker waiting on its subprocesses (CLI runs, the transformers reference) leaves a core to the third. A
# clean clone took 8m13s with three and 8m52s with two (a 2-core AMD EPYC).
exec .venv/bin/python -m pytest -q -n 3 --dist loadfile "$@"
