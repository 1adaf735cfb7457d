"""The step model of this tree against steps already measured: each result JSON's config and overrides planned again
for the machine it ran on (its GPU by name, its host limit and cores), the decisions checked against the ones that ran,
and the predicted step set against the measured one. A change to ``plan/step_model.py`` is judged here first, on the
whole record, not on the case it was made for.

    PYTHONPATH=. python experiments/repredict_measured.py RESULT.json [...]   [--json OUT.json]

GPU memory is an H200's or an H100's as nvidia-smi reports it (143771 / 81559 MiB), from the JSON's ``device``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan, target_machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_GB = {"H200": 143771 * 2 ** 20 / 1e9, "H100": 81559 * 2 ** 20 / 1e9}
KEYS = ("grad_hold", "grad_hold_gpu_groups", "update_on", "stream_io", "activations", "keep_residuals",
        "micro_batches", "boundary_every")


def repredict(path: str) -> dict:
    res = json.load(open(path))
    sets = [s for s in res["overrides"] if not s.startswith(("train.out_dir", "train.trace_step"))]
    cfg = load_config(os.path.join(ROOT, res["config"]), sets)
    gpu = next(k for k in GPU_GB if k in res["device"])
    devices = res["decisions"].get("devices", 1)
    machine = dataclasses.replace(
        target_machine(gpu_memory_gb=GPU_GB[gpu], host_memory_gb=res["host_limit_gb"], cpu_cores=res["cores"],
                       gpu_count=devices), gpu_name=res["device"])
    plan = make_plan(cfg, machine, _mode_table=False)
    same = {k: (plan.decisions.get(k), res["decisions"].get(k)) for k in KEYS
            if plan.decisions.get(k) != res["decisions"].get(k)}
    step = plan.step["predicted_step_s"]
    return {"result": os.path.relpath(path, ROOT), "measured_s": res["step_s_median"], "recorded_plan_s":
            res.get("plan_step_s"), "predicted_s": round(step, 2), "over_measured": round(step / res["step_s_median"], 3),
            "binding": plan.step.get("binding"), "decisions_differ": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [repredict(p) for p in args.results]
    for r in rows:
        print(f"{r['over_measured']:6.3f}  measured {r['measured_s']:7.2f}  predicted {r['predicted_s']:7.2f} "
              f"(recorded {r['recorded_plan_s'] or 0:7.2f}) {r['binding']:22s} {r['result']}"
              + (f"  DECISIONS DIFFER {r['decisions_differ']}" if r["decisions_differ"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
