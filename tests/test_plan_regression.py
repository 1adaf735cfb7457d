"""A few plans of the plan's regression set (megatrain_jax/bench/regression.py) against a committed
fixture, so that any change to what the plan decides, sizes, predicts or says shows here: the options, the host and
GPU rows and phases, the predicted step, the verdict and its fix, each compared exactly.

A change meant to move plans: check the whole set against its file (``plan_regression_set.py --check FILE``), then
write the fixture again (``.venv/bin/python experiments/plan_regression_set.py --subset --write
tests/fixtures/plan_regression_subset.json``) and say in the change which plans moved and why.
"""
from __future__ import annotations

import functools
import json
import os

import pytest

import megatrain_jax.bench.regression as regression

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = os.path.join(REPO, "tests", "fixtures", "plan_regression_subset.json")


@functools.lru_cache(maxsize=None)
def _expected() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)["cases"]


def test_the_fixture_holds_the_subset():
    assert sorted(_expected()) == sorted(regression.SUBSET)
    names = {c.name for c in regression.cases()}
    assert set(regression.SUBSET) <= names and len(names) >= 150


@pytest.mark.parametrize("name", regression.SUBSET)
def test_the_plan_is_unchanged(name):
    case = {c.name: c for c in regression.cases()}[name]
    got = json.loads(regression.canonical(regression.plan_record(case)))
    expected = _expected()[name]
    diffs = regression.differences(expected, got)
    assert regression.canonical(got) == regression.canonical(expected), \
        f"{name}: {len(diffs)} differences from the fixture:\n  " + "\n  ".join(diffs[:10])
