"""One GPU against two, on the two-GPU machine, through the user's own command (issue 16).

For each model: ``megatrain-jax train`` on 1 GPU (``train.devices=1``) at the per-GPU batch, on 2 GPUs in
one process (``train.devices=all``, twice the batch: the same tokens per GPU) with the last step's
timeline, and as 2 processes x 1 GPU joined through jax.distributed (the README's launch, one
``CUDA_VISIBLE_DEVICES`` each). Each result carries ``params``, ``tokens_per_s``, ``model_tflops``,
``peak_host_rss_gb`` and the two-GPU ones ``scaling`` (over the one-GPU tokens/s of the same call);
the two-process one also ``over_one_process``. The plan's 1/2-GPU predictions go beside them.

    PYTHONPATH=. python experiments/bench_data_parallel.py --out $OUT \\
        --model "7b_b16=configs/7b.yaml;16" --model "qwen7b_b128=configs/qwen2.5-7b.yaml;128"

A model is NAME=CONFIG;BATCH_PER_GPU[;key=value...]; extra settings go to every run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory_plan import run_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--host-gb", type=float, default=240.0,
                    help="train.host_memory_gb for the one-process runs (the machine's MemTotal grows as it is used); "
                         "each of N processes gets 1/N")
    ap.add_argument("--runs", default="1gpu,2gpu,2proc")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax

    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "gpus": len(jax.devices()), "jax": jax.__version__, "host_cores": os.cpu_count(),
            "command": " ".join(sys.argv)}
    del jax
    for item in args.model:
        name, _, spec = item.partition("=")
        config, batch, *extra = [x for x in spec.split(";") if x]
        b = int(batch)
        runs = {"1gpu": (f"train.devices=1;train.batch_size={b};train.host_memory_gb={args.host_gb}", 1, False),
                "2gpu": (f"train.devices=all;train.batch_size={2 * b};train.host_memory_gb={args.host_gb}", 1, True),
                "2proc": (f"train.batch_size={2 * b};train.host_memory_gb={args.host_gb / 2}", 2, False)}
        res = {}
        for run in args.runs.split(","):
            sets, procs, trace = runs[run]
            case = f"{name}_{run}"
            args.trace = trace
            r = run_case(case, ";".join([config, *extra, *sets.split(";")]), args, procs=procs)
            r.update(meta)
            r["params"] = (r.get("plan") or {}).get("params")
            res[run] = r
            print(f"{case}: rc {r['rc']} tok/s {r.get('tokens_per_s', 0):,.0f} TFLOPS {r.get('model_tflops', 0):.0f} "
                  f"RSS {r.get('peak_host_rss_gb', 0):.1f} GB GPU {r.get('peak_gpu_gb', 0):.1f} GB "
                  f"(plan {r.get('plan_gpu_gb', 0):.1f}) decisions {r.get('decisions')}", flush=True)
            if r["rc"]:
                print(r["log_tail"][-1500:], flush=True)
        one = res.get("1gpu", {}).get("tokens_per_s")
        for run in ("2gpu", "2proc"):
            if run in res and one and res[run].get("tokens_per_s"):
                res[run]["scaling"] = res[run]["tokens_per_s"] / one
        if res.get("2gpu", {}).get("tokens_per_s") and res.get("2proc", {}).get("tokens_per_s"):
            res["2proc"]["over_one_process"] = res["2proc"]["tokens_per_s"] / res["2gpu"]["tokens_per_s"]
        for run, r in res.items():
            with open(os.path.join(args.out, f"dp_{name}_{run}.json"), "w") as f:
                json.dump(r, f, indent=1, default=str)
        print(name, {run: {k: r.get(k) for k in ("tokens_per_s", "model_tflops", "peak_host_rss_gb", "scaling",
                                                 "over_one_process")} for run, r in res.items()}, flush=True)


if __name__ == "__main__":
    main()
