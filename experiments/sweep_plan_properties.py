"""A wider sweep of the plan's properties (issue 43) than the CI test runs: tests/test_plan_properties.py's checks
(a) every fix a refusal names, applied, fits; (b) a single setting change that fits is found or named; (c) the auto
plan is not more than 10% slower than a fitting change of its own decisions, over more cases, with one line per
failure, grouped by check; and, report only, (b') the auto plan refused where a change of a decision it searches
(grad_hold, update_on, activations, stream_io) fits by itself.

    .venv/bin/python experiments/sweep_plan_properties.py [--cases 200] [--seed 43] [--budget-free] [--json out.json]

``--budget-free``: without the test's cap on the shapes an optax optimizer is tried on (each shape's update cost
is compiled once, 1-5 s of CPU); ``--uniform-host``: hosts drawn from all of HOST_GB, not only those holding 3-40
bytes per parameter of the shape.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import test_plan_properties as T  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=T.SEED)
    ap.add_argument("--budget-free", action="store_true")
    ap.add_argument("--uniform-host", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = T.sweep_cases(args.cases, args.seed, optax_shapes=None if args.budget_free else T.OPTAX_SHAPES,
                          uniform_host=args.uniform_host)
    found: dict[str, list[dict]] = collections.defaultdict(list)
    t0 = time.time()
    fits = 0
    for i, case in enumerate(cases):
        t = time.time()
        auto = T.auto_plan(case)
        fits += auto.fits
        checks = {"a": T.check_fixes_fit, "b": T.check_refusal_names_what_fits, "c": T.check_auto_is_fastest,
                  "b'": search_misses}
        for name, check in checks.items():
            for problem in check(case):
                found[name].append({"case": case.name, "auto": auto.describe(), "problem": problem})
        print(f"[{i + 1}/{len(cases)}] {case.name}: {'fits' if auto.fits else 'refused'} ({time.time() - t:.1f} s)",
              flush=True)
    print(f"\n{len(cases)} cases, {fits} fit, {time.time() - t0:.0f} s")
    for name in ("a", "b", "c", "b'"):
        rows = found.get(name, [])
        print(f"\n=== ({name}) {len(rows)} failures")
        for r in rows:
            print(f"- {r['case']}\n    auto: {r['auto']}\n    {r['problem']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


def search_misses(case: T.Case) -> list[str]:
    """(b', report only): auto refused, while a single change of a decision the search makes fits."""
    auto = T.auto_plan(case)
    if auto.fits:
        return []
    fitting = [f"{f}={v}" for f, v in T.single_changes(case)
               if T.left_auto(case, f) and T.planned(case, f"{f}={v}").fits]
    return [f"the search's own decision {', '.join(fitting)} fits"] if fitting else []


if __name__ == "__main__":
    sys.exit(main())
