"""The memory plan against what the trainer really uses, through the user's own command.

For each case: ``megatrain-jax plan --json`` (the prediction), then ``megatrain-jax train`` in a
child process with no hand-set environment variable (the plan sets XLA's budgets itself), sampling
the child's RSS and the machine's used memory from outside. Reported per case: tokens/s and model
TFLOPS (median of the steps after the first two; the second alone where only two ran), peak host RSS (VmHWM) and peak GPU memory
(XLA's ``peak_bytes_in_use``) next to the plan's figures, and whether the run survived.

    PYTHONPATH=. python experiments/bench_memory_plan.py --out $OUT \\
        --case 7b_b16=configs/7b.yaml --case "7b_b32=configs/7b.yaml;train.batch_size=32"

A case is NAME=CONFIG[;key=value;...]. Every case adds train.final_checkpoint=false,
model.init=fast (uniform weights with the nnx std, drawn in seconds: the benchmark measures the
step, not the initialiser), train.steps=--steps and a fresh out_dir.

``--end-after-last-step S`` ends a case S seconds after its last step's record if the process has not exited by
then (a 110B run takes ~150 s to give its 500 GB back: device time that measures nothing); ``--limit-s`` ends a case
at that wall time. Either way the case's JSON is still written, from the steps it recorded, with ``ended_by_bench``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from megatrain_jax.bench.runner import run_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", required=True, help="NAME=CONFIG[;key=value;...]")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trace", action="store_true", help="record the last step's per-layer timeline (train.trace_step); "
                    "that step is left out of the median")
    ap.add_argument("--end-after-last-step", type=float, default=None, metavar="S",
                    help="end a case S seconds after its last step's record if it has not exited")
    ap.add_argument("--limit-s", type=float, default=None, help="end a case at this wall time (its JSON still written)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax  # only to name the device in the results (the children start their own backends)

    dev = jax.devices()[0]
    meta = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "jax": jax.__version__,
            "host_cores": os.cpu_count(), "command": " ".join(sys.argv)}
    del jax, dev
    rows = []
    for item in args.case:
        name, _, spec = item.partition("=")
        print(f"== {name}: {spec}", flush=True)
        r = run_case(name, spec, args)
        r.update(meta)
        with open(os.path.join(args.out, f"plan_{name}.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)
        rows.append(r)
        print(f"   rc {r['rc']}, steps {r['steps_done']}, step {r.get('step_s_median', float('nan')):.3f}s, "
              f"tok/s {r.get('tokens_per_s', 0):,.0f}, TFLOPS {r.get('model_tflops', 0):.0f}, "
              f"RSS {r.get('peak_host_rss_gb', 0):.1f} GB (plan {r.get('plan_host_gb', 0):.1f}), "
              f"GPU {r.get('peak_gpu_gb', 0):.1f} GB (plan {r.get('plan_gpu_gb', 0):.1f}), "
              f"{r.get('host_bytes_per_param_measured', 0):.2f} B/param; decisions {r.get('decisions')}", flush=True)
        if r["rc"]:
            print(r["log_tail"][-1500:], flush=True)
    print("\ncase | rc | step s | tok/s | TFLOPS | +attn | RSS GB (plan) | GPU GB (plan) | B/param")
    for r in rows:
        print(f"{r['case']} | {r['rc']} | {r.get('step_s_median', float('nan')):.3f} | {r.get('tokens_per_s', 0):,.0f} | "
              f"{r.get('model_tflops', 0):.0f} | {r.get('model_tflops_with_attention', 0):.0f} | "
              f"{r.get('peak_host_rss_gb', 0):.1f} ({r.get('plan_host_gb', 0):.1f}) | "
              f"{r.get('peak_gpu_gb', 0):.1f} ({r.get('plan_gpu_gb', 0):.1f}) | "
              f"{r.get('host_bytes_per_param_measured', 0):.2f}")


if __name__ == "__main__":
    main()
