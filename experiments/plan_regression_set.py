"""The plan's regression set: 150+ plans, each as canonical JSON, to check that a change meant to leave the plans
alone (a refactor of ``megatrain_jax/plan/``) leaves every byte of them alone. The set and its checks are
``megatrain_jax/bench/regression.py`` (the test ``tests/test_plan_regression.py`` uses them too).

    .venv/bin/python experiments/plan_regression_set.py --write before.json   # at the commit before the change
    .venv/bin/python experiments/plan_regression_set.py --check before.json   # after it
    .venv/bin/python experiments/plan_regression_set.py --list
    .venv/bin/python experiments/plan_regression_set.py --subset --write tests/fixtures/plan_regression_subset.json

``--check`` exits 1 on any difference, naming each case that differs and the first fields where it does.
``--only NAME [NAME ...]`` restricts to those cases.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from megatrain_jax.bench.regression import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
